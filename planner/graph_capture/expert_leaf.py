"""What an expert container captured as one node (a leaf) makes inside it, told apart while it runs.

No graph names the ops inside such a leaf, so the tensors autograd saves there are attributed by what made
them (their grad_fn), their width and which child of the container is running (hooks on the router and the
shared experts): the routed experts' activation (Megatron-Core's moe_act recomputation discards it), what a
shared expert makes and keeps (its shared_experts recomputation), and act(gate) that a fused gated kernel
recomputes. Mixed into capture's graph interpreter (`tracing._Analyzer`), whose `modules`, `current` and
`env` it reads.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from cost_models.layout import RecomputeModule

from .graph_analysis import EXPERT_ACTIVATION_BACKWARDS, GATE_ACTIVATION_BACKWARDS, while_running
from .module_kinds import routed_experts, shared_children
from .op_costs import expert_down_width, experts_gated, storage_key


# what views and GEMMs leave on their outputs (autograd's node names)
VIEW_BACKWARDS = ("ViewBackward", "UnsafeViewBackward", "SliceBackward", "SelectBackward", "ReshapeAliasBackward",
                  "AsStridedBackward", "TransposeBackward", "PermuteBackward", "SqueezeBackward", "UnsqueezeBackward")
GEMM_BACKWARDS = ("MmBackward", "BmmBackward", "AddmmBackward", "BaddbmmBackward", "GroupedMmBackward")


class ExpertLeafAttribution:
    """Attribution of saved tensors inside an expert container run as one node."""
    # the container's children now running beside its routed experts (router, shared experts), each with
    # whether it is a shared expert and the storages it was given: `_beside_routed`
    beside_routed: list[tuple[bool, set[int]]]

    def _gated_in_experts(self, t: torch.Tensor) -> bool:
        """act(gate) that a fused gated kernel recomputes (`_Analyzer._recomputed_by_gated_kernel` where the
        graph shows the ops), inside an expert container run as one leaf: a tensor an activation made (its grad_fn an activation's backward) in gated experts, whose
        activation output only the gating multiply keeps (plain experts' is the down-projection's input)."""
        if t.grad_fn is None or not type(t.grad_fn).__name__.startswith(GATE_ACTIVATION_BACKWARDS):
            return False
        experts, hidden = self._running_experts()
        return experts is not None and experts_gated(experts.gemms, hidden)

    def _made_by_expert_activation(self, t: torch.Tensor) -> bool:
        """Inside an expert container run as one leaf: a tensor the experts' activation made (gating multiply
        included), as wide as the down-projection's input. What Megatron-Core's moe_act recomputation
        discards: it keeps the up-projection's output, the activation's input, and nothing made after it."""
        if t.grad_fn is None or t.dim() == 0 or not type(t.grad_fn).__name__.startswith(EXPERT_ACTIVATION_BACKWARDS):
            return False
        experts, hidden = self._running_experts()
        return experts is not None and not self.beside_routed and len(experts.gemms) > 1 \
            and t.shape[-1] == expert_down_width(experts.gemms, hidden)

    def _routed_output(self, t: torch.Tensor) -> bool:
        """Inside an expert container run as one leaf, while its routed experts run: a tensor as wide as the
        hidden state that a GEMM made (its grad_fn a matmul's once views are looked through), the experts'
        down-projection output, which only the multiply by the routing probabilities keeps."""
        if self.beside_routed or t.dim() == 0:
            return False
        experts, hidden = self._running_experts()
        if experts is None or t.shape[-1] != hidden:
            return False
        made = t.grad_fn
        while made is not None and type(made).__name__.startswith(VIEW_BACKWARDS) and made.next_functions:
            made = made.next_functions[0][0]
        return made is not None and type(made).__name__.startswith(GEMM_BACKWARDS)

    def _inner_module(self, t: torch.Tensor) -> RecomputeModule | None:
        """The module inside an expert container run as one leaf that made `t` and keeps it: the routed
        experts' activation (moe_act), or a shared expert saving what it made itself, not its input
        (shared_experts: Megatron-Core checkpoints its SharedExpertMLP, the input kept)."""
        if self.beside_routed:
            shared, inputs = self.beside_routed[-1]
            return RecomputeModule.shared_experts if shared and storage_key(t) not in inputs else None
        return RecomputeModule.moe_act if self._made_by_expert_activation(t) else None

    @contextlib.contextmanager
    def _beside_routed(self, container: nn.Module):
        """While an expert container runs as a leaf, note which of its children that hold no routed expert
        weights is running (router, shared experts, a shared expert's gate) and what it was given: what they
        make is not the routed experts' activation (moe_act), and what a shared expert makes is its own."""
        def enter_as(shared: bool):
            def enter(_, args):
                self.beside_routed.append((shared, {storage_key(a) for a in args if isinstance(a, torch.Tensor)}))
            return enter

        def leave(*_):
            self.beside_routed.pop()

        with while_running([(child, enter_as(shared)) for _, child, shared in shared_children(container)], leave):
            yield

    def _running_experts(self):
        """(the routed experts, the hidden size) of the expert container now running as a leaf; (None, 0)."""
        module = self.modules.get(self.current.target) if self.current.op == "call_module" else None
        experts = routed_experts(module) if module is not None else None
        tokens = self.env.get(self.current.args[0]) if experts is not None and self.current.args else None
        return (experts, tokens.shape[-1]) if isinstance(tokens, torch.Tensor) else (None, 0)
