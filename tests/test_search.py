"""The search against an exhaustive enumeration written independently here, and its guarantees."""
import itertools
import re
from dataclasses import replace

import pytest

from cost_models.layer_costs import MeshCosts
from cost_models.layout import MEGATRON_ORDER, Layout, MoeDispatcher, Recompute
from hardware_profiles.loader import load_stack
from cost_models.step_time import estimate
from hardware_profiles import UserInputError, cluster_from_device
from planner.api import InfeasibleError, evaluate, plan
from planner.graph_capture.model_capture import capture
from planner.graph_capture.model_config import ModelConfig, MoEConfig
from planner.search.branch_and_bound import LEAF_WORK_LIMIT, BranchAndBound
from planner.search.bounds import Bounds, balanced_bound, communication_bound, pipeline_bound, work_before_zero, work_floor
from planner.search.branch_and_bound import search
from planner.rules.pins import Pins

pytestmark = pytest.mark.heavy

GB = 1e9


def small_cluster(num_devices, hbm_gb):
    cluster = cluster_from_device("h100-sxm", num_devices)
    device = cluster.device.model_copy(update={"hbm_bytes": int(hbm_gb * GB)})
    return cluster.model_copy(update={"device": device})


def dense_model(layers=8):
    return ModelConfig(name=f"exact-dense-{layers}", num_layers=layers, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, vocab_size=32000, seq_length=4096)


def moe_model(layers=8):
    return ModelConfig(name=f"exact-moe-{layers}", num_layers=layers, hidden_size=2048, num_attention_heads=16,
                       num_query_groups=4, ffn_hidden_size=8192, vocab_size=32000, seq_length=4096,
                       moe=MoEConfig(num_experts=8, router_topk=2, moe_ffn_hidden_size=2048, first_k_dense_layers=2))


def positive_compositions(total, parts):
    """Every way to write `total` as `parts` positive integers in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def compositions(total, parts):
    """Every split of `total` layers into `parts` chunks that Megatron-Core's flexible layout and
    torchtitan take: the first chunk (beside the embedding) and the last (beside the loss) may hold no
    layer, every other chunk at least one."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for last in range(total - first + 1):
            middle = total - first - last
            if parts == 2:
                if middle == 0:
                    yield (first, last)
                continue
            for inner in positive_compositions(middle, parts - 2):
                yield (first, *inner, last)


def brute_force(model_costs, num_blocks, cluster, global_batch, heads, choices, stack=load_stack(), pps=(1, 2, 4, 8),
                tps=(1, 2, 4, 8)):
    n = cluster.num_devices
    best = None
    for tp in (t for t in tps if n % t == 0 and heads % t == 0):
        # a chunk may hold only the embedding or only the loss: pp * vp up to the layers + 2
        for pp in (p for p in pps if n % (tp * p) == 0 and p <= num_blocks + 2):
            dp = n // (tp * pp)
            for vp in (v for v in range(1, 9) if (pp > 1 or v == 1) and pp * v <= num_blocks + 2):
                m = global_batch // dp
                if global_batch % dp or (vp > 1 and m % pp):
                    continue
                # with cp = 1 the mesh order matters only through where pp ranks sit
                orders = [MEGATRON_ORDER] + ([("tp", "pp", "cp", "ep", "dp")] if pp > 1 else [])
                # TP communication overlap off and on where there are TP collectives and the stack runs it
                overlaps = (False, True) if tp > 1 and stack.tp_comm_overlap else (False,)
                for order, tp_overlap in itertools.product(orders, overlaps):
                    base = Layout(dp=dp, tp=tp, pp=pp, vp=vp, micro_batch=1, global_batch=global_batch, zero=1,
                                  mesh_order=order, tp_comm_overlap=tp_overlap)
                    costs = MeshCosts(model_costs, cluster, base, stack)  # per-layer costs, reused
                    candidates = [replace(base, stage_layers=parts, layer_recompute=rec)
                                  for parts in compositions(num_blocks, pp * vp)
                                  for rec in itertools.product(choices, repeat=num_blocks)]
                    candidates += offloading(base, num_blocks, cluster, choices, stack)
                    for full in candidates:
                        result = estimate(model_costs, cluster, full, mesh_costs=costs)
                        if result.fits and (best is None or result.step_time_s < best.step_time_s):
                            best = result
    return best


def offloading(base, num_blocks, cluster, choices, stack):
    """Every activation offload count at pp = 1 without recomputation, where the stack and the device have it
    (Megatron-Core's TransformerConfig: fewer layers than the model's)."""
    device = cluster.device
    if base.pp > 1 or Recompute.none not in choices or not stack.activation_offload \
            or device.host_link_gbytes_per_s is None or device.host_memory_bytes is None:
        return []
    return [replace(base, stage_layers=(num_blocks,), layer_recompute=(Recompute.none,) * num_blocks, offload_layers=n)
            for n in range(1, num_blocks)]


@pytest.mark.parametrize("model,hbm_gb,devices,gbs", [
    (dense_model(6), 8, 8, 16),
    (moe_model(6), 8, 8, 16),
])
@pytest.mark.parametrize("tp_overlap", [False, True])
def test_solver_matches_exhaustive_enumeration(model, hbm_gb, devices, gbs, tp_overlap):
    """The search's plan is the best of every degree, order, split, per-layer recomputation and (where the stack
    runs it) TP overlap switch, enumerated through `estimate`."""
    stack = load_stack().model_copy(update={"tp_comm_overlap": tp_overlap})
    graph = capture(model)
    cluster = small_cluster(devices, hbm_gb)
    choices = (Recompute.none, Recompute.full)
    truth = brute_force(graph.costs(), graph.num_blocks, cluster, gbs, graph.attention_heads, choices, stack)
    outcome = search(graph.costs(), cluster, gbs, Pins(cp=1, ep=1, etp=1, mbs=1, zero=1), stack=stack, graph=graph,
                     top_k=1, time_limit_s=120, recompute_choices=choices)
    assert truth is not None and outcome.ranked
    found = outcome.ranked[0].estimate
    assert outcome.unexplored == 0
    assert found.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    # memory pressure made recomputation part of the answer (without TP overlap; with it, tp8 fits without)
    assert found.fits and (tp_overlap or Recompute.full in found.layer_recompute)
    assert found.layout.tp_comm_overlap == (tp_overlap and found.layout.tp > 1)


@pytest.mark.parametrize("link_gbytes_per_s,offloads", [(900.0, True), (2.0, False)])
def test_the_search_weighs_activation_offloading_against_recomputation_as_the_enumeration(link_gbytes_per_s, offloads):
    """With a fast host link the enumeration's best pp = 1 plan offloads activations, with a slow one it recomputes;
    the search finds the enumeration's optimum either way (offload counts enumerated through `estimate`)."""
    stack = load_stack().model_copy(update={"tp_comm_overlap": False})
    graph = capture(dense_model(6))
    cluster = small_cluster(8, 12)   # at tp = 2 the layers' activations fit only offloaded or recomputed
    cluster = cluster.model_copy(update={"device": cluster.device.model_copy(
        update={"host_link_gbytes_per_s": link_gbytes_per_s})})
    choices = (Recompute.none, Recompute.full)
    pins = Pins(tp=2, pp=1, cp=1, ep=1, etp=1, mbs=1, zero=1)   # offloading runs without a pipeline
    truth = brute_force(graph.costs(), graph.num_blocks, cluster, 16, graph.attention_heads, choices, stack, pps=(1,),
                        tps=(2,))
    outcome = search(graph.costs(), cluster, 16, pins, stack=stack, graph=graph, top_k=1, time_limit_s=120,
                     recompute_choices=choices)
    found = outcome.ranked[0].estimate
    assert outcome.unexplored == 0 and found.fits
    assert found.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    assert (truth.layout.offload_layers > 0) == offloads == (found.layout.offload_layers > 0)


def _placed(bnb, root):
    """A root's placed nodes, through the groups that leave a placement's dispatcher and combined 1F1B open:
    each group's floor (its bound before its children are weighed: `BranchAndBound.group_floor_s`) at or above
    its root's and at or below its bound, and that at or below each of its children's
    (`BranchAndBound.group_bound`)."""
    for child in bnb.tree.children(root):
        if not child.is_group:
            yield child
            continue
        group_bound, kids = bnb.nodes.group_bound(child), bnb.tree.children(child)
        floor = bnb.nodes.group_floor_s(child)
        assert bnb.nodes.root_bound(root) <= floor * (1 + 1e-9) and floor <= group_bound * (1 + 1e-9)
        assert len(kids) > 1 and all(not kid.is_group for kid in kids)
        assert bnb.tree.leaf_count(child) == sum(bnb.tree.leaf_count(kid) for kid in kids)
        for kid in kids:
            assert group_bound <= bnb.nodes.communication_bound(kid) * (1 + 1e-9)
            yield kid


def _check_tree_bounds(graph, cluster, stack, per_layout):
    """The search's own root bounds (compute plus the least tp, cp and hop communication of any mesh order)
    stay at or below each placed child's communication bound, and each child's bound, taken through the
    search's caches shared across virtual-stage counts, equals the one computed from its layout alone: the
    roots in one order of vp and then the other, so that a cache reused across vp would show."""
    tol = 1 + 1e-9
    def placement(lay):   # what a placed node fixes: every field its leaves share, all but the ZeRO stage
        return (lay.tp, lay.cp, lay.pp, lay.vp, lay.ep, lay.etp, lay.micro_batch, lay.mesh_order,
                lay.moe_a2a_overlap, lay.moe_dispatcher, lay.tp_comm_overlap)
    best_under = {}   # the enumeration's best step of each placement
    for lay, e in per_layout.items():
        best_under[placement(lay)] = min(e.step_time_s, best_under.get(placement(lay), float("inf")))
    alone_of, balanced_of = {}, {}   # computed from a layout alone: the same in both orders of the roots
    for reverse in (False, True):
        bnb = BranchAndBound(graph.costs(), cluster, 16, Pins(vp=None), "bf16", 120, 1, stack, 1.0, graph, None,
                             (Recompute.none,), LEAF_WORK_LIMIT, ())
        roots = sorted(bnb.tree.roots(), key=lambda r: r.vp, reverse=reverse)
        placed = 0
        for root in roots:
            root_bound = bnb.nodes.root_bound(root)
            for child in _placed(bnb, root):
                layout = child.layout(bnb.problem)
                if layout not in alone_of:
                    costs = MeshCosts(graph.costs(), cluster, layout, stack)
                    alone_of[layout] = communication_bound(
                        work_floor(*work_before_zero(costs, Recompute.none), layout.pp, layout.vp), costs.p2p_s(),
                        layout)
                alone = alone_of[layout]
                assert bnb.nodes.communication_bound(child) == pytest.approx(alone, rel=1e-12)
                assert root_bound <= alone * tol
                best = best_under.get(placement(layout), float("inf"))
                assert root_bound <= best * tol
                # the placed node's floor of what its ZeRO stages add stays at or below each leaf's balanced bound
                floor = bnb.nodes.zero_floor_s(child)
                assert alone <= floor * tol and floor <= best * tol
                for leaf in bnb.tree.children(child):
                    leaf_layout = leaf.layout(bnb.problem)
                    if leaf_layout not in balanced_of:
                        balanced_of[leaf_layout] = balanced_bound(
                            MeshCosts(graph.costs(), cluster, leaf_layout, stack), leaf_layout)
                    assert floor <= balanced_of[leaf_layout] * tol
                placed += 1
        assert placed > 100


def brute_force_degrees(model_costs, graph, cluster, global_batch, overlap=load_stack(), vps=(1,), eps=(1, 2, 4, 8)):
    """Every tp, cp, pp, vp, ep (of `eps`), etp, micro-batch, ZeRO stage, mesh order, MoE all-to-all overlap and TP
    communication overlap off and on (where the stack has them and the layout runs them), MoE dispatcher (each the
    stack runs on the device where experts spread) and partition (no recomputation): the best plan of each
    layout, keyed by it."""
    n, best = cluster.num_devices, {}
    for tp, cp, pp, vp in itertools.product((1, 2, 4), (1, 2), (1, 2), vps):
        if n % (tp * cp * pp) or graph.attention_heads % tp or (pp == 1 and vp > 1):
            continue
        dp = n // (tp * cp * pp)
        orders = (MEGATRON_ORDER, ("tp", "dp", "cp", "ep", "pp"), ("tp", "pp", "cp", "ep", "dp"))
        switches = (False, True) if overlap.moe_a2a_overlap else (False,)
        tp_switches = (False, True) if overlap.tp_comm_overlap else (False,)
        dispatchers = ("alltoall", "allgather", "deepep")
        for etp, ep, mbs, zero, order, paired, dispatcher, tp_overlap in itertools.product(
                {1, tp}, eps, (1, 2), (0, 1, 2, 3), orders, switches, dispatchers, tp_switches):
            if (dp * cp * tp) % (ep * etp) or graph.num_experts % ep or global_batch % (dp * mbs):
                continue
            if vp > 1 and (global_batch // (dp * mbs)) % pp:
                continue
            runs = overlap.dispatchers_on(cluster.device) if ep > 1 else (overlap.moe_dispatcher,)
            if dispatcher not in runs:
                continue
            base = Layout(dp=dp, tp=tp, pp=pp, vp=vp, cp=cp, ep=ep, etp=etp, micro_batch=mbs,
                          global_batch=global_batch, zero=zero, mesh_order=order, moe_a2a_overlap=paired,
                          moe_dispatcher=dispatcher, tp_comm_overlap=tp_overlap)
            if paired and not overlap.pairs_moe_a2a(base):
                continue   # the same plan as without: the stack cannot pair this layout's passes
            if tp_overlap and not overlap.tp_overlap_applies(base):
                continue   # the same plan as without: no sequence-parallel TP collectives
            if tp_overlap and overlap.hides_moe_a2a(base) and overlap.tp_overlap_blocked_by_a2a(tp, cluster.device):
                continue   # not a layout that runs: one CUDA connection for TP overlap, several for combined 1F1B
            costs = MeshCosts(model_costs, cluster, base, overlap)
            for parts in compositions(graph.num_blocks, pp * vp):
                full = replace(base, stage_layers=parts, layer_recompute=(Recompute.none,) * graph.num_blocks)
                result = estimate(model_costs, cluster, full, mesh_costs=costs)
                if result.fits and (base not in best or result.step_time_s < best[base].step_time_s):
                    best[base] = result
    return best


@pytest.mark.parametrize("overlap,vps", [(load_stack(), (1,)), (load_stack().model_copy(
    update={"moe_a2a_overlap": True, "tp_comm_overlap": True}), (1, 2, 4))])
def test_search_tree_bounds_match_exhaustive_degrees(overlap, vps):
    """The search's subtree bounds (compute, then communication, then ZeRO) never prune the optimum, also
    where MoE all-to-all overlap makes the communication depend on the virtual-stage count and the MoE
    dispatcher (Megatron-Core's three, on H100) is chosen per placement; and its rule for TP communication
    overlap (on wherever combined 1F1B does not rule it out on H100) finds the enumeration's optimum over both."""
    graph = capture(moe_model())
    cluster = small_cluster(8, 16)
    per_layout = brute_force_degrees(graph.costs(), graph, cluster, 16, overlap, vps)
    truth = min(per_layout.values(), key=lambda e: e.step_time_s)
    outcome = search(graph.costs(), cluster, 16, Pins(vp=None if len(vps) > 1 else 1), stack=overlap,
                     graph=graph, top_k=1, time_limit_s=120, recompute_choices=(Recompute.none,))
    assert outcome.unexplored == 0
    assert outcome.ranked[0].estimate.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    # each level's bound stays at or below the best plan of every layout beneath it
    bounds = Bounds(graph.costs(), cluster, overlap, (Recompute.none,))
    for layout, best in per_layout.items():
        costs = MeshCosts(graph.costs(), cluster, layout, overlap)
        compute_only = pipeline_bound(bounds.compute_work_s(layout), layout)
        work = work_floor(*work_before_zero(costs, Recompute.none), layout.pp, layout.vp)
        communication = communication_bound(work, costs.p2p_s(), layout)
        balanced = balanced_bound(costs, layout)
        tol = 1 + 1e-9  # the levels sum the same terms in different orders
        assert compute_only <= communication * tol and communication <= balanced * tol
        assert balanced <= best.step_time_s * tol
        assert bounds.memory_floor(layout)[0] <= max(m.total for m in best.stage_memory)
    assert outcome.pruned_memory > 0 and outcome.pruned_bound > 0
    _check_tree_bounds(graph, cluster, overlap, per_layout)
    # the dispatcher is live: each wins somewhere, by the step time its bytes and links give
    winners = {}
    for lay, best in per_layout.items():
        if lay.ep > 1 and not lay.moe_a2a_overlap:
            key = replace(lay, moe_dispatcher="alltoall")
            if best.step_time_s < winners.get(key, (float("inf"), None))[0]:
                winners[key] = (best.step_time_s, lay.moe_dispatcher)
    assert {str(d) for _, d in winners.values()} == {"alltoall", "allgather", "deepep"}
    if overlap.moe_a2a_overlap:   # the choice is live: somewhere it changes the step or whether it fits
        changed = [lay for lay in per_layout if lay.moe_a2a_overlap and overlap.hides_moe_a2a(lay)
                   and per_layout.get(replace(lay, moe_a2a_overlap=False)) is not None
                   and per_layout[lay].step_time_s != per_layout[replace(lay, moe_a2a_overlap=False)].step_time_s]
        assert changed
    if overlap.tp_comm_overlap:   # TP overlap is live: it shortens the step where it runs, and on H100 the search
        # weighs it against combined 1F1B (a tp > 1 layout runs one or the other)
        faster = [lay for lay in per_layout if lay.tp_comm_overlap
                  and per_layout[lay].step_time_s < per_layout[replace(lay, tp_comm_overlap=False)].step_time_s]
        assert faster and any(replace(lay, tp_comm_overlap=False, moe_a2a_overlap=True) in per_layout
                              for lay in faster)


def test_a_search_kept_to_shape_bounds_matches_the_enumeration_inside_them():
    """The measured region's bounds (planner/region.py ShapeBound: tp, cp and ep kept where hidden / tp,
    sequence / cp and experts / ep lie in a range) narrow the search to exactly the layouts of the independent
    enumeration that keep them: its best plan is the best of those, and it never leaves them."""
    from planner.region import ShapeBound
    graph = capture(moe_model())
    cluster = small_cluster(8, 16)
    per_layout = brute_force_degrees(graph.costs(), graph, cluster, 16)
    bounds = (ShapeBound("tp", 2048, 1024, 2048), ShapeBound("ep", 8, 2, 8), ShapeBound("cp", 4096, 4096, 4096))
    inside = [e for lay, e in per_layout.items()
              if lay.tp in (1, 2) and lay.ep in (1, 2, 4) and lay.cp == 1]
    assert inside and len(inside) < len(per_layout)
    truth = min(inside, key=lambda e: e.step_time_s)
    outcome = search(graph.costs(), cluster, 16, Pins(vp=1, shape_bounds=bounds), graph=graph, top_k=3,
                     time_limit_s=120, recompute_choices=(Recompute.none,))
    assert outcome.unexplored == 0
    assert outcome.ranked[0].estimate.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    for solution in outcome.ranked:
        lay = solution.estimate.layout
        assert lay.tp in (1, 2) and lay.ep in (1, 2, 4) and lay.cp == 1


def test_a_search_kept_to_zero3_ranks_matches_the_enumeration_inside_them():
    """The measured region's ZeRO-3 bound (`Pins.zero3_ranks_max`: parameters sharded over at most that many dp x
    cp ranks, as the published runs did) narrows the search to exactly the layouts of the independent enumeration
    that keep it: its best plan is the best of those, and none of its plans shards over more."""
    graph = capture(dense_model(8))
    cluster = small_cluster(8, 14)
    per_layout = brute_force_degrees(graph.costs(), graph, cluster, 16)
    inside = [e for lay, e in per_layout.items() if lay.zero < 3 or lay.dp * lay.cp <= 2]
    truth = min(inside, key=lambda e: e.step_time_s)
    fastest = min(per_layout.values(), key=lambda e: e.step_time_s)
    assert fastest.layout.zero == 3 and fastest.layout.dp * fastest.layout.cp > 2   # the bound is live here
    assert truth.step_time_s > fastest.step_time_s
    outcome = search(graph.costs(), cluster, 16, Pins(vp=1, zero3_ranks_max=2), graph=graph, top_k=3,
                     time_limit_s=120, recompute_choices=(Recompute.none,))
    assert outcome.unexplored == 0
    assert outcome.ranked[0].estimate.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    for solution in outcome.ranked:
        lay = solution.estimate.layout
        assert lay.zero < 3 or lay.dp * lay.cp <= 2


def test_time_limit_without_a_plan_is_not_called_infeasible():
    with pytest.raises(InfeasibleError, match="time limit") as info:
        plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, time_limit_s=0)
    assert "smallest memory need" not in str(info.value)


def independent_stage_memory(graph, layout, stage_blocks, stage, pp, m):
    """Per-rank bytes from the captured graph with textbook rules (18 B/param mixed-precision Adam)."""
    tp, dpcp = layout.tp, layout.dp * layout.cp
    total = 0.0
    flight = min(pp - stage, m)
    kinds = [graph.kind(graph.blocks[b].kind) for b in stage_blocks]
    if stage == 0:
        kinds.append(graph.kind("embedding"))
    if stage == pp - 1:
        kinds.append(graph.kind("head"))
        logits = graph.kind("head").logits_fp32_bytes / 4 * layout.micro_batch / tp   # one per vocabulary entry
        total += logits * (4 + 2)   # Megatron's cross-entropy: fp32 softmax kept, bf16 gradient handed back
    for kind in kinds:
        params = sum(g.count / (tp if g.sharding.value == "tensor" else 1) for g in kind.params)
        total += params * (2 + 4 + 12 / dpcp)  # ZeRO-1: optimizer states sharded over dp x cp
    for b in stage_blocks:
        kind = graph.kind(graph.blocks[b].kind)
        if layout.recompute_of(b) is Recompute.full:
            act = kind.input_bytes / tp
        else:
            act = sum(t.bytes / tp for t in kind.saved)  # with sequence parallelism all activations split by tp
        total += flight * act * layout.micro_batch
    return total


def test_returned_plan_fits_by_independent_memory_count():
    graph = capture("llama3-8b")
    cluster = cluster_from_device("h100-sxm", 16)
    outcome = search(graph.costs(), cluster, 64, Pins(zero=1, cp=1, vp=1), graph=graph, top_k=3, time_limit_s=60)
    for scored in outcome.ranked:
        est = scored.estimate
        lay = replace(est.layout, layer_recompute=est.layer_recompute)
        start = 0
        for stage, count in enumerate(est.stage_layers):
            blocks = list(range(start, start + count))
            start += count
            need = independent_stage_memory(graph, lay, blocks, stage, lay.pp, lay.num_micro_batches)
            assert need <= est.stage_memory[stage].capacity
            assert need == pytest.approx(est.stage_memory[stage].total - est.stage_memory[stage].comm_buffers
                                         - est.stage_memory[stage].recompute_working, rel=0.02)


def test_plans_are_deterministic(tmp_path):
    first = plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, time_limit_s=60)
    second = plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, time_limit_s=60)
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.save(a)
    second.save(b)
    assert a.read_bytes() == b.read_bytes()


def test_plan_round_trips_through_yaml_and_json(tmp_path):
    result = plan("tiny-llama", device="h100-sxm", num_devices=8, global_batch=16)
    for name in ("plan.yaml", "plan.json"):
        result.save(tmp_path / name)
        loaded = type(result).load(tmp_path / name)
        assert loaded.model_dump() == result.model_dump()
        loaded.save(tmp_path / f"again-{name}")
        assert (tmp_path / f"again-{name}").read_bytes() == (tmp_path / name).read_bytes()


def test_infeasible_request_says_why():
    with pytest.raises(InfeasibleError) as info:
        plan("llama3-405b", device="h100-sxm", num_devices=8, global_batch=16, time_limit_s=30)
    message = str(info.value)
    assert "smallest memory need" in message and "would fit" in message and "model states" in message


@pytest.mark.parametrize("hbm_gb", [6, 7, 8])
def test_infeasible_need_is_one_no_plan_meets(hbm_gb):
    """The need an infeasible request reports exceeds the usable memory: near the boundary the search's
    floor fits while every whole plan does not, and the floor is no need at all then."""
    with pytest.raises(InfeasibleError) as info:
        plan(dense_model(), small_cluster(8, hbm_gb), global_batch=8, seq_len=4096, time_limit_s=30)
    found = re.search(r"need found is ([\d.]+) GB .* against ([\d.]+) GB usable", str(info.value))
    need, usable = float(found.group(1)), float(found.group(2))
    assert need >= usable   # both rounded to 0.1 GB


def test_pins_are_respected():
    result = plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, tp=4, pp=2, recompute="full")
    assert result.layout.tp == 4 and result.layout.pp == 2 and result.layout.recompute == "full"
    with pytest.raises(UserInputError, match="unknown key"):
        plan("llama3-8b", device="h100-sxm", num_devices=64, global_batch=256, tq=4)


def test_bf16_gradient_reduction_stores_two_bytes_per_parameter():
    """Mixed-precision Adam keeps 4 B of fp32 gradient per parameter, 2 B when gradients are reduced in
    bf16 (design-notes); the per-step reduction moves half the bytes."""
    layout = "tp=1,pp=1,dp=64,cp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=full"  # one micro-batch: DP exposed
    params = capture("llama3-8b").total_params
    fp32 = evaluate("llama3-8b", device="h100-sxm", num_devices=64, global_batch=64, layout=layout)
    bf16 = evaluate("llama3-8b", device="h100-sxm", num_devices=64, global_batch=64, layout=layout + ",grad_reduce=bf16")
    assert fp32.memory[0].parts["gradients"] == pytest.approx(4 * params, rel=1e-6)
    assert bf16.memory[0].parts["gradients"] == pytest.approx(2 * params, rel=1e-6)
    assert bf16.layout.grad_reduce == "bf16"
    graph, cluster = capture("llama3-8b"), cluster_from_device("h100-sxm", 64)
    block = graph.costs().kind(graph.costs().blocks[0])
    reduced = [MeshCosts(graph.costs(), cluster, Layout(dp=64, global_batch=64, grad_reduce=g), load_stack())
               .layer(block).grad_reduce_bytes for g in ("fp32", "bf16")]
    assert reduced[0] == pytest.approx(2 * reduced[1], rel=1e-12) and reduced[1] > 0


def test_ties_go_to_the_simpler_layout():
    """Layouts the model cannot tell apart (here dp x cp splits of a small model on a device whose GEMM
    efficiency does not fall with size) rank by simplicity: the search may not prune a tie with the K-th
    plan, or a context-parallel twin wins by order."""
    model, shape = "examples/hf-config.json", dict(device="a100-80g", num_devices=32, global_batch=256, seq_len=8192)
    base = "tp=1,pp=1,ep=1,etp=1,vp=1,mbs=1,zero=1,recompute=none"
    plain = evaluate(model, layout=f"dp=32,cp=1,{base}", **shape)
    split = evaluate(model, layout=f"dp=8,cp=4,{base}", **shape)
    assert plain.step_time_s == pytest.approx(split.step_time_s, rel=1e-9)
    assert plan(model, **shape).layout.cp == 1


@pytest.mark.parametrize("order,domains", [(MEGATRON_ORDER, 1), (("tp", "pp", "cp", "ep", "dp"), 2)])
def test_expert_and_data_groups_follow_the_mesh_order(order, domains):
    """16 ranks on two 8-GPU nodes, pp=2, dp=ep=8. Megatron's order keeps pp outermost: ranks 0-7 form one
    expert group. With pp innermost the ranks of one stage are 0, 2, ..., 14: the group spans both nodes."""
    graph = capture(moe_model())
    layout = Layout(dp=8, pp=2, ep=8, global_batch=16, mesh_order=order)
    groups = MeshCosts(graph.costs(), small_cluster(16, 80), layout, load_stack()).placement
    dp_cp, experts = groups.dp_cp, groups.experts
    assert experts.of("ep").domains == domains and dp_cp.domains == domains


def mixed_moe_model(seq=256):
    """8 layers: 4 dense, then 4 MoE (issue 16's case); a short sequence leaves the dp reduction exposed."""
    return ModelConfig(name="mixed-moe", num_layers=8, hidden_size=2048, num_attention_heads=16,
                       num_query_groups=4, ffn_hidden_size=8192, vocab_size=32000, seq_length=seq,
                       moe=MoEConfig(num_experts=16, router_topk=2, moe_ffn_hidden_size=2048, first_k_dense_layers=4))


def test_pinned_plan_beats_every_split_of_a_mixed_moe_model():
    """Every degree pinned (pp2 x dp16 x ep2, ZeRO-1, 32 H100): the plan's split was (7, 1) at 12.8 ms while
    the split (5, 3) evaluates at 10.6 ms, because the solver dropped the expert gradients' reduction."""
    model = mixed_moe_model()
    pins = dict(tp=1, pp=2, vp=1, dp=16, cp=1, ep=2, etp=1, mbs=1, zero=1, recompute="none")
    planned = plan(model, device="h100-sxm", num_devices=32, global_batch=16, **pins)
    graph, cluster = capture(model), cluster_from_device("h100-sxm", 32)
    base = Layout(dp=16, pp=2, ep=2, global_batch=16, zero=1)
    times = [estimate(graph.costs(), cluster, replace(base, stage_layers=(a, 8 - a))).step_time_s for a in range(1, 8)]
    assert planned.step_time_s <= min(times) * (1 + 1e-9)
    assert planned.breakdown["dp_comm_s"] > 0   # the reduction is part of the answer here


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("pp,vp,dp,ep", [(2, 1, 16, 2), (2, 2, 8, 4), (4, 1, 8, 8)])
def test_pinned_search_equals_the_best_split_by_enumeration(zero, pp, vp, dp, ep):
    """Over a grid of pinned layouts of a model with dense and expert layers, with the dp reduction exposed:
    the search's plan is the best of every stage split and per-layer recomputation (none or full),
    enumerated through `estimate`, and its reported time is the estimate of its own split."""
    graph = capture(mixed_moe_model())
    tp = 32 // (pp * dp)
    choices = (Recompute.none, Recompute.full)
    base = Layout(dp=dp, tp=tp, pp=pp, vp=vp, ep=ep, global_batch=16, zero=zero)
    # usable memory between the even split's need without and with full recomputation: tight enough
    # that recomputation and the split trade against each other
    roomy = small_cluster(32, 80)
    need = [estimate(graph.costs(), roomy, replace(base, recompute=r)).peak_memory_bytes for r in choices]
    reserve = roomy.device.memory_reserve
    hbm = (need[0] + need[1]) / 2 / (1 - reserve.fragmentation_fraction) + reserve.runtime_context_bytes
    cluster = small_cluster(32, hbm / GB)
    best = None
    for tp_overlap in (False, True) if tp > 1 else (False,):   # Megatron-Core's stack runs TP overlap
        overlapped = replace(base, tp_comm_overlap=tp_overlap)
        costs = MeshCosts(graph.costs(), cluster, overlapped, load_stack())
        for parts in compositions(graph.num_blocks, pp * vp):
            for rec in itertools.product(choices, repeat=graph.num_blocks):
                result = estimate(graph.costs(), cluster, replace(overlapped, stage_layers=parts,
                                                                  layer_recompute=rec), mesh_costs=costs)
                if result.fits and (best is None or result.step_time_s < best.step_time_s):
                    best = result
    pins = Pins(dp=dp, tp=tp, pp=pp, vp=vp, cp=1, ep=ep, etp=1, mbs=1, zero=zero, dispatcher=MoeDispatcher.alltoall)
    outcome = search(graph.costs(), cluster, 16, pins, graph=graph, top_k=1, recompute_choices=choices)
    assert best is not None and outcome.unexplored == 0
    found = outcome.ranked[0].estimate
    assert found.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    own = estimate(graph.costs(), cluster, replace(base, stage_layers=found.stage_layers,
                                                   layer_recompute=found.layer_recompute,
                                                   tp_comm_overlap=found.layout.tp_comm_overlap))
    assert own.step_time_s == found.step_time_s


def test_forced_recomputation_bound_never_exceeds_the_best_plan():
    """Where memory forces recomputation, the leaf bound adds the least recomputation work that fitting
    needs (an LP bound over the floor's weights). Every split and per-layer recomputation that fits is
    enumerated: none recomputes less work than the bound says, and the leaf bound stays at or below the
    best plan."""
    graph = capture(mixed_moe_model(seq=4096))
    choices = (Recompute.none, Recompute.full)
    checked = 0
    for pp, vp, dp, ep, zero in [(2, 1, 16, 2, 1), (2, 2, 8, 4, 0), (4, 1, 8, 8, 1), (2, 1, 16, 2, 3)]:
        tp = 32 // (pp * dp)
        base = Layout(dp=dp, tp=tp, pp=pp, vp=vp, ep=ep, global_batch=64, zero=zero)
        roomy = small_cluster(32, 80)
        # just below the least memory any split needs without recomputation: recomputation is forced
        floor = Bounds(graph.costs(), roomy, load_stack(), choices)._floor(base, Recompute.none).bytes
        reserve = roomy.device.memory_reserve
        for share in (0.99, 0.96):
            usable = share * floor
            cluster = small_cluster(32, (usable / (1 - reserve.fragmentation_fraction)
                                         + reserve.runtime_context_bytes) / GB)
            costs = MeshCosts(graph.costs(), cluster, base, load_stack())
            forced = Bounds(graph.costs(), cluster, load_stack(), choices).forced_recompute_s(base, costs)
            assert forced > 0
            extra = {kind.name: costs.layer(kind).work_s(Recompute.full) - costs.layer(kind).work_s(Recompute.none)
                     for kind in graph.costs().kinds}
            kinds = [graph.costs().kind(name).name for name in graph.costs().blocks]
            best = None
            for parts in compositions(graph.num_blocks, pp * vp):
                for rec in itertools.product(choices, repeat=graph.num_blocks):
                    result = estimate(graph.costs(), cluster, replace(base, stage_layers=parts, layer_recompute=rec),
                                      mesh_costs=costs)
                    if not result.fits:
                        continue
                    recomputed = sum(extra[k] for k, r in zip(kinds, rec) if r is Recompute.full)
                    assert recomputed >= forced * (1 - 1e-9)
                    if best is None or result.step_time_s < best.step_time_s:
                        best = result
            assert best is not None
            assert balanced_bound(costs, base, Recompute.none, forced) <= best.step_time_s * (1 + 1e-9)
            checked += 1
    assert checked == 8


def test_search_status_says_complete_only_when_it_is(capsys, monkeypatch):
    """A search cut by its time limit is 'time-limited' and never prints OPTIMAL; a leaf stopped by the
    solver's work limit makes it 'unproven'; only a complete search says its plan is the best."""
    import shlex
    import sys

    from planner import cli
    monkeypatch.setattr(sys, "argv", ["planner", *shlex.split(
        "plan --model llama3-70b --device h100-sxm --num-devices 1024 --global-batch 1024 --time-limit 0.05")])
    try:
        cli.main()
    except SystemExit as exc:
        assert exc.code in (0, 2)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "OPTIMAL" not in text and ("TIME-LIMITED" in text or "time limit" in text)
    complete = plan("tiny-llama", device="h100-sxm", num_devices=8, global_batch=16)
    assert complete.search.status == "complete" and complete.search.unexplored == 0
    graph = capture(dense_model(8))
    cluster = small_cluster(8, 30)
    outcome = search(graph.costs(), cluster, 16, Pins(cp=1, ep=1, etp=1, mbs=1, zero=1, tp=1, pp=4), graph=graph,
                     top_k=1, recompute_choices=(Recompute.none, Recompute.full), leaf_work_limit=0.0)
    assert outcome.unproven > 0 and not outcome.complete


def test_the_search_and_evaluate_choose_the_dispatcher_the_three_pinned_plans_rank_first():
    """Megatron-Core runs the alltoall, allgather and flex (DeepEP) dispatchers, and DeepEP's kernels run on
    Hopper: for Qwen3-30B-A3B's 128 experts over 16 H100 in two nodes (eight per rank) the search, and evaluate of a whole layout that leaves the dispatcher out, weigh each. Their
    plan is the fastest of the plans pinned to one dispatcher (search = enumeration over it), and says what
    the others would cost. On a device whose profile names no DeepEP-style kernels, deepep is never chosen and
    refused when pinned, naming the device."""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, stack="megatron-core", time_limit_s=60)
    pins = dict(tp=1, pp=1, cp=1, ep=16, etp=1, mbs=1, zero=1, recompute="none", a2a_overlap=False)
    pinned = {d: plan("qwen3-30b-a3b", **common, **pins, dispatcher=d) for d in ("alltoall", "allgather", "deepep")}
    fastest = min(pinned.values(), key=lambda p: p.step_time_s)
    assert len({round(p.step_time_s, 6) for p in pinned.values()}) == 3   # the choice matters here
    chosen = plan("qwen3-30b-a3b", **common, **pins)
    assert chosen.layout.moe_dispatcher == fastest.layout.moe_dispatcher
    assert chosen.step_time_s == pytest.approx(fastest.step_time_s, rel=1e-9)
    text = ",".join(f"{k}={v}" for k, v in {**pins, "dp": 16, "vp": 1}.items())
    assert evaluate("qwen3-30b-a3b", layout=text, **common).layout.moe_dispatcher == fastest.layout.moe_dispatcher
    why = next(line for line in chosen.reasons if line.startswith("dispatcher "))
    assert all(str(d) in why for d in pinned)
    h100 = cluster_from_device("h100-sxm", 16)
    without = {**common, "device": None, "num_devices": None,
               "cluster": h100.model_copy(update={"device": h100.device.model_copy(
                   update={"flex_dispatcher_backend": None})})}
    assert plan("qwen3-30b-a3b", **without, **pins).layout.moe_dispatcher != "deepep"
    with pytest.raises(UserInputError, match="dispatcher=deepep on h100-sxm"):
        plan("qwen3-30b-a3b", **without, **pins, dispatcher="deepep")


def test_the_search_weighs_combined_1f1b_against_its_memory():
    """Where the stack has combined 1F1B the search tries each layout with it and without: Mixtral on 16
    H100 with tp2 (one micro-batch per forward) is faster with it but holds two micro-batches' activations
    then, which do not fit: the plan goes without; with tp4 both fit and the plan takes it. Each pair is
    checked against `evaluate` of the two pinned layouts, and against `evaluate` of the whole layout leaving it
    out, which weighs the two as the search does. Megatron-Core runs it (off by default): its stack can. (TP
    overlap pinned off: on H100 it runs only without combined 1F1B, which the TP overlap test weighs.)"""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, stack="megatron-core", time_limit_s=60)
    for tp, chosen in ((2, False), (4, True)):
        pins = dict(tp=tp, pp=1, cp=1, ep=8, etp=1, mbs=1, zero=3, recompute="none", dispatcher="alltoall",
                    tp_overlap=False)
        text = ",".join(f"{k}={v}" for k, v in {**pins, "dp": 16 // tp, "vp": 1}.items())
        on, off = (evaluate("mixtral-8x7b", layout=f"{text},a2a_overlap={flag}", **common) for flag in ("true", "false"))
        assert on.step_time_s < off.step_time_s and off.fits and on.fits is chosen
        result = plan("mixtral-8x7b", **common, **pins)
        assert result.layout.moe_a2a_overlap is chosen
        assert result.step_time_s == pytest.approx((on if chosen else off).step_time_s, rel=1e-9)
        assert evaluate("mixtral-8x7b", layout=text, **common).layout == (on if chosen else off).layout
        # the plan says why, from the same two estimates
        why = next(line for line in result.reasons if "combined 1F1B" in line)
        hidden = off.breakdown["ep_comm_s"] - on.breakdown["ep_comm_s"]
        assert f"{hidden:.3f} s of expert all-to-all" in why and ("do not fit" in why) is not chosen


def test_on_h100_the_search_weighs_combined_1f1b_against_tp_overlap():
    """On Hopper a tp > 1 layout runs TP overlap or combined 1F1B, not both (one CUDA connection against several):
    `plan` and `evaluate` of a layout that leaves both open give the faster of the two pinned pairings (Mixtral on 16
    H100 at tp4, where the two are within 1%), and pinning both on is refused."""
    common = dict(device="h100-sxm", num_devices=16, global_batch=64, stack="megatron-core", time_limit_s=60)
    pins = dict(tp=4, pp=1, cp=1, ep=8, etp=1, mbs=1, zero=3, recompute="none", dispatcher="alltoall")
    text = ",".join(f"{k}={v}" for k, v in {**pins, "dp": 4, "vp": 1}.items())
    paired = evaluate("mixtral-8x7b", layout=f"{text},a2a_overlap=true,tp_overlap=false", **common)
    overlapped = evaluate("mixtral-8x7b", layout=f"{text},a2a_overlap=false,tp_overlap=true", **common)
    assert paired.layout.moe_a2a_overlap and overlapped.layout.tp_comm_overlap and paired.fits and overlapped.fits
    faster = min(paired, overlapped, key=lambda p: p.step_time_s)
    for chosen in (evaluate("mixtral-8x7b", layout=text, **common), plan("mixtral-8x7b", **common, **pins)):
        assert (chosen.layout.moe_a2a_overlap, chosen.layout.tp_comm_overlap) == (
            faster.layout.moe_a2a_overlap, faster.layout.tp_comm_overlap)
        assert chosen.step_time_s == pytest.approx(faster.step_time_s, rel=1e-9)
    with pytest.raises(UserInputError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        evaluate("mixtral-8x7b", layout=f"{text},a2a_overlap=true,tp_overlap=true", **common)
    # both pinned with tp left open: only tp = 1 layouts run both, and the plan says so
    both = plan("mixtral-8x7b", **common, pp=1, ep=8, a2a_overlap=True, tp_overlap=True)
    assert both.layout.tp == 1 and any("both pinned" in r and "tp = 1" in r for r in both.reasons)
