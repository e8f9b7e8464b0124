"""The plan's own alternatives that its reasons weigh it against: the same layout, stage split and recomputation
under each other MoE dispatcher, FP8 recipe or TP-overlap switch the stack runs on the device."""
from __future__ import annotations

from dataclasses import replace

from cost_models.layout import Fp8Recipe, Layout, MoeDispatcher
from cost_models.step_time import Estimate, estimate
from hardware_profiles.errors import UserInputError
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import A2A_OVERLAP_DISPATCHERS, SoftwareStack

from .graph_capture.graph import ModelGraph
from .rules.device import check_device_for
from .rules.stack import layout_stack_problems


def other_dispatchers(graph: ModelGraph, cluster: Cluster, best: Estimate, stack: SoftwareStack,
                       ep_imbalance: float) -> list[Estimate]:
    """The plan under each other MoE dispatcher the stack runs on the device (experts spread), with the same
    split and recomputation; combined 1F1B kept where that dispatcher runs it."""
    lay = best.layout
    if lay.ep == 1:
        return []
    return [estimate(graph.costs_record, cluster, same_split(best, moe_dispatcher=MoeDispatcher(d),
                                                              moe_a2a_overlap=lay.moe_a2a_overlap
                                                              and d in A2A_OVERLAP_DISPATCHERS),
                     stack, ep_imbalance)
            for d in stack.dispatchers_on(cluster.device) if d != lay.moe_dispatcher]


def same_split(best: Estimate, **changes) -> Layout:
    """The plan's layout with its stage split and per-layer recomputation, and `changes`: an alternative the
    reasons weigh against it."""
    return replace(best.layout, stage_layers=best.stage_layers, layer_recompute=best.layer_recompute, **changes)


def other_fp8_recipes(graph: ModelGraph, cluster: Cluster, best: Estimate, stack: SoftwareStack,
                       ep_imbalance: float) -> list[Estimate]:
    """The FP8 plan under each other recipe the stack runs for it on the device (the rulebook's: MXFP8 on
    Blackwell, no delayed scaling beside recomputed casts), with the same split and recomputation."""
    lay = best.layout
    if lay.precision != "fp8":
        return []
    out = []
    for recipe in (r for r in stack.fp8_recipes if r != lay.fp8_recipe):
        other = same_split(best, fp8_recipe=Fp8Recipe(recipe))
        try:
            check_device_for(cluster, stack, "fp8", recipe)
        except UserInputError:
            continue
        if not layout_stack_problems(other, stack, graph):
            out.append(estimate(graph.costs_record, cluster, other, stack, ep_imbalance))
    return out


def tp_overlap_twin(graph: ModelGraph, cluster: Cluster, best: Estimate, stack: SoftwareStack,
                     ep_imbalance: float) -> Estimate | None:
    """The plan with TP communication overlap flipped, with the same split and recomputation, where the stack runs
    it for the layout and combined 1F1B does not rule it out."""
    lay = best.layout
    if not stack.tp_overlap_choice(lay, cluster.device):
        return None
    return estimate(graph.costs_record, cluster, same_split(best, tp_comm_overlap=not lay.tp_comm_overlap), stack,
                    ep_imbalance)
