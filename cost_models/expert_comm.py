"""The expert all-to-alls of one layout as a training step pays them: the dispatcher's exchanges (a plain
all-to-all, DeepEP's deduplicated one, or Megatron-Core's all-gather), and what overlaps hide of them
(combined 1F1B's paired passes, DualPipeV's pairs, the shared experts beside them), with the SMs the
communication kernels hold from the compute beside them.

`ExpertCommunication` is a part of `MeshCosts` (cost_models/layer_costs.py), which gives it the layout, the
stack, the placement of the groups and the collective times.
"""
from __future__ import annotations

from dataclasses import dataclass

from hardware_profiles.schema import Device

from .communication import ACTIVATION_BYTES, Collective
from .compute import LayerCompute, SharedExpertSeconds, gathered_tokens
from .expert_dispatch import deduplicated_exchange, fp8_token_bytes
from .layout import Layout, Precision
from .paired_passes import LayerPassParts, combined_1f1b_exposed_floor_s, combined_1f1b_exposed_s
from .pipeline import combined_1f1b_paired_share
from .records import LayerKind


@dataclass(frozen=True)
class PairedPasses:
    """A layer's all-to-alls and passes as combined 1F1B pairs them."""
    per_pass_s: float          # one pass's dispatch and combine, alone
    forward: LayerPassParts
    backward: LayerPassParts
    held_share: float          # of the SMs, by the dispatch kernels
    comm_rate: float = 1.0     # of full speed, at which the all-to-alls progress beside compute

    def exposed_s(self, paired_share: float, paired_pass_s: float) -> float:
        """A forward and a backward: the unpaired share alone, the paired share as the pair exposes them."""
        return 2 * self.per_pass_s * (1 - paired_share) + paired_share * paired_pass_s

    def exposed_floor_s(self, paired_share: float) -> float:
        """At or below `exposed_s` for any layers per chunk, without running the two streams."""
        return self.exposed_s(paired_share, combined_1f1b_exposed_floor_s(self.forward, self.backward,
                                                                           self.held_share, self.comm_rate))


def exposed_beside_compute(a2a_s: float, compute_s: float, held_share: float) -> float:
    """Seconds a pass's all-to-all adds when it runs beside `compute_s` of another micro-batch's compute while
    holding `held_share` of the device's SMs: the compute runs on the rest while it lasts, so the pair takes
    max(a, c + a f) and exposes max(a - c, a f) (DeepSeek-V3 3.2.2 dedicates SMs to communication for this)."""
    return max(a2a_s - compute_s, a2a_s * held_share)


def dispatch_rate_beside_compute(layout: Layout, device: Device) -> float | None:
    """The share of full speed at which the dispatch kernels progress beside combined 1F1B's compute: the device's
    measured rate for DeepEP-style kernels (`Device.flex_dispatch_rate_beside_compute`); None where it has none, or
    for NCCL's all-to-all, which no profile measured beside compute (billed at full speed; the plan says so)."""
    return device.flex_dispatch_rate_beside_compute if layout.moe_dispatcher == "deepep" else None


class ExpertCommunication:
    """The MoE all-to-all part of `MeshCosts`."""

    def ep_exchanges_s(self, kind: LayerKind) -> tuple[float, float]:
        """One pass's dispatch and combine all-to-alls of the tokens times top-k (0 without experts spread)."""
        if not kind.num_experts or self.layout.ep == 1:
            return 0.0, 0.0
        tokens = self.tokens_per_rank()
        if self.layout.moe_dispatcher == "deepep":
            return self._deduplicated_exchanges_s(kind, tokens)
        if self.layout.moe_dispatcher == "allgather":
            return self._gathered_exchanges_s(kind)
        size = tokens * kind.router_topk * kind.hidden_size * ACTIVATION_BYTES
        one = self.collective(Collective.all_to_all, size, "ep", imbalance=self.spec.expert_load).seconds
        return one, one

    def ep_pass_s(self, kind: LayerKind) -> float:
        return sum(self.ep_exchanges_s(kind))

    def ep_comm_s(self, kind: LayerKind, compute: LayerCompute | None = None) -> float:
        """The all-to-alls of a forward and a backward as the steady state pays them; `compute` (the layer's, read
        only where compute runs beside them) is taken from the layout where not given."""
        dispatch, combine = self.ep_exchanges_s(kind)
        per_pass = dispatch + combine
        lay, stack = self.layout, self.stack
        if not (stack.dualpipev_hides(lay) or stack.hides_moe_a2a(lay) or stack.runs_shared_experts_beside_a2a(lay)):
            return 2 * per_pass
        if compute is None:
            compute = self.compute_of(kind)
        share = self.sm_share_held_by_dispatch() or 0.0   # what compute runs beside them holds the rest
        if stack.dualpipev_hides(lay):
            # every steady-state pass runs beside another's whole compute (the rest `dualpipev_seconds` bills
            # alone), on the SMs the compute leaves them
            return exposed_beside_compute(per_pass, compute.backward_s, share) + \
                exposed_beside_compute(per_pass, compute.forward_s, share)
        if stack.runs_shared_experts_beside_a2a(lay):
            return self._beside_shared_experts_s(dispatch, combine, compute.shared_experts, share)
        passes = self._paired(dispatch, combine, compute, share)
        return passes.exposed_s(self.paired_share(lay.vp), self.paired_pass_s(passes, self.layers_per_chunk(lay.vp)))

    def paired_passes(self, kind: LayerKind, compute: LayerCompute) -> "PairedPasses":
        """What combined 1F1B pairs of a layer: no vp changes it (a search bounds every vp of a placement from
        one layout's costs)."""
        dispatch, combine = self.ep_exchanges_s(kind)
        share = self.sm_share_held_by_dispatch() or 0.0   # what compute runs beside them holds the rest
        return self._paired(dispatch, combine, compute, share)

    def _paired(self, dispatch: float, combine: float, compute: LayerCompute, share: float) -> "PairedPasses":
        rate = dispatch_rate_beside_compute(self.layout, self.cluster.device) or 1.0   # unmeasured: full speed
        return PairedPasses(dispatch + combine, *self._pass_parts(dispatch, combine, compute), share, rate)

    def paired_share(self, vp: int) -> float:
        # combined 1F1B pairs the forward of micro-batch i+1 with the backward of i, layer by layer, in
        # Megatron-Core's order on two streams; the warmup forwards and cooldown backwards are alone
        return combined_1f1b_paired_share(self.layout.pp, vp, self.layout.num_micro_batches)

    def layers_per_chunk(self, vp: int) -> int:
        return max(1, round(len(self.model.blocks) / (self.layout.pp * vp)))

    def paired_pass_s(self, passes: "PairedPasses", layers: int) -> float:
        """The all-to-alls a paired forward and backward expose, with the weight gradients delayed (the plan's
        Megatron export adds --delay-wgrad-compute to it)."""
        key = (passes.forward, passes.backward, layers, passes.held_share, passes.comm_rate)
        if key not in self._shared.paired_layers:
            self._shared.paired_layers[key] = combined_1f1b_exposed_s(passes.forward, passes.backward, layers,
                                                                      passes.held_share, delay_wgrad=True,
                                                                      comm_rate=passes.comm_rate)
        return self._shared.paired_layers[key]

    @staticmethod
    def _beside_shared_experts_s(dispatch: float, combine: float, shared: SharedExpertSeconds,
                                 held_share: float) -> float:
        """The all-to-alls of a forward and a backward with the shared experts beside them (Megatron-Core
        --moe-shared-expert-overlap): forward, the up-projection beside the dispatch and the down-projection
        beside the combine; backward, the down-projection's gradients beside the combine's (a dispatch) and the
        up-projection's beside the dispatch's."""
        pairs = ((dispatch, shared.up_forward_s), (combine, shared.down_forward_s),
                 (dispatch, shared.down_backward_s), (combine, shared.up_backward_s))
        return sum(exposed_beside_compute(a2a, beside, held_share) for a2a, beside in pairs)

    @staticmethod
    def _pass_parts(dispatch: float, combine: float, compute: LayerCompute) -> tuple[LayerPassParts, LayerPassParts]:
        """A layer's forward and backward split where combined 1F1B splits them (cost_models/paired_passes.py);
        the backward's dispatch gradient is a combine and its combine gradient a dispatch."""
        experts_f, experts_bi, experts_bw = compute.experts_s
        forward = LayerPassParts(compute.forward_s - experts_f, 0.0, experts_f, 0.0, dispatch, combine)
        backward = LayerPassParts(compute.backward_input_s - experts_bi, compute.backward_weight_s - experts_bw,
                                  experts_bi, experts_bw, dispatch, combine)
        return forward, backward

    def sm_share_held_by_dispatch(self) -> float | None:
        """The share of the device's SMs the dispatch kernels hold while they run: DeepEP's or HybridEP's
        (`SoftwareStack.flex_dispatcher_sms`), or NCCL's p2p channels (within a node, or across nodes where the
        expert group leaves its node); None where the profile gives no SM count or no NCCL channel count (the plan
        says so)."""
        device = self.cluster.device
        if device.sm_count is None:
            return None
        if self.layout.moe_dispatcher == "deepep":
            return self.stack.flex_dispatcher_sms(device) / device.sm_count
        if device.nccl_p2p_sms is None:
            return None
        group = self.placement.experts.of("ep")
        held = device.nccl_p2p_sms.across_nodes if group.ranks_per_node < group.size else \
            device.nccl_p2p_sms.within_node
        return held / device.sm_count

    def _gathered_exchanges_s(self, kind: LayerKind) -> tuple[float, float]:
        """Megatron-Core's all-gather dispatcher (MoEAllGatherTokenDispatcher): the expert tp x ep ranks gather
        all their tokens with each token's routing map (bool) and probabilities over the experts, then
        reduce-scatter the experts' outputs back, in the probabilities' dtype: the router's, bf16 unless
        --moe-router-dtype says otherwise."""
        hidden, routing = self.gathered_dispatch_bytes(kind)
        dispatch = self.collective(Collective.all_gather, hidden + routing, "etpep").seconds
        combine = self.collective(Collective.reduce_scatter, hidden, "etpep").seconds
        return dispatch, combine

    def gathered_dispatch_bytes(self, kind: LayerKind) -> tuple[float, float]:
        """The all-gather dispatcher's gathered buffers of one MoE layer's micro-batch on a rank: the hidden states
        of the expert tp x ep group's tokens, and their routing map (bool) and probabilities over the experts."""
        gathered = gathered_tokens(kind, self.spec)
        return gathered * kind.hidden_size * ACTIVATION_BYTES, gathered * kind.num_experts * (1 + ACTIVATION_BYTES)

    def tokens_per_rank(self) -> float:
        """One micro-batch's tokens on a rank as the MoE layers take them (split by cp, and by tp under SP)."""
        lay = self.layout
        return lay.micro_batch * self.model.seq_len / (lay.cp * (lay.tp if lay.sp else 1))

    def dispatch_buffer_bytes(self) -> float:
        """Memory the all-gather dispatcher holds at a MoE layer's peak beyond the saved activations (Megatron-Core
        token_dispatcher.py, MoEAllGatherTokenDispatcher): the gathered hidden states until its local experts'
        tokens are picked out of them, then in the combine the outputs unpermuted into a buffer of that shape for
        the reduce-scatter (and backward, the gradients' all-gather into one), with the gathered routing map and
        probabilities beside them; the other dispatchers' buffers are the routed tokens the activations count."""
        if self.layout.moe_dispatcher != "allgather" or self.layout.ep == 1:
            return 0.0
        return max((sum(self.gathered_dispatch_bytes(kind)) for kind in self.model.kinds if kind.num_experts),
                   default=0.0)

    def _deduplicated_exchanges_s(self, kind: LayerKind, tokens: float) -> tuple[float, float]:
        """One dispatch and one combine, DeepEP-style (cost_models/expert_dispatch.py): FP8 dispatch where the
        layout trains in FP8 and the stack sends FP8 tokens (`SoftwareStack.moe_fp8_dispatch`), BF16 combine."""
        group = self.placement.experts.of("ep")
        bf16 = kind.hidden_size * ACTIVATION_BYTES
        fp8 = self.layout.precision == Precision.fp8 and self.stack.moe_fp8_dispatch
        dispatch = fp8_token_bytes(kind.hidden_size) if fp8 else bf16
        seconds = []
        for token_bytes in (dispatch, bf16):
            key = ("dedup", token_bytes, tokens, kind.name, group)
            if key not in self._shared.collectives:
                self._shared.collectives[key] = deduplicated_exchange(
                    tokens, token_bytes, kind.router_topk, kind.num_experts, group, self.cluster,
                    kind.router_num_groups, kind.router_group_topk, self.spec.expert_load)
            seconds.append(self._shared.collectives[key].seconds)
        return seconds[0], seconds[1]
