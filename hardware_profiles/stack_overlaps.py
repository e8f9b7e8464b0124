"""What a software stack overlaps and how it dispatches MoE tokens, for a given layout on a given device: TP
communication overlap, combined 1F1B and DualPipeV's pairs, the shared-expert overlap, the flex dispatcher's SMs,
the host sync at dispatch, and the CUDA connections the launcher sets. `SoftwareStack` (stack.py) takes these as
methods over its fields."""
from __future__ import annotations

# the dispatchers Megatron-Core's TransformerConfig runs combined 1F1B beside (--overlap-moe-expert-parallel-comm
# with --moe-token-dispatcher-type alltoall or flex): one rule for stacks, the search, plan files and evaluate
A2A_OVERLAP_DISPATCHERS = ("alltoall", "deepep")
A2A_OVERLAP_DISPATCHER_RULE = ("Megatron-Core's TransformerConfig runs combined 1F1B with the alltoall or flex "
                               "dispatcher only")


class StackOverlaps:
    """Methods of `SoftwareStack` (its fields read through `self`) that decide its overlaps and dispatch."""

    def runs_shared_experts_beside_a2a(self, layout) -> bool:
        """The shared-expert overlap applies: the stack has it, experts spread, and neither combined 1F1B nor
        DualPipeV's pairs run the all-to-alls beside other compute instead."""
        return (self.moe_shared_expert_overlap and layout.ep > 1 and layout.moe_dispatcher == "alltoall"
                and not self.hides_moe_a2a(layout) and not self.dualpipev_hides(layout))

    def syncs_host_at_dispatch(self, ep: int) -> bool:
        """Whether its MoE dispatcher copies token counts to the host in each MoE layer's forward at this ep."""
        return self.moe_dispatch_host_sync == "always" or (self.moe_dispatch_host_sync == "spread" and ep > 1)

    def tp_overlap_in(self, layout, device) -> bool:
        """TP communication overlap runs for this layout: the layout asks for it (`Layout.tp_comm_overlap`, the
        search's choice or the user's), the stack runs it for the layout (`tp_overlap_applies`), and combined 1F1B
        does not rule it out on this device (`tp_overlap_blocked_by_a2a`)."""
        return layout.tp_comm_overlap and self.tp_overlap_choice(layout, device)

    def tp_overlap_applies(self, layout) -> bool:
        """The stack runs TP overlap and the layout has TP collectives it overlaps: tp > 1 with sequence
        parallelism (its rings gather and scatter the sequence-sharded activations: Megatron-Bridge's
        CommOverlapConfig turns it off otherwise)."""
        return self.tp_comm_overlap and layout.tp > 1 and layout.sp

    def tp_overlap_choice(self, layout, device) -> bool:
        """Whether the search runs TP overlap for this layout where the user leaves it open: wherever it applies
        and combined 1F1B does not rule it out (it only shortens the exposed TP collectives in the cost model,
        so on is never slower)."""
        return self.tp_overlap_applies(layout) and not (self.tp_overlap_blocked_by_a2a(layout.tp, device)
                                                        and self.hides_moe_a2a(layout))

    @staticmethod
    def tp_overlap_blocked_by_a2a(tp: int, device) -> bool:
        """Combined 1F1B rules TP overlap out at this tp on the device: where TE userbuffers' kernels must queue in
        issue order (`Device.tp_overlap_single_connection`, Hopper and earlier) TP overlap wants one CUDA
        connection and combined 1F1B several (`cuda_device_max_connections`; Megatron-Bridge's H100 recipes
        with combined 1F1B turn TP overlap off)."""
        return device.tp_overlap_single_connection and tp > 1

    def cuda_connections_for(self, layout, device) -> int | None:
        """`cuda_device_max_connections` of the layout as this stack runs it (combined 1F1B where it hides)."""
        return cuda_device_max_connections(device, layout.tp, layout.cp, layout.dp, layout.pp,
                                           layout.ep > 1 and layout.moe_dispatcher == "deepep", self.hides_moe_a2a(layout))

    def hides_moe_a2a(self, layout) -> bool:
        """MoE A2A overlap applies: the stack has it, the layout asks for it (the search chooses it, or
        `a2a_overlap=true`), experts spread, a schedule Megatron can pair, and no layer recomputed fully
        (Megatron-Core's TransformerConfig refuses the overlap beside full recomputation)."""
        fully = layout.recompute == "full" or "full" in (layout.layer_recompute or ())
        return self.moe_a2a_overlap and layout.moe_a2a_overlap and self.pairs_moe_a2a(layout) and not fully

    def dualpipev_hides(self, layout) -> bool:
        """DualPipeV's overlapped pairs hide this layout's MoE all-to-alls (experts spread, the stack's
        pairs run their passes together)."""
        return layout.dualpipev and self.dualpipev_hides_moe_a2a and layout.ep > 1

    def pairs_moe_a2a(self, layout) -> bool:
        """The layout is one where the stack's combined 1F1B can pair MoE passes (the search's choice); not with
        the allgather dispatcher, which Megatron-Core's TransformerConfig refuses beside it."""
        return self.pairs_moe_passes(layout.ep, layout.pairs_passes_across_micro_batches, layout.moe_dispatcher)

    def pairs_moe_passes(self, ep: int, passes_pair: bool, dispatcher: str) -> bool:
        """`pairs_moe_a2a` of a layout with expert degree `ep` and this dispatcher whose schedule pairs passes
        or not."""
        return self.moe_a2a_overlap and dispatcher in A2A_OVERLAP_DISPATCHERS and ep > 1 and passes_pair

    def flex_dispatcher_sms(self, device) -> int | None:
        """SMs the flex (DeepEP-style) dispatcher's kernels hold on `device`: its backend's, HybridEP's or DeepEP's;
        None where the device runs neither."""
        backend = device.flex_dispatcher_backend
        if backend is None:
            return None
        return (self.hybridep_sms or self.deepep_sms) if backend == "hybridep" else self.deepep_sms

    def dispatchers_on(self, device) -> tuple[str, ...]:
        """The dispatchers it runs on `device`: DeepEP's only where the device profile runs its kernels (DeepEP's
        or HybridEP's) and they leave SMs to compute."""
        held = self.flex_dispatcher_sms(device)
        deepep = held is not None and (device.sm_count is None or held < device.sm_count)
        return tuple(d for d in self.moe_dispatchers if d != "deepep" or deepep)


def cuda_device_max_connections(device, tp: int, cp: int, dp: int, pp: int, deepep: bool,
                                a2a_overlap: bool) -> int | None:
    """CUDA_DEVICE_MAX_CONNECTIONS for a layout on an NVIDIA device, as Megatron-Bridge's performance launcher sets
    it (recipes/run_plugins.py PerfEnvPlugin._set_num_cuda_device_max_connections, 0.3): 8, 32 with a DeepEP-style
    dispatcher; where tp or cp > 1, 32 on Blackwell beside dp or pp > 1, and 1 on Hopper and earlier without
    combined 1F1B (a communication kernel then queues before the GEMM it overlaps). None off NVIDIA."""
    if device.vendor != "nvidia":
        return None
    connections = 32 if deepep else 8
    if tp > 1 or cp > 1:
        if not device.tp_overlap_single_connection and (dp > 1 or pp > 1):
            connections = 32
        elif device.tp_overlap_single_connection and not a2a_overlap:
            connections = 1
    return connections
