"""Combined 1F1B's two streams (cost_models/paired_passes.py) against independent truth: the longest path of
the task graph (networkx) where the comm holds no SMs, a step-by-step run of the two streams where it does,
the closed form of one all-to-all beside one compute, and a schedule worked by hand."""
import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.expert_comm import exposed_beside_compute
from cost_models.paired_passes import (COMM, COMPUTE, LayerPassParts, StreamTask, combined_1f1b_exposed_floor_s,
                                       combined_1f1b_exposed_s, combined_1f1b_tasks, two_stream_seconds)

seconds = st.floats(min_value=0.0, max_value=5.0)


@st.composite
def pass_parts(draw, backward: bool):
    weight = seconds if backward else st.just(0.0)
    return LayerPassParts(draw(seconds), draw(weight), draw(seconds), draw(weight), draw(seconds), draw(seconds))


def longest_path_seconds(tasks: list[StreamTask]) -> float:
    """Each task starts when its stream's previous task and those it waits on end: with nothing shared, the
    end of the last task is the heaviest path through those edges."""
    graph = nx.DiGraph()
    for task in tasks:
        graph.add_node(task.name, weight=task.seconds)
        graph.add_edges_from((before, task.name) for before in task.after)
    for stream in (COMPUTE, COMM):
        names = [t.name for t in tasks if t.stream == stream]
        graph.add_edges_from(zip(names, names[1:]))
    ends = {}
    for name in nx.topological_sort(graph):
        ends[name] = max((ends[p] for p in graph.predecessors(name)), default=0.0) + graph.nodes[name]["weight"]
    return max(ends.values())


def stepped_seconds(tasks: list[StreamTask], held_share: float, step: float, comm_rate: float = 1.0) -> float:
    """The two streams run in small time steps: a stream's head task advances once what it waits on is done,
    compute at (1 - held_share) and comm at comm_rate while both advance in the same step."""
    left = {t.name: t.seconds for t in tasks}
    queues = {s: [t for t in tasks if t.stream == s] for s in (COMPUTE, COMM)}
    done, now = set(), 0.0
    while any(queues.values()):
        ready = {s: q[0] for s, q in queues.items() if q and all(a in done for a in q[0].after)}
        both = sum(left[task.name] > 0 for task in ready.values()) == 2
        for stream, task in ready.items():
            rate = ((1 - held_share) if stream == COMPUTE else comm_rate) if both else 1.0
            left[task.name] -= step * rate
        for stream, task in ready.items():
            if left[task.name] <= 0:
                done.add(task.name)
                queues[stream].pop(0)
        now += step
    return now


@settings(max_examples=60, deadline=None)
@given(pass_parts(False), pass_parts(True), st.integers(1, 4), st.booleans())
def test_with_no_sms_held_the_pair_takes_the_longest_path_of_its_tasks(forward, backward, layers, delay):
    tasks = combined_1f1b_tasks(forward, backward, layers, delay)
    assert two_stream_seconds(tasks, 0.0) == pytest.approx(longest_path_seconds(tasks), rel=1e-9, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(pass_parts(False), pass_parts(True), st.integers(1, 2), st.floats(0.05, 0.5), st.floats(0.25, 1.0))
def test_held_sms_and_the_comm_rate_slow_the_streams_as_a_step_by_step_run_does(forward, backward, layers, share,
                                                                                 rate):
    tasks = combined_1f1b_tasks(forward, backward, layers, True)
    step = max(1.0, sum(t.seconds for t in tasks)) / 20000
    assert two_stream_seconds(tasks, share, rate) == pytest.approx(stepped_seconds(tasks, share, step, rate),
                                                                   abs=len(tasks) * 2 * step / rate)



@settings(max_examples=80, deadline=None)
@given(pass_parts(False), pass_parts(True), st.integers(1, 40), st.sampled_from([0.0, 0.1, 0.3, 0.8]), st.booleans(),
       st.sampled_from([1.0, 0.6, 0.349]))
def test_a_chunk_of_many_layers_is_its_first_pairs_and_their_steady_increment(forward, backward, layers, share,
                                                                              delay, rate):
    """The exposure of a chunk of identical layers, taken from its first pairs and the steady increment, is the
    whole two-stream run of every pair."""
    whole = two_stream_seconds(combined_1f1b_tasks(forward, backward, layers, delay), share, rate) / layers \
        - forward.compute_s - backward.compute_s
    scale = forward.compute_s + backward.compute_s + sum(
        (forward.dispatch_s, forward.combine_s, backward.dispatch_s, backward.combine_s))
    assert combined_1f1b_exposed_s(forward, backward, layers, share, delay, rate) == pytest.approx(
        whole, rel=1e-9, abs=1e-12 * max(scale, 1.0) / rate)

@settings(max_examples=120, deadline=None)
@given(pass_parts(False), pass_parts(True), st.integers(1, 12), st.sampled_from([0.0, 0.1, 0.3, 0.8]),
       st.sampled_from([1.0, 0.349, 0.1]))
def test_the_pairs_floor_is_at_or_below_a_step_by_step_run_of_every_chunk(forward, backward, layers, share, rate):
    """The search bounds combined 1F1B's exposure by its floor (at full speed max(A - W, held A) per pair) before
    running the streams: at or below a step-by-step run of the streams (an independent integration) for any chunk
    and any rate of the comm beside compute, above or below the held share."""
    tasks = combined_1f1b_tasks(forward, backward, layers, True)
    scale = max(1.0, sum(t.seconds for t in tasks))
    stepped = stepped_seconds(tasks, share, 1e-3 * scale / len(tasks), rate) / layers \
        - forward.compute_s - backward.compute_s
    floor = combined_1f1b_exposed_floor_s(forward, backward, share, rate)
    assert floor <= stepped + 2e-3 * scale / rate
    assert floor <= combined_1f1b_exposed_s(forward, backward, layers, share, True, rate) + 1e-12 * scale


@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(0.0, 0.9), st.floats(0.05, 1.0))
def test_the_pairs_floor_is_exact_for_one_all_to_all_beside_one_compute(a2a, compute, share, rate):
    """With the comm all in the forward's dispatch and the compute all in the backward's experts, nothing orders
    them (the dispatch waits only for an empty attention): the pair is the closed form of one all-to-all beside one
    compute, which the floor meets exactly where the comm outruns the held share and is below otherwise."""
    forward = LayerPassParts(0.0, 0.0, 0.0, 0.0, a2a, 0.0)
    backward = LayerPassParts(0.0, 0.0, compute, 0.0, 0.0, 0.0)
    exposed = combined_1f1b_exposed_s(forward, backward, 1, share, True, rate)
    floor = combined_1f1b_exposed_floor_s(forward, backward, share, rate)
    assert floor <= exposed + 1e-9
    if rate > share:
        assert floor == pytest.approx(exposed, abs=1e-9)


def test_the_pairs_floor_is_the_all_to_alls_without_compute_beside_them():
    alone = LayerPassParts(0.0, 0.0, 0.0, 0.0, 1.0, 2.0)
    assert combined_1f1b_exposed_floor_s(alone, alone, 0.3) == pytest.approx(6.0)
    assert combined_1f1b_exposed_s(alone, alone, 5, 0.3, True) == pytest.approx(6.0)


@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(0.0, 0.9))
def test_one_all_to_all_beside_one_compute_is_the_closed_form(a2a, compute, share):
    tasks = [StreamTask("compute", COMPUTE, compute), StreamTask("a2a", COMM, a2a)]
    assert two_stream_seconds(tasks, share) - compute == pytest.approx(
        max(0.0, exposed_beside_compute(a2a, compute, share)), abs=1e-9)


@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.floats(0.0, 0.9), st.floats(0.2, 1.0))
def test_one_all_to_all_beside_one_compute_at_a_comm_rate_is_the_closed_form(a2a, compute, share, rate):
    """Worked by hand: both start together, compute at (1 - h), comm at r. Where the comm ends first (a / r <=
    c / (1 - h)) the compute has c - (1 - h) a / r left, alone: the pair takes c + h a / r. Otherwise the compute
    ends at c / (1 - h) with r c / (1 - h) of the comm done, the rest alone: a + (1 - r) c / (1 - h)."""
    tasks = [StreamTask("compute", COMPUTE, compute), StreamTask("a2a", COMM, a2a)]
    if a2a / rate <= compute / (1 - share):
        expected = compute + share * a2a / rate
    else:
        expected = a2a + (1 - rate) * compute / (1 - share)
    assert two_stream_seconds(tasks, share, rate) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_a_short_attention_forward_exposes_the_combine_gradient_beside_it():
    """Worked by hand in Megatron-Core's order (model_chunk_schedule_plan.py): the combine's gradient (1 s)
    runs beside the forward's attention (0.1 s) and the backward's experts wait for it, 0.9 s exposed; the
    backward's attention waits for the expert forward, after which the forward's combine (1 s) ends with only
    0.2 s beside it, 0.8 s more: 32 s against 30.3 s of compute. Pairing whole passes would expose nothing."""
    forward = LayerPassParts(0.1, 0.0, 10.0, 0.0, 1.0, 1.0)
    backward = LayerPassParts(0.2, 0.0, 20.0, 0.0, 1.0, 1.0)
    assert combined_1f1b_exposed_s(forward, backward, 1, 0.0, True) == pytest.approx(1.7)
    whole_passes = exposed_beside_compute(2.0, backward.compute_s, 0.0) + exposed_beside_compute(
        2.0, forward.compute_s, 0.0)
    assert whole_passes == 0


def test_delayed_weight_gradients_run_beside_the_dispatch_gradient():
    """--delay-wgrad-compute, worked by hand: the experts' weight gradients (3 s) run from 2 s to 5 s beside
    the dispatch backward (2-4 s), then the expert forward, the combine and the attention backward, ending at
    7 s; issued with the input gradients, they hold the dispatch backward to 5-7 s and the attention backward
    to 7-8 s."""
    forward = LayerPassParts(1.0, 0.0, 1.0, 0.0, 0.5, 0.5)
    backward = LayerPassParts(1.0, 0.0, 1.0, 3.0, 0.5, 2.0)
    compute = forward.compute_s + backward.compute_s
    assert combined_1f1b_exposed_s(forward, backward, 1, 0.0, True) == pytest.approx(7.0 - compute)
    assert combined_1f1b_exposed_s(forward, backward, 1, 0.0, False) == pytest.approx(8.0 - compute)


def test_a_published_ab_of_combined_1f1b_is_predicted_both_ways():
    """Megatron-Bridge PR #5094's controlled A/B (Qwen3 30B-A3B on 16 H100, TP1 PP1 EP16, HybridEP, only
    overlap_moe_expert_parallel_comm switched: 24.714 s -> 20.992 s), never fitted, through `planner.evaluate`:
    each arm within 25% of its measured step, combined 1F1B faster, and the seconds the model says it saves within
    a factor 1.5 of those it saved (benchmarks/setting_ab.py reports 0.80x). Its Nsight comparison gives the H100
    profile's dispatch rate beside compute, so the size of the saving is not independent here; the next test's is."""
    from benchmarks.setting_ab import AB, predict
    result = predict(AB[0])
    assert result.off.fits and result.on.fits and result.on.layout.moe_a2a_overlap
    assert result.off.step_time_s == pytest.approx(AB[0].measured_off_s, rel=0.25)
    assert result.on.step_time_s == pytest.approx(AB[0].measured_on_s, rel=0.25)
    assert 1 / 1.5 <= result.saved_predicted_s / result.saved_measured_s <= 1.5


def test_the_model_zoo_ab_of_combined_1f1b_saves_what_it_measured():
    """Megatron-Core's MoE model zoo (yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md @e865051):
    Qwen3-235B-A22B on 256 H100, DeepEP at TP2 EP32 PP8 VP4, 19.7 s without combined 1F1B and 17.6 s with it at
    the same commit; never fitted, and independent of the H100 dispatch rate's source. The model's saving is
    within a factor 1.5 of the measured 2.1 s (with the kernels at full speed beside compute it credited 4.9 s)."""
    import yaml
    from benchmarks.ranking import SWEEPS, variant_layout
    from planner import evaluate
    entry = next(e for e in yaml.safe_load(SWEEPS.read_text()) if "moe_dev f3e6c5" in e["name"])
    steps = {}
    for variant in entry["variants"]:
        plan = evaluate(entry["model"], layout=variant_layout(variant), device=entry["device"],
                        num_devices=entry["num_devices"], global_batch=entry["global_batch"], seq_len=entry["seq_len"],
                        precision=entry["precision"], stack=entry["stack"], time_limit_s=20)
        steps["a2a_overlap=true" in variant["settings"]] = (plan.step_time_s, variant["measured"])
    (off_s, off_measured), (on_s, on_measured) = steps[False], steps[True]
    assert 1 / 1.5 <= (off_s - on_s) / (off_measured - on_measured) <= 1.5


def test_the_alltoall_ab_of_combined_1f1b_is_predicted_both_ways():
    """Megatron-Bridge's alltoall-dispatcher smoke (Qwen3 30B-A3B on 16 H100, EP16, no CUDA graphs; no overlap
    41.25 s, combined 1F1B with delayed weight gradients 31.20 s), never fitted, through `planner.evaluate`: each
    arm within 25% of its measured step and combined 1F1B faster. What the model says it saves is reported, not
    bounded here (docs/setting-ab.md: 1.60x of what it saved; no profile measured NCCL's all-to-all beside compute,
    so it is billed at full speed there)."""
    from benchmarks.setting_ab import AB, predict
    ab = next(ab for ab in AB if "alltoall dispatcher" in ab.name)
    result = predict(ab)
    assert result.off.fits and result.on.fits and result.on.layout.moe_a2a_overlap
    assert result.off.layout.moe_dispatcher == result.on.layout.moe_dispatcher == "alltoall"
    assert result.off.step_time_s == pytest.approx(ab.measured_off_s, rel=0.25)
    assert result.on.step_time_s == pytest.approx(ab.measured_on_s, rel=0.25)
    assert result.on.step_time_s < result.off.step_time_s
