"""DualPipeV (torch ScheduleDualPipeV, torchtitan's DualPipeV, MindSpeed's --schedules-method dualpipev):
the critical path and the activations in flight against a replay of torch's own action list, the search's
partition against an enumeration of every split, its bounds, and the rules that refuse what a stack lacks."""
import itertools
import random
from dataclasses import replace

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _Action, _ComputationType as Op

from cost_models.layer_costs import MeshCosts
from cost_models.layout import Layout, Recompute
from cost_models.pipeline import (RankPasses, dualpipev_in_flight, dualpipev_seconds, dualpipev_split_recompute_factor,
                                  dualpipev_weight_factor)
from cost_models.step_time import estimate
from hardware_profiles import UserInputError
from hardware_profiles.loader import load_stack
from planner.api import evaluate, plan
from planner.graph_capture.model_capture import capture
from planner.search.bounds import Bounds, balanced_bound, communication_bound, pipeline_bound, work_before_zero, work_floor
from planner.rules.pins import Pins
from planner.rules.stack import stack_pins
from planner.search.branch_and_bound import search
from test_search import compositions, mixed_moe_model, small_cluster

TORCHTITAN = load_stack("torchtitan")
MINDSPEED = load_stack("mindspeed")


def torch_actions(ranks: int, micro_batches: int, weight_split_in_cooldown: bool = True) -> dict[int, list]:
    """torch's DualPipeV action list per rank (its `_calculate_single_rank_operations`, which needs no process
    group); without the cooldown's split (MindSpeed's default), the backward after the last overlapped pair
    runs whole and its weight action goes."""
    schedule = ScheduleDualPipeV.__new__(ScheduleDualPipeV)
    schedule.pp_group_size, schedule._n_microbatches = ranks, micro_batches
    order = {rank: schedule._calculate_single_rank_operations(rank) for rank in range(ranks)}
    if weight_split_in_cooldown:
        return order
    for rank, actions in order.items():
        last_pair = max(i for i, a in enumerate(actions) if a.computation_type == Op.OVERLAP_F_B)
        whole = {(a.stage_index, a.microbatch_index) for a in actions[last_pair:]
                 if a.computation_type == Op.BACKWARD_INPUT}
        order[rank] = [_Action(a.stage_index, Op.FULL_BACKWARD, a.microbatch_index) if i > last_pair and
                       a.computation_type == Op.BACKWARD_INPUT else a for i, a in enumerate(actions)
                       if not (a.computation_type == Op.BACKWARD_WEIGHT and (a.stage_index, a.microbatch_index) in whole)]
    return order


def replay(order: dict[int, list], ranks: int, forward: float, backward_input: float, weight: float,
           pair: float, split_extra: float = 0.0) -> float:
    """Each rank runs its actions in order, each as soon as its inputs exist (the previous stage's forward,
    the next stage's input gradient); an overlapped pair takes `pair` seconds, a split weight pass of any
    stage but the first `split_extra` more (what it recomputes per parameter group). Returns the last finish."""
    stages, done, free, position = 2 * ranks, {}, [0.0] * ranks, [0] * ranks
    seconds = {Op.FORWARD: forward, Op.BACKWARD_INPUT: backward_input, Op.BACKWARD_WEIGHT: weight,
               Op.FULL_BACKWARD: backward_input + weight}

    def needs(a):
        s, i = a.stage_index, a.microbatch_index
        if a.computation_type == Op.FORWARD:
            return [] if s == 0 else [("F", s - 1, i)]
        if a.computation_type == Op.BACKWARD_WEIGHT:
            return [("I", s, i)]
        return [("F", s, i)] + ([] if s == stages - 1 else [("I", s + 1, i)])

    def makes(a):
        s, i = a.stage_index, a.microbatch_index
        return {Op.FORWARD: ["F"], Op.BACKWARD_INPUT: ["I"], Op.FULL_BACKWARD: ["I", "W"],
                Op.BACKWARD_WEIGHT: ["W"]}[a.computation_type], s, i

    moved = True
    while moved:
        moved = False
        for rank in range(ranks):
            while position[rank] < len(order[rank]):
                action = order[rank][position[rank]]
                parts = action.sub_actions if action.computation_type == Op.OVERLAP_F_B else (action,)
                inputs = [key for part in parts for key in needs(part)]
                if not all(key in done for key in inputs):
                    break
                start = max([free[rank]] + [done[key] for key in inputs])
                free[rank] = start + (pair if action.computation_type == Op.OVERLAP_F_B else seconds[action.computation_type])
                if action.computation_type == Op.BACKWARD_WEIGHT and action.stage_index:
                    free[rank] += split_extra
                for part in parts:
                    kinds, s, i = makes(part)
                    done.update({(k, s, i): free[rank] for k in kinds})
                position[rank] += 1
                moved = True
    assert all(position[r] == len(order[r]) for r in range(ranks)), "the action list deadlocked"
    return max(free)


def closed_form(ranks, micro_batches, forward, backward_input, weight, pair, split=True) -> float:
    """`dualpipev_seconds` for uniform chunks: a rank's two chunks are twice one chunk's times."""
    backward = backward_input + weight
    alone = 2 * (forward + backward)
    rank = RankPasses(paired_s=2 * pair, alone_s=alone,
                      bubble_s=alone + 2 * backward - dualpipev_weight_factor(split) * 2 * weight)
    return dualpipev_seconds([rank] * ranks, micro_batches)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("ranks,micro_batches", [(2, 4), (2, 9), (4, 8), (4, 16), (8, 16), (8, 35), (16, 32)])
def test_critical_path_is_torchs_action_list_replayed(ranks, micro_batches, split):
    """Equal forward, input-gradient and weight-gradient chunks (and the weight part at half): the closed form
    is the replay of torch's own list exactly, for every overlapped pair's time from none of it hidden
    (F + B) to all (max(F, B))."""
    order = torch_actions(ranks, micro_batches, split)
    for forward, backward_input, weight in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5)):
        backward = backward_input + weight
        for pair in (forward + backward, forward + backward - 0.4, max(forward, backward) + 0.1):
            truth = replay(order, ranks, forward, backward_input, weight, pair)
            assert closed_form(ranks, micro_batches, forward, backward_input, weight, pair, split) \
                == pytest.approx(truth, rel=1e-12)


def test_critical_path_stays_within_three_percent_of_the_replay_at_other_ratios():
    """Input and weight gradients 0.8-1.3 and 0.7-1.2 of the forward, any share of a pair hidden, 2p to 6p
    micro-batches: the closed form the solver can use is within 3% of torch's list replayed (it is exact at
    equal parts; the largest misses are at the fewest micro-batches)."""
    rng = random.Random(7)
    worst = 0.0
    for _ in range(150):
        ranks = rng.choice((2, 3, 4, 6, 8))
        micro_batches = rng.randint(2 * ranks, 6 * ranks)
        backward_input, weight = rng.uniform(0.8, 1.3), rng.uniform(0.7, 1.2)
        pair = rng.uniform(max(1.0, backward_input + weight), 1.0 + backward_input + weight)
        truth = replay(torch_actions(ranks, micro_batches), ranks, 1.0, backward_input, weight, pair)
        worst = max(worst, abs(closed_form(ranks, micro_batches, 1.0, backward_input, weight, pair) / truth - 1))
    assert worst < 0.03


@pytest.mark.parametrize("ranks,micro_batches", [(2, 8), (4, 8), (4, 16), (8, 16), (8, 32), (16, 32)])
def test_split_weight_passes_recomputing_per_group_cost_what_the_replay_says(ranks, micro_batches):
    """torch's split weight pass recomputes a checkpointed layer once per parameter group (measured:
    docs/runtime.md). With that much more work x in each split weight pass of a stage past the first (x from 4
    to 20 chunk forwards: 9-13 groups per layer, a full recomputation about one forward), the step the closed
    form bills, (2p - 1)/2 times a rank's extra per pass (`dualpipev_split_recompute_factor` in the bubble term),
    is within 5% of torch's list replayed, and never below the replay without it."""
    order = torch_actions(ranks, micro_batches)
    factor = dualpipev_split_recompute_factor(ranks, True)
    for x in (4.0, 8.0, 20.0):
        truth = replay(order, ranks, 1.0, 1.0, 1.0, 3.0, split_extra=x)
        # a rank is two chunks: F = B_input = W = 1, a pair 3; its extra per split pass is both chunks' x
        rank = RankPasses(paired_s=2 * 3.0, alone_s=2 * 3.0, bubble_s=2 * 3.0 + 2 * 2.0 - 3 * 2 * 1.0 + factor * 2 * x)
        billed = dualpipev_seconds([rank] * ranks, micro_batches)
        assert billed == pytest.approx(truth, rel=0.05), x
        assert billed > replay(order, ranks, 1.0, 1.0, 1.0, 3.0)


@pytest.mark.parametrize("ranks,micro_batches", [(2, 4), (4, 8), (4, 17), (8, 16), (16, 40)])
def test_every_rank_holds_2p_plus_1_chunks_of_activations(ranks, micro_batches):
    """Counting forwards made and backwards done in torch's list (a pair's forward allocates before its
    backward frees; a split backward frees at its weight action): every rank peaks at 2p + 1 chunks, p + 1/2
    of its layers' activations (DualPipe's table: PP + 1 stages)."""
    for actions in torch_actions(ranks, micro_batches).values():
        live = peak = 0
        for action in actions:
            parts = action.sub_actions if action.computation_type == Op.OVERLAP_F_B else (action,)
            for part in parts:
                live += part.computation_type == Op.FORWARD
                peak = max(peak, live)
            live -= sum(part.computation_type in (Op.FULL_BACKWARD, Op.BACKWARD_WEIGHT) for part in parts)
        assert peak == 2 * ranks + 1 == 2 * dualpipev_in_flight(ranks)


def dualpipev_stack(hides: bool):
    """torchtitan's DualPipeV, its pairs hiding MoE all-to-alls or not, its split weight passes recomputing no
    more than a whole backward (the partition alone; the per-group recomputation is checked apart)."""
    return TORCHTITAN.model_copy(update={"dualpipev_hides_moe_a2a": hides, "dualpipev_weight_pass_recompute": False})


@pytest.mark.parametrize("hides", [False, True])
@pytest.mark.parametrize("pp,dp,ep,zero", [(2, 16, 2, 2), (4, 8, 8, 0)])
def test_pinned_search_equals_the_best_split_by_enumeration(pp, dp, ep, zero, hides):
    """DualPipeV pinned on a model of dense and expert layers, memory a quarter of the way from the even
    split's need with full recomputation to its need without: the search's plan (at the enumeration's rank
    order) is the best of every split into 2 pp chunks placed as a V and every per-layer recomputation,
    enumerated through `estimate`; every bound of the search's levels is at or below it."""
    graph, stack = capture(mixed_moe_model(seq=4096)), dualpipev_stack(hides)
    choices = (Recompute.none, Recompute.full)
    base = Layout(dp=dp, tp=32 // (pp * dp), pp=pp, vp=2, ep=ep, global_batch=64, zero=zero, dualpipev=True)
    roomy = small_cluster(32, 80)
    need = [estimate(graph.costs(), roomy, replace(base, recompute=r), stack).peak_memory_bytes for r in choices]
    reserve = roomy.device.memory_reserve
    cluster = small_cluster(32, ((need[1] + (need[0] - need[1]) / 4) / (1 - reserve.fragmentation_fraction)
                                 + reserve.runtime_context_bytes) / 1e9)
    costs = MeshCosts(graph.costs(), cluster, base, stack)
    best = None
    for parts in compositions(graph.num_blocks, 2 * pp):
        for rec in itertools.product(choices, repeat=graph.num_blocks):
            result = estimate(graph.costs(), cluster, replace(base, stage_layers=parts, layer_recompute=rec),
                              mesh_costs=costs)
            if result.fits and (best is None or result.step_time_s < best.step_time_s):
                best = result
    # the enumeration's rank order, pinned: the search would also weigh others
    pins = stack_pins(Pins(dp=dp, tp=base.tp, pp=pp, cp=1, ep=ep, etp=1, mbs=1, zero=zero, schedule="dualpipev",
                           order=base.mesh_order), stack, graph)
    # a work limit the leaf's CP-SAT model proves its optimum within (the default's cut is said, not checked here)
    outcome = search(graph.costs(), cluster, 64, pins, stack=stack, graph=graph, top_k=1, recompute_choices=choices,
                     leaf_work_limit=60.0)
    assert best is not None and outcome.unexplored == 0 and outcome.complete
    found = outcome.ranked[0].estimate
    assert found.layout.dualpipev and found.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    assert Recompute.full in best.layer_recompute   # memory made recomputation part of the answer
    bounds = Bounds(graph.costs(), cluster, stack, choices)
    work = work_floor(*work_before_zero(costs, Recompute.none), pp, 2, True)
    tol = 1 + 1e-9
    assert pipeline_bound(bounds.compute_work_s(base), base) <= communication_bound(work, costs.p2p_s(), base) * tol
    assert communication_bound(work, costs.p2p_s(), base) <= balanced_bound(costs, base) * tol
    assert balanced_bound(costs, base) <= best.step_time_s * tol
    assert bounds.memory_floor(base)[0] <= max(m.total for m in best.stage_memory)


def test_the_search_chooses_dualpipev_where_it_is_faster_and_says_so(tmp_path):
    """torchtitan on 16 H100 with four pipeline ranks, 16 micro-batches: DualPipeV's bubble (p - 1)/2 (F + 2B -
    3W) is below interleaving's at two chunks, and the search weighs both; the plan file keeps the schedule
    and the V (stage j < p on rank j, the others mirrored) and loads back to the same layout."""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, seq_len=4096, stack="torchtitan")
    fixed = dict(tp=1, pp=4, cp=1, mbs=1, zero=2)
    v = evaluate("llama3-8b", layout="tp=1,pp=4,dp=4,cp=1,mbs=1,zero=2,schedule=dualpipev", **common)
    interleaved = evaluate("llama3-8b", layout="tp=1,pp=4,dp=4,cp=1,mbs=1,zero=2,vp=2", **common)
    assert v.layout.schedule == "dualpipev" and interleaved.layout.schedule == "interleaved-1f1b"
    assert v.breakdown["pipeline_bubble_s"] < interleaved.breakdown["pipeline_bubble_s"]
    assert [s.pipeline_rank for s in v.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    chosen = plan("llama3-8b", vp=2, **fixed, **common)   # a pinned vp reads as interleaving, as the text does
    assert chosen.layout.schedule == "interleaved-1f1b"
    free = plan("llama3-8b", schedule="dualpipev", **fixed, **common)
    assert free.layout.schedule == "dualpipev" and free.step_time_s <= v.step_time_s * (1 + 1e-9)
    path = tmp_path / "plan.yaml"
    free.save(path)
    loaded = type(free).load(path)
    assert loaded.to_layout().dualpipev and loaded.to_layout().chunk_rank(7) == 0


@pytest.mark.parametrize("stack,layout,said", [
    ("megatron-core", "tp=1,pp=4,dp=4,cp=1,mbs=1,schedule=dualpipev", "no DualPipeV"),
    ("deepspeed", "tp=1,pp=4,dp=4,cp=1,mbs=1,schedule=dualpipev", "no DualPipeV"),
    # this runtime: FSDP2 or its replicate where gradients are reduced over more than one rank, not DDP (ZeRO-1)
    ("parallel-planner", "tp=1,pp=4,dp=4,cp=1,mbs=1,zero=1,schedule=dualpipev", r"ZeRO stages \[0, 2, 3\] where"),
    # torchtitan: torch's stage takes the sharded parameters where ZeRO-3 resharded (runtime/pipeline_stage.py)
    ("torchtitan", "tp=1,pp=4,dp=4,cp=1,mbs=1,zero=3,schedule=dualpipev", r"ZeRO stages \[0, 2\] where"),
    ("parallel-planner", "tp=1,pp=4,dp=4,cp=1,mbs=1,zero=2,recompute=selective,schedule=dualpipev",
     "one backward per region"),
    ("torchtitan", "tp=1,pp=4,dp=4,cp=1,mbs=1,vp=3,schedule=dualpipev", "vp=2"),
    # torch's selective checkpoint allows one backward per region; the split weight pass runs a second
    ("torchtitan", "tp=1,pp=4,dp=4,cp=1,mbs=1,recompute=selective,schedule=dualpipev", "one backward per region"),
    ("torchtitan", "tp=1,pp=4,dp=4,cp=1,mbs=4,schedule=dualpipev", "at least 2 pp"),
    ("mindspeed", "tp=1,pp=2,dp=4,cp=2,mbs=1,schedule=dualpipev", "without context parallelism"),
    ("mindspeed", "tp=1,pp=8,dp=2,cp=1,ep=1,etp=1,vp=2,mbs=1,zero=1,recompute=none,schedule=dualpipev,stages=1-2*14-3", "splits the layers evenly"),
    ("torchtitan", "tp=1,pp=4,dp=4,cp=1,mbs=1,schedule=1f1b,vp=2", "schedule=1f1b with vp=2"),
])
def test_what_a_stack_cannot_run_is_refused(stack, layout, said):
    """A stack without DualPipeV (Megatron-Core, DeepSpeed), this runtime's with another ZeRO stage, a V that is not two chunks per rank, fewer than
    2 pp micro-batches (torch refuses them), MindSpeed's rules (no context parallelism beside it, the layers
    split evenly over the chunks), a schedule that vp contradicts."""
    with pytest.raises(UserInputError, match=said):
        evaluate("llama3-8b", device="h100-sxm", num_devices=16, global_batch=64, seq_len=4096, stack=stack,
                 layout=layout)


def test_the_runtime_stack_plans_the_v_only_as_its_runtime_runs_it():
    """One rule set: with gradients reduced over more than one rank the runtime's stack plans DualPipeV with
    ZeRO-0 (FSDP2's replicate), ZeRO-2 or ZeRO-3 (FSDP2; tests/test_runtime.py trains each against one
    process), never ZeRO-1 (DDP), over one rank with any, and never with selective recomputation (full recomputation is
    torch's non-reentrant checkpoint there, its weight passes billed); each plan passes the checks the runtime
    makes before step 1."""
    from planner.rules.stack import layout_stack_problems
    runtime = load_stack("parallel-planner")
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, seq_len=4096, stack="parallel-planner",
                  schedule="dualpipev", tp=1, cp=1)
    wide = plan("llama3-8b", pp=4, dp=4, **common)
    assert wide.layout.schedule == "dualpipev" and wide.layout.zero in (0, 2, 3)
    alone = plan("llama3-8b", pp=8, dp=1, tp=2, **{k: v for k, v in common.items() if k != "tp"})
    assert alone.layout.schedule == "dualpipev" and alone.layout.zero in (0, 1, 2, 3)
    for result in (wide, alone):
        assert not layout_stack_problems(result.to_layout(), runtime)
        assert Recompute.selective not in result.to_layout().block_recompute(result.to_layout().stage_layers)
    assert runtime.zero_stages_for(4, 1, 1, dualpipev=True) == (0, 2, 3)
    assert runtime.zero_stages_for(1, 2, 1, dualpipev=True) == (0, 1, 2, 3)
    assert runtime.zero_stages_for(4, 1, 1) == (0, 1, 2, 3)


def test_megatron_export_says_it_cannot_run_the_v():
    """Megatron-Core has no DualPipeV: the export of such a plan says its chunks would run interleaved and names
    MindSpeed-LLM's flags, which run it."""
    from planner.exports import megatron_args
    result = evaluate("mixtral-8x7b", device="h100-sxm", num_devices=32, global_batch=64, seq_len=4096,
                      stack="mindspeed", layout="tp=1,pp=4,dp=8,cp=1,ep=8,mbs=1,schedule=dualpipev")
    _, notes = megatron_args(result)
    assert any("no DualPipeV" in n and "--schedules-method dualpipev --moe-fb-overlap" in n for n in notes)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_weight_pass_groups_are_the_groups_torchs_split_backward_finds(model):
    """Capture's `weight_pass_groups` per block kind against torch's own: the parameter groups
    `stage_backward_input` returns for the split weight pass (one autograd.grad each), on the reference decoder."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input

    from planner.graph_capture.model_sources import resolve_model
    from planner.graph_capture.reference_model import build_model
    config, graph = resolve_model(model), capture(model)
    torch.manual_seed(0)
    decoder = build_model(config, "cpu", torch.float32)
    seen = set()
    for slot in graph.blocks:
        if slot.kind in seen:
            continue
        seen.add(slot.kind)
        hidden = torch.randn(1, 8, config.hidden_size, requires_grad=True)
        block = decoder.get_submodule(slot.module_name)
        out = block(hidden)
        out = out[0] if isinstance(out, tuple) else out
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [hidden], block.parameters())
        assert graph.kind(slot.kind).weight_pass_groups == len(groups) > 0, slot.kind


def test_torchtitan_dualpipev_bills_the_weight_pass_recomputations():
    """Full recomputation under torchtitan's DualPipeV costs (2p - 1)/2 x groups x each rank's recomputation more
    than where the weight pass recomputed once, and nothing more without recomputation."""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, seq_len=4096,
                  layout="tp=1,pp=4,dp=4,cp=1,mbs=1,zero=2,schedule=dualpipev,recompute={}")
    once = TORCHTITAN.model_copy(update={"dualpipev_weight_pass_recompute": False})
    full, plain = (evaluate("llama3-8b", stack=TORCHTITAN, **{**common, "layout": common["layout"].format(r)})
                   for r in ("full", "none"))
    full_once, plain_once = (evaluate("llama3-8b", stack=once, **{**common, "layout": common["layout"].format(r)})
                             for r in ("full", "none"))
    assert plain.step_time_s == pytest.approx(plain_once.step_time_s, rel=1e-12)
    recompute_per_micro_batch = full_once.breakdown["recompute_s"] / 16   # m = 64 / (4 dp x 1)
    groups = capture("llama3-8b").kind("dense").weight_pass_groups
    extra = (2 * 4 - 1) / 2 * groups * recompute_per_micro_batch   # p = 4, every rank alike
    assert full.step_time_s - full_once.step_time_s == pytest.approx(extra, rel=0.02)
    assert any("once per parameter group" in line for line in full.reasons)
    assert not any("once per parameter group" in line for line in plain.reasons + full_once.reasons)
