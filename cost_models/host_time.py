"""Host time: the CPU issuing a layer's kernels, which the device waits for where it takes longer.

The host runs ahead of the device and queues its kernels; a pass takes the longer of the device's work and
the host's issuing of it (where the host is slower the device idles between kernels: the GB200 case of
Transformer Engine issue 2053, a 7B model's Linear as slow on the CPU as on the GPU). The host's time is a
count of calls, each weighed in the stack's units (`SoftwareStack.host_calls`: a GEMM module's forward and
backward in BF16 or FP8, any other op) times the node's CPU time per unit (`Device.host_call_us`, one
torch.nn.Linear forward). Where the MoE dispatcher copies token counts to the host (`moe_dispatch_host_sync`),
the host cannot queue past that point: the forward is two stretches, each the longer of its host and device
times. CUDA graphs (`cuda_graphs`) replay whole layers, or each layer's attention and router
(`cuda_graph_scope`), whose calls are then not billed. Not modelled: the sync's own latency, a graph replay's
own call, the optimizer step's launches, and recomputation's calls.
"""
from __future__ import annotations

from dataclasses import dataclass

from hardware_profiles.schema import Device
from hardware_profiles.stack import SoftwareStack

from .compute import LayerCompute, ShardSpec
from .layout import Precision, RecomputeModule
from .records import LayerKind, OpCost, OpKind, Sharding

US = 1e-6


@dataclass(frozen=True)
class HostSeconds:
    """The host's time to issue one layer's forward and backward for one micro-batch."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    # of forward_s, up to the dispatcher's host sync (before the first routed op); None: no sync in this layer
    before_sync_s: float | None = None


def host_excess_seconds(host: HostSeconds, compute: LayerCompute) -> float:
    """What the device waits for the host in one layer's forward and backward: each stretch the host issues
    without a sync takes the longer of its host and device times (the host runs ahead within it)."""
    backward = max(0.0, host.backward_s - compute.backward_s)
    if host.before_sync_s is None:
        return max(0.0, host.forward_s - compute.forward_s) + backward
    device_before = compute.before_dispatch_forward_s
    return (max(0.0, host.before_sync_s - device_before)
            + max(0.0, (host.forward_s - host.before_sync_s) - (compute.forward_s - device_before)) + backward)


def host_billed(device: Device, stack: SoftwareStack) -> bool:
    """Whether host time is billed: the node's CPU measured, the stack's calls stated, and not whole layers
    replayed as graphs."""
    whole_layers = stack.cuda_graphs and stack.cuda_graph_scope == "layers"
    return device.host_call_us is not None and stack.host_calls is not None and not whole_layers


def graphed_ops(kind: LayerKind, stack: SoftwareStack) -> int:
    """How many of the layer's first ops a partial CUDA graph scope replays: the attention and, in a MoE layer,
    the router and the dispatcher's preprocessing (up to the first routed op; in a dense layer up to its MLP)."""
    if not (stack.cuda_graphs and stack.cuda_graph_scope == "attention_and_router"):
        return 0
    mlp = next((i for i, op in enumerate(kind.ops) if op.module is RecomputeModule.mlp), len(kind.ops))
    end = min(kind.dispatch_index, mlp)
    return end if end < len(kind.ops) else 0


def layer_host_seconds(kind: LayerKind, device: Device, stack: SoftwareStack, spec: ShardSpec) -> HostSeconds:
    """The calls of one layer, forward and backward, in the stack's units, times the node's time per unit."""
    if not host_billed(device, stack):
        return HostSeconds()
    calls = stack.host_calls
    fp8 = spec.precision == Precision.fp8 and kind.role == "block"   # embedding and head stay in bf16 (compute.py)
    gemm = (calls.fp8_gemm_forward, calls.fp8_gemm_backward) if fp8 else (calls.gemm_forward, calls.gemm_backward)
    op = (calls.op_forward, calls.op_backward)
    forward = backward = before_sync = 0.0   # before_sync: the forward's units up to the dispatcher
    projected: set[str] = set()   # inputs a tensor-parallel projection has read
    replayed = graphed_ops(kind, stack)   # issued as graph replays: no host time billed
    for index, current in enumerate(kind.ops):
        units = _op_units(current, current.reads in projected, gemm, op, stack, spec) if index >= replayed else (0, 0)
        forward += units[0]
        backward += units[1]
        if index < kind.dispatch_index:
            before_sync += units[0]
        if current.kind is OpKind.gemm and current.sharding is Sharding.tensor and current.reads:
            projected.add(current.reads)
    unit_s = device.host_call_us * US
    syncs = kind.dispatch_index < len(kind.ops) and stack.syncs_host_at_dispatch(spec.ep)
    return HostSeconds(forward_s=forward * unit_s, backward_s=backward * unit_s,
                       before_sync_s=before_sync * unit_s if syncs else None)


def _op_units(current: OpCost, sibling: bool, gemm: tuple[float, float], op: tuple[float, float],
              stack: SoftwareStack, spec: ShardSpec) -> tuple[float, float]:
    """(forward, backward) units of one op: its GEMM calls, and the kernels its node launches beside them (each
    with one in backward), those inside routed expert modules only for the rank's own experts."""
    launches = current.launches + current.expert_launches / spec.ep   # a rank's loops run its own experts
    forward, backward = launches * op[0], launches * op[1]
    if current.kind is OpKind.gemm and current.sharding is Sharding.expert:
        local = max(1, current.gemm_count // spec.ep)
        if stack.grouped_experts:   # one call for the rank's experts, a little bookkeeping per further expert
            return forward + gemm[0] + (local - 1) * op[0], backward + gemm[1] + (local - 1) * op[1]
        return forward + local * gemm[0], backward + local * gemm[1]
    # a projection reading an input another already read is issued inside that one's call where the stack builds
    # them as one column-parallel GEMM (Megatron's linear_qkv for q, k and v; linear_fc1 for gate and up)
    if current.kind is OpKind.gemm and not (stack.fused_projections and sibling and current.sharding is Sharding.tensor):
        return forward + gemm[0], backward + gemm[1]
    if current.kind is OpKind.attention_matmul:   # an unfused q k^T or probs x v: one batched GEMM kernel, and
        return forward + op[0], backward + 2 * op[1]   # one per operand's gradient in backward
    if current.kind is OpKind.token_copy:   # the dispatcher's sorts, where a rank has more than one expert
        copies = spec.sort_copies if current.gemm_count // spec.ep > 1 else 0
        return forward + copies * op[0], backward + copies * op[1]
    return forward, backward
