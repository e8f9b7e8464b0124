"""Combined 1F1B where it pays only beside CUDA graphs of whole layers (`Device.a2a_overlap_needs_graphs`: GB200,
after Megatron-LM's DeepSeek-V3 GB200 guide, which found its overall benefit negative there without them): the
search and `evaluate` leave it off, a pin keeps it and says what the prediction leaves out, and a stack that
replays whole layers weighs it as anywhere else."""
from dataclasses import replace

import pytest

import planner
from cost_models.layout import Recompute
from hardware_profiles import cluster_from_device
from hardware_profiles.loader import load_stack
from planner.graph_capture.model_capture import capture
from planner.rules.pins import Pins
from planner.rules.stack import a2a_overlap_left_off
from planner.search.branch_and_bound import search
from tests.test_search import brute_force_degrees, moe_model, small_cluster

COMMON = dict(num_devices=64, global_batch=512, tp=1, pp=4, cp=1, ep=16, vp=2, time_limit_s=60)
GRAPHED = load_stack("megatron-core").model_copy(update={"cuda_graphs": True, "cuda_graph_scope": "layers"})


def test_only_a_device_that_needs_whole_layer_graphs_leaves_it_off_and_only_without_them():
    gb200, h100 = (cluster_from_device(name, 8).device for name in ("gb200", "h100-sxm"))
    stack = load_stack("megatron-core")
    assert gb200.a2a_overlap_needs_graphs and not h100.a2a_overlap_needs_graphs
    assert "negative on the GB200" in a2a_overlap_left_off(stack, gb200)
    assert a2a_overlap_left_off(stack, h100) is None and a2a_overlap_left_off(GRAPHED, gb200) is None
    partial = stack.model_copy(update={"cuda_graphs": True, "cuda_graph_scope": "attention_and_router"})
    assert a2a_overlap_left_off(partial, gb200) is not None   # the guide's runs graphed attention and router only


def test_a_gb200_plan_leaves_it_off_says_why_and_keeps_a_pin():
    plan = planner.plan("qwen3-30b-a3b", device="gb200", dispatcher="alltoall", **COMMON)
    assert not plan.layout.moe_a2a_overlap
    assert any(r.startswith("combined 1F1B left off: on gb200") and "would hide" in r for r in plan.reasons)
    layout = "tp=1,pp=4,vp=2,cp=1,ep=16,dp=16,mbs=4,zero=1,dispatcher=alltoall"
    open_ = planner.evaluate("qwen3-30b-a3b", layout=layout, device="gb200", num_devices=64, global_batch=512)
    assert not open_.layout.moe_a2a_overlap
    pinned = planner.evaluate("qwen3-30b-a3b", layout=layout + ",a2a_overlap=true", device="gb200", num_devices=64,
                              global_batch=512)
    assert pinned.layout.moe_a2a_overlap and pinned.step_time_s < open_.step_time_s
    assert any(r.startswith("combined 1F1B as pinned") and "does not bill" in r for r in pinned.reasons)
    h100 = planner.plan("qwen3-30b-a3b", device="h100-sxm", dispatcher="alltoall", **COMMON)
    assert h100.layout.moe_a2a_overlap and not any("left off" in r for r in h100.reasons)
    graphed = planner.plan("qwen3-30b-a3b", device="gb200", dispatcher="alltoall", stack=GRAPHED, **COMMON)
    assert graphed.layout.moe_a2a_overlap and not any("left off" in r for r in graphed.reasons)


@pytest.mark.heavy
@pytest.mark.parametrize("graphed", [False, True])
def test_the_search_equals_the_enumeration_with_it_off_or_weighed(graphed):
    """On a device that needs whole-layer graphs, the search's plan is the enumeration's best over layouts without
    combined 1F1B; with a stack that replays whole layers, over layouts with it off and on, whose best runs it
    (search = enumeration; experts on every rank)."""
    graph = capture(moe_model())
    cluster = small_cluster(8, 16)
    # the all-to-alls at full speed beside compute, so that combined 1F1B pays where it may run and the switch is live
    needs = cluster.device.model_copy(update={"a2a_overlap_needs_graphs": True,
                                              "flex_dispatch_rate_beside_compute": None})
    cluster = cluster.model_copy(update={"device": needs})
    stack = load_stack().model_copy(update={"moe_a2a_overlap": True, **(
        {"cuda_graphs": True, "cuda_graph_scope": "layers"} if graphed else {})})
    enumerated = stack if graphed else stack.model_copy(update={"moe_a2a_overlap": False})
    # experts spread over all 8 ranks (at ep = 1 nothing is exchanged and nothing to hide)
    per_layout = brute_force_degrees(graph.costs(), graph, cluster, 16, enumerated, (1, 2, 4), eps=(8,))
    truth = min(per_layout.values(), key=lambda e: e.step_time_s)
    outcome = search(graph.costs(), cluster, 16, Pins(vp=None, ep=8), stack=stack, graph=graph, top_k=1,
                     time_limit_s=120, recompute_choices=(Recompute.none,))
    found = outcome.ranked[0].estimate
    assert outcome.unexplored == 0
    assert found.step_time_s == pytest.approx(truth.step_time_s, rel=1e-4)
    assert found.layout.moe_a2a_overlap == (graphed and truth.layout.moe_a2a_overlap)
    if graphed:   # the switch is live where whole layers are graphed: the optimum runs it, so the rule moves it
        assert truth.layout.moe_a2a_overlap
        off = {lay: per_layout.get(replace(lay, moe_a2a_overlap=False)) for lay in per_layout}
        assert any(lay.moe_a2a_overlap and stack.hides_moe_a2a(lay) and off[lay] is not None
                   and est.step_time_s < off[lay].step_time_s for lay, est in per_layout.items())
