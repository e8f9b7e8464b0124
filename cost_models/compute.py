"""Compute time of ops and layers on a device for a given sharding.

GEMMs run at flops / (peak(dtype) * efficiency(work)) with the saturating efficiency curve and kernel
floor from the device profile, and never faster than their weights and activations move through HBM;
memory-bound ops at bytes / (HBM bandwidth * fraction). FP8 GEMMs add the casts of their operands
(memory-bound) and leave the embedding and output layers in bf16; a fused attention's backward
recomputes its scores. Backward and recomputation reuse the same rules.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hardware_profiles.schema import Device

from .communication import ACTIVATION_BYTES
from .layout import MODULE_INDEX, Fp8Recipe, Precision, RecomputeModule
from .records import ATTENTION_CORE, ATTENTION_MATMUL_KINDS, LayerKind, OpCost, OpKind, Sharding

if TYPE_CHECKING:
    from hardware_profiles.stack import SoftwareStack

    from .layout import Layout

# bytes moved per element of every FP8 GEMM operand cast (input forward, output gradient backward) by
# Transformer Engine, whose FP8 GEMMs take one operand layout only: read bf16 (2), write row- and column-wise
# FP8 copies (1 + 1); tensorwise (current) scaling first reads the tensor for its amax (2), delayed scaling
# takes the amax from history inside the cast (TE docs, FP8 recipes; Micikevicius et al. 2022); block scalings
# take each block's amax inside the cast and write a scale per block with each copy: MXFP8 one E8M0 byte per
# 32 elements (OCP MX spec v1.0), blockwise an fp32 scale per 128-element tile (DeepSeek-V3 report 3.3.1)
FP8_CAST_BYTES = {Fp8Recipe.delayed: 4.0, Fp8Recipe.tensorwise: 6.0, Fp8Recipe.mxfp8: 4.0 + 2 * 1 / 32,
                  Fp8Recipe.blockwise: 4.0 + 2 * 4 / 128}
# per-tensor scalings on a device whose FP8 GEMMs take any layout (`Device.fp8_any_layout`) write no
# column-wise copy (Transformer Engine skips the transpose there); block scalings still do, their scales
# running along the other dimension
PER_TENSOR_RECIPES = (Fp8Recipe.delayed, Fp8Recipe.tensorwise)

# a fused flash backward recomputes q k^T: 5 matmuls where an unfused backward has 4 (Dao 2023: backward =
# 2.5 x forward FLOPs); measured on an H200 it takes 3.0-3.6 x the forward (docs/gpu-validation.md)
FLASH_BACKWARD_RECOMPUTE = 1.25


@dataclass(frozen=True)
class ShardSpec:
    """How one micro-batch of one layer is divided on a rank."""
    tp: int = 1
    sequence_sharded: bool = False   # activations between TP pairs split over tp (sequence parallelism in effect)
    cp: int = 1
    micro_batch: int = 1
    precision: Precision = Precision.bf16
    fp8_recipe: Fp8Recipe = Fp8Recipe.delayed
    causal_attention_work: float = 0.5
    ep: int = 1     # a rank runs 1/ep of the experts on tokens from ep ranks: its expert GEMMs are ep x larger
    etp: int = 1    # ranks splitting each expert's weights
    sort_copies: int = 0   # copies of the routed tokens the dispatcher adds (SoftwareStack.moe_sort_copies)
    gathered_ranks: int = 1   # the all-gather dispatcher's expert tp x ep group, whose tokens its buffers hold
    # the routed tokens the most loaded expert-parallel rank takes over the mean (`rank_load`): the all-to-all
    # waits for it, so its expert GEMMs and sorts set the layer's time
    expert_load: float = 1.0

    @classmethod
    def of(cls, layout: "Layout", stack: "SoftwareStack", ep: int | None = None, etp: int | None = None,
           ep_imbalance: float = 1.0) -> "ShardSpec":
        """A layout's division of one micro-batch; `ep`/`etp` override the layout's (search bounds)."""
        ep = layout.ep if ep is None else ep
        return cls(tp=layout.tp, sequence_sharded=layout.sp, cp=layout.cp, micro_batch=layout.micro_batch,
                   precision=layout.precision, fp8_recipe=layout.fp8_recipe,
                   causal_attention_work=stack.causal_attention_work,
                   ep=ep, etp=layout.etp if etp is None else etp,
                   sort_copies=stack.moe_sort_copies if layout.moe_dispatcher == "alltoall" else 0,
                   gathered_ranks=ep * (layout.etp if etp is None else etp)
                   if layout.moe_dispatcher == "allgather" and ep > 1 else 1,
                   expert_load=rank_load(ep_imbalance, ep))


def rank_load(ep_imbalance: float, ep: int) -> float:
    """The most loaded expert-parallel rank's routed tokens over the mean, for a run whose most loaded rank
    takes `ep_imbalance` x the mean: at most ep (every token on one rank), and none without ranks to differ."""
    return min(ep_imbalance, ep) if ep > 1 else 1.0


@dataclass(frozen=True)
class SharedExpertSeconds:
    """A MoE layer's shared experts: their up-projection (and gate) and down-projection, each pass."""
    up_forward_s: float = 0.0
    up_backward_s: float = 0.0
    down_forward_s: float = 0.0
    down_backward_s: float = 0.0


@dataclass(frozen=True)
class LayerCompute:
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    attention_core_forward_s: float   # what context parallelism's exchange can hide behind
    module_forward_s: tuple[float, ...]   # forward of each recomputable module, in RecomputeModule order
    # of the above, the routed experts and the dispatcher's sorts (forward, backward-input, backward-weight):
    # what Megatron's combined 1F1B runs between dispatch and combine (cost_models/paired_passes.py)
    experts_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # the shared experts inside a MoE layer's expert container (what --moe-shared-expert-overlap moves beside
    # the all-to-alls): its GEMMs sharded over tp
    shared_experts: SharedExpertSeconds = SharedExpertSeconds()
    # the forward before the first routed op (the attention, the router): where a dispatcher's host sync falls
    before_dispatch_forward_s: float = 0.0

    def selective_forward_s(self, modules: tuple[RecomputeModule, ...]) -> float:
        """What selective recomputation of `modules` repeats: their forward."""
        return sum(self.module_forward_s[MODULE_INDEX[m]] for m in modules)

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


def work_divisor(sharding: Sharding, spec: ShardSpec) -> int:
    """Ranks sharing an op's work: tp for pair ops and experts (tokens spread), tp with SP elsewhere; cp always."""
    tp_share = spec.tp if sharding in (Sharding.tensor, Sharding.expert) or spec.sequence_sharded else 1
    return tp_share * spec.cp


def gemm_efficiency(device: Device, gemm_flops: float, precision: str, fp8_recipe: Fp8Recipe | None = None
                    ) -> float:
    # saturating curve: peak_fraction * W / (W + W_half) (profile parameters, calibrated on MAMF tables)
    gemm = device.gemm
    fraction, half = gemm.peak_fraction, gemm.half_work_gflop * 1e9
    if precision == "fp8" and gemm.fp8_peak_fraction:
        fraction = gemm.fp8_peak_fraction
    if precision == "fp8" and fp8_recipe == Fp8Recipe.mxfp8 and gemm.mxfp8_peak_fraction:
        fraction = gemm.mxfp8_peak_fraction
    if precision == "fp8" and gemm.fp8_half_work_gflop is not None:
        half = gemm.fp8_half_work_gflop * 1e9
    fraction *= gemm.sustained_fraction
    return fraction * gemm_flops / (gemm_flops + half) if half else fraction


def gemm_seconds(device: Device, flops: float, count: int, precision: str, fp8_recipe: Fp8Recipe | None = None
                 ) -> float:
    if flops <= 0:
        return 0.0
    dtype = precision if precision == "fp8" and device.peak_tflops.fp8 else "bf16"
    peak = device.peak_flops(dtype)
    per_gemm = flops / max(1, count)
    seconds = flops / (peak * gemm_efficiency(device, per_gemm, dtype, fp8_recipe))
    return max(seconds, device.gemm.kernel_floor_us * 1e-6)


def memory_seconds(device: Device, nbytes: float) -> float:
    return nbytes / (device.hbm_bandwidth_gbytes_per_s * 1e9 * device.hbm_bandwidth_fraction)


def gemm_traffic_seconds(op: OpCost, device: Device, spec: ShardSpec, scale: float) -> float:
    """Roofline floor of one pass of a GEMM op (Williams et al. 2009): its weights, read whatever the
    batch, plus its share of activations; skinny GEMMs (few tokens per expert) are bound by it."""
    weight_divisor = {Sharding.tensor: spec.tp, Sharding.expert: spec.ep * spec.etp}.get(op.sharding, 1)
    activations = (op.bytes_accessed - op.weight_bytes) * scale
    return memory_seconds(device, op.weight_bytes / weight_divisor + activations)


def product_check_seconds(kind: LayerKind, device: Device, spec: ShardSpec) -> float:
    """What checking one micro-batch's matrix products of a layer by their checksums adds (runtime/gemm_check.py):
    each of a GEMM's three passes has its operands and result read once more, its traffic's roofline floor."""
    total = 0.0
    for op in kind.ops:
        if op.kind is OpKind.gemm:
            scale = spec.micro_batch / work_divisor(op.sharding, spec) * (spec.expert_load if op.routed else 1.0)
            total += 3 * gemm_traffic_seconds(op, device, spec, scale)
    return total


def fp8_cast_seconds(op: OpCost, device: Device, spec: ShardSpec, scale: float) -> tuple[float, float]:
    """(forward, backward) time of casting a GEMM op's input and output gradient to FP8, in kernels of
    their own beside the FP8 GEMMs; zero where the GEMMs run in bf16."""
    if spec.precision != "fp8" or not device.peak_tflops.fp8:
        return 0.0, 0.0
    tokens, n_out, n_in = op.gemm_mnk
    elements = tokens * op.gemm_count * scale
    per_element = FP8_CAST_BYTES[spec.fp8_recipe] - (
        1.0 if device.fp8_any_layout and spec.fp8_recipe in PER_TENSOR_RECIPES else 0.0)
    return (memory_seconds(device, per_element * elements * n_in),
            memory_seconds(device, per_element * elements * n_out))


def op_seconds(op: OpCost, device: Device, spec: ShardSpec) -> tuple[float, float, float]:
    """(forward, backward-input, backward-weight) seconds of one op for one micro-batch."""
    scale = spec.micro_batch / work_divisor(op.sharding, spec)
    if op.routed:   # the busiest rank's share of the routed tokens
        scale *= spec.expert_load
    if op.kind is OpKind.gemm:
        count = max(1, op.gemm_count // spec.ep) if op.sharding is Sharding.expert else op.gemm_count
        traffic = gemm_traffic_seconds(op, device, spec, scale)  # each pass moves about the same bytes
        forward, backward_input, backward_weight = (
            max(traffic, gemm_seconds(device, flops * scale, count, spec.precision, spec.fp8_recipe))
            for flops in (op.forward_flops, op.backward_input_flops, op.backward_weight_flops))
        cast_forward, cast_backward = fp8_cast_seconds(op, device, spec, scale)
        return forward + cast_forward, backward_input + cast_backward, backward_weight
    if op.kind in ATTENTION_MATMUL_KINDS:  # both operands activations; a fused kernel skips masked blocks
        fused = op.kind is OpKind.attention
        causal = op.causal_work if op.causal_work is not None else spec.causal_attention_work
        work = scale * (causal if fused else 1.0)
        backward_work = work * (FLASH_BACKWARD_RECOMPUTE if fused else 1.0)
        return (gemm_seconds(device, op.forward_flops * work, op.gemm_count, "bf16"),
                gemm_seconds(device, op.backward_input_flops * backward_work, op.gemm_count, "bf16"), 0.0)
    if op.kind is OpKind.token_copy:   # the dispatcher's sorts by local expert, where a rank has more than one
        copies = spec.sort_copies if op.gemm_count // spec.ep > 1 else 0   # gemm_count: the experts
        seconds = copies * memory_seconds(device, op.bytes_accessed * scale)
        return seconds, seconds, 0.0   # a copy's backward is the reverse copy
    # memory-bound: forward moves its bytes once; backward reads the gradient and input, writes one
    forward = memory_seconds(device, op.bytes_accessed * scale)
    return forward, 2 * forward, 0.0


def gathered_tokens(kind: LayerKind, spec: ShardSpec) -> float:
    """Tokens of one micro-batch of a MoE layer in the all-gather dispatcher's buffers on a rank: the rank's own
    (split by cp, and by tp under SP) from each rank of its expert tp x ep group."""
    return spec.gathered_ranks * kind.tokens * spec.micro_batch / work_divisor(Sharding.sequence, spec)


def gathered_buffer_seconds(kind: LayerKind, device: Device, spec: ShardSpec) -> float:
    """One pass's writes of the all-gather dispatcher's gathered shape beyond the rank's own tokens: forward its
    combine unpermutes the experts' outputs into all the group's token rows for the reduce-scatter, backward the
    permutation's gradient scatters into as many (Megatron-Core token_dispatcher.py, MoEAllGatherTokenDispatcher
    combine_preprocess: unpermute(..., restore_shape=hidden_shape_before_permute))."""
    beyond = gathered_tokens(kind, spec) * (1 - 1 / spec.gathered_ranks)
    return memory_seconds(device, beyond * kind.hidden_size * ACTIVATION_BYTES)


def layer_compute(kind: LayerKind, device: Device, spec: ShardSpec) -> LayerCompute:
    if kind.role != "block":  # Megatron keeps the embedding and output layers in bf16 under FP8 (as memory.py)
        spec = replace(spec, precision=Precision.bf16)
    forward = backward_input = backward_weight = attention = 0.0
    by_module = [0.0] * len(RecomputeModule)
    experts = [0.0, 0.0, 0.0]
    shared_up, shared_down = [0.0, 0.0], [0.0, 0.0]   # a shared projection's forward, backward
    before_dispatch = 0.0
    for index, op in enumerate(kind.ops):
        f, bi, bw = op_seconds(op, device, spec)
        if index < kind.dispatch_index:
            before_dispatch += f
        forward += f
        backward_input += bi
        backward_weight += bw
        if op.sharding is Sharding.expert or op.kind is OpKind.token_copy:
            experts = [experts[0] + f, experts[1] + bi, experts[2] + bw]
        elif op.module is RecomputeModule.moe and op.kind is OpKind.gemm and op.sharding is Sharding.tensor:
            side = shared_down if op.gemm_mnk[1] == kind.hidden_size else shared_up   # (tokens, out, in)
            side[0] += f
            side[1] += bi + bw
        if op.kind in ATTENTION_CORE:
            attention += f
        if op.module is not None:
            by_module[MODULE_INDEX[op.module]] += f
        if op.inner_module is not None:   # repeated by its own recomputation too (moe_act inside moe)
            by_module[MODULE_INDEX[op.inner_module]] += f
    if kind.num_experts and spec.gathered_ranks > 1:
        gathered = gathered_buffer_seconds(kind, device, spec)
        forward, backward_input = forward + gathered, backward_input + gathered
        experts = [experts[0] + gathered, experts[1] + gathered, experts[2]]
    return LayerCompute(forward, backward_input, backward_weight, attention, tuple(by_module), tuple(experts),
                        SharedExpertSeconds(up_forward_s=shared_up[0], up_backward_s=shared_up[1],
                                            down_forward_s=shared_down[0], down_backward_s=shared_down[1]),
                        before_dispatch)
