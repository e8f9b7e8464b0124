"""Why a plan: the reasons a person reads, and what each alternative loses."""
from __future__ import annotations

from cost_models.compute import ShardSpec, layer_compute, rank_load
from cost_models.host_time import host_billed, layer_host_seconds
from cost_models.expert_comm import dispatch_rate_beside_compute
from cost_models.layer_costs import MeshCosts
from cost_models.layout import Layout, Recompute
from cost_models.memory import StateSharding, casts_by_fsdp_policy
from cost_models.records import ModelCosts
from cost_models.layout_codec import text_of
from cost_models.step_time import Estimate
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from .plans import Alternative
from .region import overlap_ab_note
from .search.tree import six_digits

PART_NAMES = {
    "compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
    "cp_comm_s": "context-parallel communication", "ep_comm_s": "expert all-to-all",
    "zero_comm_s": "ZeRO-2/3 per-micro-batch communication", "pipeline_bubble_s": "pipeline bubble",
    "pp_comm_s": "pipeline sends", "dp_comm_s": "data-parallel gradient reduction",
    "optimizer_s": "optimizer step", "host_s": "host-bound kernel launches",
    "offload_s": "activation copies to host memory",
}


def _largest_loss(best: Estimate, other: Estimate) -> str:
    mine, theirs = best.breakdown.parts(), other.breakdown.parts()
    part = max(theirs, key=lambda name: theirs[name] - mine[name])
    return f"+{theirs[part] - mine[part]:.3f} s {PART_NAMES[part]}"


def _loses(best: Estimate, other: Estimate) -> str:
    if six_digits(other.step_time_s) == six_digits(best.step_time_s):  # the search's tie rule
        return "ties; the plan is the simpler layout"
    return f"{(other.step_time_s / best.step_time_s - 1) * 100:.1f}% slower: " + _largest_loss(best, other)


def alternatives(best: Estimate, others: list[Estimate]) -> list[Alternative]:
    return [Alternative(layout=text_of(other.layout), step_time_s=other.step_time_s, mfu=other.mfu,
                        loses=_loses(best, other)) for other in others]


def combined_1f1b_reason(best: Estimate, twin: Estimate | None, left_off: str | None = None) -> str:
    """Why the plan runs combined 1F1B or not: against the same plan with the switch flipped, or (no twin)
    because the stack does not pair passes beside the plan's full recomputation; `left_off`: the rule that keeps
    it off on this device under this stack (`planner.rules.stack.a2a_overlap_left_off`)."""
    if twin is None and left_off:   # (the search never weighed it here, whatever the plan recomputes)
        return f"combined 1F1B left off: {left_off}"
    if twin is None:
        return "combined 1F1B is not used: Megatron-Core refuses it beside full recomputation, which this plan uses"

    def fullest(estimate: Estimate) -> float:
        return max(stage.total for stage in estimate.stage_memory)

    on, off = (best, twin) if best.layout.moe_a2a_overlap else (twin, best)
    hidden = off.breakdown.parts()["ep_comm_s"] - on.breakdown.parts()["ep_comm_s"]
    extra_gb = (fullest(on) - fullest(off)) / 1e9
    if left_off and best is on:
        return (f"combined 1F1B as pinned hides {hidden:.3f} s of expert all-to-all in this prediction, which does "
                f"not bill its stages' CPU overhead: {left_off}")
    if left_off:
        return (f"combined 1F1B left off: {left_off} (the model, which does not bill that overhead, would hide "
                f"{hidden:.3f} s of expert all-to-all with it)")
    if best is on:
        return (f"combined 1F1B (MoE all-to-alls beside another micro-batch's compute) hides {hidden:.3f} s of "
                f"expert all-to-all for {extra_gb:.1f} GB more on the fullest stage")
    if not on.fits:
        return (f"combined 1F1B would hide {hidden:.3f} s of expert all-to-all, but its extra forward's "
                f"activations (+{extra_gb:.1f} GB on the fullest stage) do not fit")
    return f"combined 1F1B with the same split and recomputation {_loses(best, on)}"


def dispatcher_reason(best: Estimate, others: list[Estimate]) -> list[str]:
    """Why the plan's MoE dispatcher: each other one the stack runs on the device, with the same split and
    recomputation (combined 1F1B kept where that dispatcher runs it)."""
    if not others:
        return []
    words = [f"{other.layout.moe_dispatcher} " + (_loses(best, other) if other.fits else "does not fit")
             for other in others]
    return [f"dispatcher {best.layout.moe_dispatcher} (tokens {best.layout.moe_dispatcher.words}); with the "
            f"same split and recomputation {'; '.join(words)}"]


def fp8_recipe_reason(best: Estimate, others: list[Estimate], stack_default: str | None) -> list[str]:
    """The plan's FP8 recipe and what each other one the stack runs on the device would cost with the same split
    and recomputation. The recipe sets the scaling numerics (per tensor, delayed or current, per block), so the
    search keeps the stack's default or the user's pin rather than choosing it by modelled speed."""
    lay = best.layout
    if lay.precision != "fp8":
        return []
    why = "the stack's default" if lay.fp8_recipe == stack_default else "as given"
    words = [f"{other.layout.fp8_recipe} " + (_loses(best, other) if other.step_time_s >= best.step_time_s
                                              else f"{(1 - other.step_time_s / best.step_time_s) * 100:.1f}% faster")
             + ("" if other.fits else " (does not fit)") for other in others]
    return [f"FP8 recipe {lay.fp8_recipe} ({why}): the recipe sets the scaling numerics, so it is kept rather than "
            "chosen by modelled speed (pin fp8_recipe= to change it)"
            + (f"; with the same split and recomputation {'; '.join(words)}" if words else "")]


def reasons(best: Estimate, cluster: Cluster, others: list[Estimate], pairs: bool = False,
            twin: Estimate | None = None, a2a_left_off: str | None = None) -> list[str]:
    """`pairs`: the stack could pair this layout's MoE passes (combined 1F1B); `twin`: the plan with that
    switch flipped, None where full recomputation rules it out; `a2a_left_off`: why the search leaves it off on
    this device (`combined_1f1b_reason`)."""
    lay = best.layout
    out = []
    if lay.tp > 1:
        inside = lay.tp <= cluster.fast_domain_devices
        out.append(f"tp={lay.tp}{' with sequence parallelism' if lay.sp else ''} "
                   + ("keeps tensor-parallel traffic inside the "
                      f"{cluster.fast_domain_devices}-device {cluster.device.intra_node.kind.value} domain"
                      if inside else "spans fast domains (pinned)"))
    parts = best.breakdown.parts()
    ranked = sorted(((v, k) for k, v in parts.items() if k != "compute_s" and v > 0), reverse=True)
    share = parts["compute_s"] / best.step_time_s * 100
    out.append(f"compute is {share:.0f}% of the step"
               + (f"; the largest overhead is {PART_NAMES[ranked[0][1]]} ({ranked[0][0]:.3f} s)" if ranked else ""))
    fullest = max(best.stage_memory, key=lambda s: s.total)
    out.append(f"fullest stage {fullest.stage} uses {fullest.total / 1e9:.1f} of {fullest.capacity / 1e9:.1f} GB usable")
    counts = {r: best.layer_recompute.count(r) for r in Recompute}
    if counts[Recompute.full] or counts[Recompute.selective]:
        modules = f", repeating {', '.join(map(str, lay.recompute_modules))}" if counts[Recompute.selective] else ""
        out.append(f"recomputation on {counts[Recompute.full]} layers (full) and {counts[Recompute.selective]} "
                   f"(selective{modules}) is the cheapest way to fit memory")
    if lay.pp > 1:
        uneven = len(set(best.stage_layers)) > 1
        schedule = (" as DualPipeV's V (rank 0 holds the embedding and the loss; each steady-state forward beside "
                    "another micro-batch's backward)") if lay.dualpipev else ""
        out.append(f"{lay.pp} pipeline stages x {lay.vp} virtual{schedule}, {lay.num_micro_batches} micro-batches"
                   + ("; layers split unevenly to balance the embedding and head" if uneven else ""))
    if pairs:
        out.append(combined_1f1b_reason(best, twin, a2a_left_off))
        if twin is not None and best.layout.moe_a2a_overlap:
            out.extend(overlap_ab_note(cluster.device.name, 1 - best.step_time_s / twin.step_time_s))
    if others:
        out.append(f"the next best ({text_of(others[0].layout)}) {_loses(best, others[0])}")
    return out


def tp_overlap_reason(best: Estimate, stack: SoftwareStack, cluster: Cluster, twin: Estimate | None,
                      a2a_twin: Estimate | None) -> list[str]:
    """Why the plan runs TP communication overlap or not, where the stack runs it for the layout: against the same
    plan with it flipped (`twin`), or, where combined 1F1B rules it out on this device, against the plan without
    combined 1F1B (`a2a_twin`)."""
    lay = best.layout
    if not stack.tp_overlap_applies(lay):
        return []
    if not stack.tp_overlap_choice(lay, cluster.device):   # it applies: combined 1F1B rules it out here
        without = f"; with it and without combined 1F1B the plan {_loses(best, a2a_twin)}" \
            if a2a_twin is not None and a2a_twin.layout.tp_comm_overlap else ""
        return [f"TP communication overlap is off beside combined 1F1B on {cluster.device.name}: it wants one CUDA "
                "connection per device and combined 1F1B several (CUDA_DEVICE_MAX_CONNECTIONS), so the TP collectives "
                "are billed whole, as Megatron-Bridge's H100 recipes with combined 1F1B run them" + without]
    if twin is None:
        return []
    on, off = (best, twin) if lay.tp_comm_overlap else (twin, best)
    hidden = off.breakdown.parts()["tp_comm_s"] - on.breakdown.parts()["tp_comm_s"]
    if best is on:
        return [f"TP communication overlap (the TP collectives as chunked rings beside the GEMMs) hides {hidden:.3f} s "
                f"of tensor-parallel communication; without it the plan {_loses(best, off)}"]
    return [f"TP communication overlap is off as given (tp_overlap=false); on, it would hide {hidden:.3f} s of "
            f"tensor-parallel communication ({(1 - on.step_time_s / best.step_time_s) * 100:.1f}% faster)"]


def offload_reason(best: Estimate, cluster: Cluster, applies: bool, twin: Estimate | None,
                   host_bytes: float) -> list[str]:
    """Why the plan offloads activations to host memory or recomputes instead, where the stack could do either for
    the layout (`applies`): against the other way of fitting the same layout (`twin`: recomputation chosen by the
    partition solver, or the fewest offloaded layers that fit; None where that way does not fit)."""
    lay, link = best.layout, cluster.device.host_link_gbytes_per_s
    if not applies:
        return []
    if lay.offload_layers:
        copies = best.breakdown.offload_s
        other = f"; recomputing instead, the plan {_loses(best, twin)}" if twin is not None else \
            "; recomputation alone does not fit it"
        return [f"activation offloading: the first {lay.offload_layers} of {len(best.layer_recompute)} layers' saved "
                f"activations go to host memory ({host_bytes / 1e9:.1f} GB per device, over the {link:g} GB/s host "
                f"link), the fewest that fit; {copies:.3f} s of copies outlast the passes beside them" + other]
    if set(best.layer_recompute) == {Recompute.none}:
        return []
    if twin is None:
        return [f"recomputation rather than activation offloading, which cannot fit the layout: offloading all but "
                f"the last layer, or no more than the {cluster.device.host_memory_bytes / 1e9:.0f} GB of host memory "
                "per device holds, frees too little"]
    return [f"recomputation rather than activation offloading: offloading the fewest layers that fit "
            f"({twin.layout.offload_layers}) over the {link:g} GB/s host link instead, the plan "
            + _loses(best, twin)]


def state_notes(best: Estimate, stack: SoftwareStack) -> list[str]:
    """What the stack's torch mixed precision and pipelining hold beyond ZeRO's shares (`StateSharding`), said."""
    sharding = StateSharding.of(best.layout, stack)
    out = []
    if sharding.copied_roles:
        what, how = ("every layer's parameters", "FSDP2's unsharded parameters") \
            if casts_by_fsdp_policy(sharding.zero, sharding.dp_cp) \
            else ("the blocks' and output layer's weights", "autocast's cache")
        out.append(f"the fp32 parameters are the master: a bf16 copy of {what} ({how}, 2 bytes each, unsharded) "
                   "is held from their forward to their backward")
    if best.layout.dualpipev and stack.dualpipev_weight_pass_recompute and Recompute.full in best.layer_recompute:
        out.append("DualPipeV's split weight passes recompute each recomputed layer once per parameter group "
                   "(torch's stage_backward_weight over non-reentrant checkpointing): billed in its bubble term")
    if best.layout.zero >= 3 and not stack.zero3_traffic_hidden:
        each = " one collective per parameter tensor, each paying its latency," \
            if stack.zero3_collectives == "per_tensor" else ""
        out.append(f"ZeRO-3's all-gathers and reduce-scatters run{each} between compute, not beside it: "
                   f"{stack.display_name}'s parameter fetch waits for the device to idle (zero3_traffic_hidden: "
                   "false), so the plan bills all of them")
    if best.layout.zero >= 3 and stack.zero3_reuse_distance_params and Recompute.full in best.layer_recompute:
        out.append("fully recomputed layers gather their modules again for the backward where the modules after them "
                   f"fetch {stack.zero3_reuse_distance_params:,.0f} parameters or more in between "
                   "(zero3_reuse_distance_params): billed")
    if sharding.unsharded_gradients:
        out.append(f"ZeRO-{best.layout.zero} under torch's pipelining keeps the gradients whole through the step "
                   "(pipeline_gradient_accumulation: unsharded): they are reduce-scattered once, after the last "
                   "micro-batch")
    return out


def dispatch_sm_notes(best: Estimate, stack, cluster: Cluster) -> list[str]:
    """What the dispatch kernels' SMs cost where the schedule (combined 1F1B, or DualPipeV's pairs) or the
    shared experts' stream hide them behind compute, or that it is not billed
    (`MeshCosts.sm_share_held_by_dispatch`)."""
    if stack.dualpipev_hides(best.layout):
        schedule = "DualPipeV's pairs hide them behind compute"
    elif stack.hides_moe_a2a(best.layout):
        schedule = "combined 1F1B hides them behind compute"
    elif stack.runs_shared_experts_beside_a2a(best.layout):
        schedule = "the shared experts run beside them"
    else:
        return []
    device = cluster.device
    deepep = best.layout.moe_dispatcher == "deepep"
    backend = "HybridEP" if device.flex_dispatcher_backend == "hybridep" else "DeepEP"
    kernels = f"{backend}'s kernels hold" if deepep else "NCCL's all-to-all holds"
    if device.sm_count is None or not (deepep or device.nccl_p2p_sms):
        missing = "no SM count" if device.sm_count is None else "no NCCL p2p channel count"
        return [f"{kernels} SMs while {schedule}; the {device.name} profile gives "
                f"{missing}, so the compute they slow is not billed"]
    channels = device.nccl_p2p_sms
    held = f"{stack.flex_dispatcher_sms(device)}" if deepep else \
        f"one per p2p channel ({channels.within_node} within a node, {channels.across_nodes} across nodes)"
    return [f"{kernels} {held} of {device.sm_count} SMs while {schedule}: that "
            "compute runs on the rest while they last"]


def dispatch_rate_note(best: Estimate, stack, cluster: Cluster) -> list[str]:
    """At what speed combined 1F1B's all-to-alls are billed beside the compute they hide behind: the device's
    measured rate for DeepEP-style kernels, or full speed where no profile measured one (`Device.
    flex_dispatch_rate_beside_compute`; cost_models.expert_comm.dispatch_rate_beside_compute)."""
    if not stack.hides_moe_a2a(best.layout) or stack.dualpipev_hides(best.layout):
        return []
    device = cluster.device
    rate = dispatch_rate_beside_compute(best.layout, device)
    if rate is not None:
        return [f"combined 1F1B's all-to-alls progress at {rate:.0%} of full speed while compute runs beside them "
                f"(the {device.name} profile's flex_dispatch_rate_beside_compute, from a published Nsight comparison): "
                "they hide less than their length"]
    kernels = "NCCL's all-to-all" if best.layout.moe_dispatcher != "deepep" else "the DeepEP-style kernels"
    return [f"combined 1F1B's all-to-alls are billed at full speed beside compute: no profile measured the rate of "
            f"{kernels} beside compute on {device.name}, and where one was measured (a device profile's "
            "flex_dispatch_rate_beside_compute) it was well below full speed, so this plan's credit for combined 1F1B "
            "may be too large"]


def all_to_all_fraction_note(model: ModelCosts, cluster: Cluster, layout: Layout, stack: SoftwareStack) -> list[str]:
    """Said where NCCL's expert all-to-all crosses nodes on a cluster whose profile has no all-to-all figure of
    its own: the rings' is assumed (`InterNodeNetwork.all_to_all_fraction`)."""
    network = cluster.inter_node
    if (layout.ep == 1 or layout.moe_dispatcher != "alltoall" or network.all_to_all_fraction is not None
            or not any(kind.num_experts for kind, _ in model.block_counts)):
        return []
    group = MeshCosts(model, cluster, layout, stack).placement.experts.of("ep")
    if group.ranks_per_node >= group.size:
        return []
    return [f"the expert all-to-all crosses nodes and the cluster profile gives no inter_node.all_to_all_fraction: "
            f"it is billed at the rings' busbw_fraction ({network.busbw_fraction:g}), which NCCL's all-to-all "
            "falls short of where it is fitted (the DGX clusters' figure, docs/profiles.md)"]


def expert_load_note(model: ModelCosts, layout: Layout, ep_imbalance: float) -> list[str]:
    """What a MoE plan assumed of its routing, said in its reasons."""
    if not any(kind.num_experts for kind, _ in model.block_counts):
        return []
    if layout.ep == 1:
        return ["routing load does not matter at ep=1: every rank runs every expert on its own tokens"]
    load = rank_load(ep_imbalance, layout.ep)
    if load == 1.0:
        return ["routing assumed balanced: every expert rank takes the mean of the routed tokens (--ep-imbalance 1; "
                "give the measured ratio of the busiest rank's tokens to the mean otherwise)"]
    capped = f", capped at ep={layout.ep}" if load < ep_imbalance else ""
    return [f"the busiest expert rank takes {load:g} x the mean of the routed tokens (--ep-imbalance{capped}): its "
            "expert GEMMs, sorts, all-to-all bytes and routed activations set the layer's time and memory"]


def host_note(model: ModelCosts, cluster: Cluster, layout: Layout, stack: SoftwareStack,
              ep_imbalance: float = 1.0) -> list[str]:
    """How close the host comes to the device in the layer kind where it comes closest, or why it is not billed."""
    device = cluster.device
    if not host_billed(device, stack):
        if stack.cuda_graphs:
            return [f"the {stack.name} stack replays its layers as CUDA graphs: host time is not billed"]
        missing = f"the {device.name} profile gives no host CPU time (host_call_us)" if device.host_call_us is None \
            else f"the {stack.name} stack states no host time per call (host_calls)"
        return [f"{missing}: a host slower than the device at issuing kernels is not billed"]
    spec = ShardSpec.of(layout, stack, ep_imbalance=ep_imbalance)
    ratios = []
    for kind, _ in model.block_counts:
        compute, host = layer_compute(kind, device, spec), layer_host_seconds(kind, device, stack, spec)
        device_s = compute.forward_s + compute.backward_s
        ratios.append(((host.forward_s + host.backward_s) / device_s if device_s else 0.0, kind.name,
                       host.before_sync_s is not None))
    ratio, name, synced = max(ratios)
    verdict = "host-bound: the device waits for launches" if ratio > 1 else "device-bound"
    also = "; its dispatcher's host sync stops the host running ahead before the experts" if synced else ""
    if stack.cuda_graphs:   # a partial scope (whole layers bill no host time at all)
        also += "; each layer's attention and router replayed as CUDA graphs"
    return [f"the host issues a {name} layer's kernels in {ratio:.0%} of the device's time for them ({verdict}; "
            f"{device.host_call_us:g} us per call on this node's CPU, {stack.name}'s calls{also})"]
