"""A search's best estimate as a `Plan`: its layout, stages, memory and step parts, the reasons for its settings
(each with what the alternative would cost), its error band and where it lies outside the measured region."""
from __future__ import annotations

from dataclasses import replace

from cost_models.step_time import Estimate, estimate
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from .alternatives import other_dispatchers, other_fp8_recipes, tp_overlap_twin
from .error_bands import band_for
from .explain import (all_to_all_fraction_note, alternatives, dispatch_rate_note, dispatch_sm_notes,
                      dispatcher_reason, expert_load_note, fp8_recipe_reason, host_note, offload_reason, reasons,
                      state_notes, tp_overlap_reason)
from .graph_capture.graph import ModelGraph
from .plans import LayoutRecord, Plan, SearchStats, memory_records, stage_records
from .region import outside_notes
from .rules.stack import a2a_overlap_left_off
from .search.offload_leaf import offload_alternative
from .search.tree import SearchOutcome


def build_plan(graph: ModelGraph, cluster: Cluster, best: Estimate, outcome: SearchOutcome | None,
               stack: SoftwareStack, ep_imbalance: float = 1.0) -> Plan:
    stats = None
    # where the stack could pair the plan's MoE passes: the plan with combined 1F1B flipped says why (not),
    # unless the stack's own rule (full recomputation) rules it out
    # (TP overlap chosen again for the flipped plan, as the search would, unless the plan's was given otherwise)
    pairs, twin = stack.pairs_moe_a2a(best.layout), None
    flipped = replace(best.layout, moe_a2a_overlap=not best.layout.moe_a2a_overlap)
    if best.layout.tp_comm_overlap == stack.tp_overlap_choice(best.layout, cluster.device):
        flipped = replace(flipped, tp_comm_overlap=stack.tp_overlap_choice(flipped, cluster.device))
    if pairs and stack.hides_moe_a2a(best.layout if best.layout.moe_a2a_overlap else flipped):
        twin = estimate(graph.costs_record, cluster, flipped, stack, ep_imbalance)
    ranked = []
    if outcome is not None:
        ranked = [s.estimate for s in outcome.ranked]
        top = outcome.ranked[0].partition if outcome.ranked else None
        status = "time-limited" if outcome.unexplored else "unproven" if outcome.unproven else "complete"
        stats = SearchStats(wall_s=round(outcome.wall_s, 3), cpu_s=round(outcome.cpu_s, 3), status=status,
                            candidates=outcome.candidates, pruned_memory=outcome.pruned_memory,
                            pruned_bound=outcome.pruned_bound, solved=outcome.solved,
                            unexplored=outcome.unexplored, unproven_leaves=outcome.unproven,
                            gap=round(top.gap if top else 0.0, 6))
    block_names = tuple(slot.module_name for slot in graph.blocks)
    return Plan(
        model=graph.name, cluster=cluster.name, stack=stack.name, num_devices=cluster.num_devices,
        devices_per_node=cluster.devices_per_node, segment_devices=cluster.equal_segment_devices,
        cluster_profile=cluster.profile,
        device_profile=cluster.device.profile,
        placement=cluster.placement_text(), seq_len=graph.seq_len,
        layout=LayoutRecord.of(best.layout, best.layer_recompute, stack, cluster.device),
        stages=stage_records(best, block_names, graph.embedding_modules, graph.head_modules),
        step_time_s=best.step_time_s, tokens_per_s=best.tokens_per_s, tflops_per_device=best.tflops_per_device,
        mfu=best.mfu, hfu=best.hfu, fits=best.fits, peak_memory_bytes=best.peak_memory_bytes,
        memory=memory_records(best), breakdown=best.breakdown.parts(), search=stats,
        alternatives=alternatives(best, ranked[1:]),
        reasons=reasons(best, cluster, ranked[1:], pairs, twin, a2a_overlap_left_off(stack, cluster.device))
        + dispatcher_reason(best, other_dispatchers(graph, cluster, best, stack, ep_imbalance))
        + fp8_recipe_reason(best, other_fp8_recipes(graph, cluster, best, stack, ep_imbalance),
                            stack.fp8_recipes[0] if stack.fp8_recipes else None)
        + dispatch_sm_notes(best, stack, cluster) + dispatch_rate_note(best, stack, cluster)
        + tp_overlap_reason(best, stack, cluster, tp_overlap_twin(graph, cluster, best, stack, ep_imbalance), twin)
        + offload_reason(best, cluster, *offload_alternative(graph.costs_record, cluster, best, stack, ep_imbalance))
        + state_notes(best, stack) + expert_load_note(graph.costs_record, best.layout, ep_imbalance)
        + all_to_all_fraction_note(graph.costs_record, cluster, best.layout, stack)
        + host_note(graph.costs_record, cluster, best.layout, stack, ep_imbalance) + list(graph.assumed),
        ep_imbalance=ep_imbalance,
        capture_front_end=graph.front_end, capture_notes=list(graph.capture_notes), mtp_layers=graph.mtp_layers,
        **_band_fields(best.step_time_s, graph.num_experts > 0),
        outside_measured=outside_notes(graph.seq_len, graph.hidden_size, graph.num_experts, best.layout.tp,
                                       best.layout.cp, best.layout.ep, best.layout.moe_dispatcher,
                                       best.layout.offload_layers, cluster.device.name,
                                       stack.hides_moe_a2a(best.layout), best.layout.zero,
                                       best.layout.dp * best.layout.cp))


def _band_fields(step_time_s: float, moe: bool) -> dict:
    """The measured step times the prediction is consistent with, and what the band rests on."""
    band = band_for(moe)
    if band is None:
        return {}
    return {"step_time_band_s": [round(t, 6) for t in band.measured_s(step_time_s)], "band_basis": band.words()}
