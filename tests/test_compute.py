"""GEMM time against the roofline written out here: max(work / sustained peak, bytes / sustained HBM), the
peak reached as W / (W + W_half) for a GEMM of W FLOPs."""
import pytest

from cost_models.compute import ShardSpec, op_seconds
from cost_models.records import OpCost, OpKind, Sharding
from hardware_profiles import cluster_from_device

H100 = cluster_from_device("h100-sxm", 8).device
HBM_BYTES_PER_S = 3350e9 * 0.90                    # h100-sxm.yaml: 3.35 TB/s x 0.90
BF16_FLOPS = 989.4e12 * 0.803 * H100.gemm.sustained_fraction


def saturation(work, half_gflop=H100.gemm.half_work_gflop):
    return work / (work + half_gflop * 1e9)


def gemm(tokens, n_in, n_out, sharding=Sharding.tensor, count=1):
    flops = 2.0 * tokens * n_in * n_out * count
    weights = 2.0 * n_in * n_out * count
    activations = 2.0 * tokens * (n_in + n_out) * count
    return OpCost("g", OpKind.gemm, sharding, flops, flops, flops, weights + activations,
                  (tokens, n_out, n_in), count, weights), weights, activations


def test_a_skinny_gemm_reads_its_weights():
    op, weights, activations = gemm(8, 8192, 8192)
    forward, backward_input, backward_weight = op_seconds(op, H100, ShardSpec())
    assert forward == pytest.approx((weights + activations) / HBM_BYTES_PER_S, rel=1e-9)
    assert backward_input == forward and backward_weight == forward


def test_a_square_gemm_is_compute_bound():
    op, _, _ = gemm(8192, 8192, 8192)
    forward, _, _ = op_seconds(op, H100, ShardSpec())
    assert forward == pytest.approx(op.forward_flops / (BF16_FLOPS * saturation(op.forward_flops)), rel=1e-9)


@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (1, 8, 1), (2, 8, 2)])
def test_expert_weights_are_read_by_the_ranks_that_hold_them(tp, ep, etp):
    # 64 experts with 4 tokens each per micro-batch: a rank reads the weights of 64 / ep experts, 1/etp of
    # each, and its 1/tp share of the tokens; its 64 / ep GEMMs, each ep x larger, run at least as long as
    # their saturation allows
    op, weights, activations = gemm(4, 8192, 8192, Sharding.expert, count=64)
    forward, _, _ = op_seconds(op, H100, ShardSpec(tp=tp, ep=ep, etp=etp))
    traffic = (weights / (ep * etp) + activations / tp) / HBM_BYTES_PER_S
    work, local_gemms = op.forward_flops / tp, 64 // ep
    compute = work / (BF16_FLOPS * saturation(work / local_gemms))
    assert forward == pytest.approx(max(traffic, compute), rel=1e-9)
    assert traffic > compute   # the weights, not the work, set the time


FP8_FLOPS = 1978.9e12 * 0.709 * H100.gemm.sustained_fraction   # h100-sxm.yaml: fp8 peak x fp8_peak_fraction


# block scalings write a scale per block with each of the two copies: MXFP8 one E8M0 byte per 32 elements
# (OCP Microscaling Formats spec v1.0), blockwise one fp32 per 128-element tile (DeepSeek-V3 report 3.3.1)
@pytest.mark.parametrize("recipe,bytes_per_element", [("delayed", 4), ("tensorwise", 6), ("mxfp8", 4 + 2 / 32),
                                                      ("blockwise", 4 + 2 * 4 / 128)])
def test_fp8_gemms_pay_for_casting_their_operands(recipe, bytes_per_element):
    # Transformer Engine on Hopper casts the input (forward) and the output gradient (backward) into row- and
    # column-wise FP8 copies: read 2 B, write 1 + 1 B; current (tensorwise) scaling reads once more for the amax
    tokens, n_in, n_out = 8192, 8192, 28672
    op, _, _ = gemm(tokens, n_in, n_out)
    forward, backward_input, backward_weight = op_seconds(op, H100, ShardSpec(precision="fp8", fp8_recipe=recipe))
    # FP8 GEMMs saturate on their own scale (measured on an H200: docs/gpu-validation.md)
    gemm_s = op.forward_flops / (FP8_FLOPS * saturation(op.forward_flops, H100.gemm.fp8_half_work_gflop))
    assert forward == pytest.approx(gemm_s + bytes_per_element * tokens * n_in / HBM_BYTES_PER_S, rel=1e-9)
    assert backward_input == pytest.approx(gemm_s + bytes_per_element * tokens * n_out / HBM_BYTES_PER_S, rel=1e-9)
    assert backward_weight == pytest.approx(gemm_s, rel=1e-9)   # reuses both copies


@pytest.mark.parametrize("recipe,bytes_per_element", [("delayed", 3), ("tensorwise", 5), ("mxfp8", 4 + 2 / 32)])
def test_blackwell_fp8_casts_skip_the_transposed_copy_only_for_per_tensor_scales(recipe, bytes_per_element):
    """On compute capability 10.x per-tensor FP8 GEMMs take any layout, so Transformer Engine writes no
    column-wise copy (utils.is_non_tn_fp8_gemm_supported); MXFP8's scales run along one dimension, so it still
    writes both. Its block-scaled GEMMs run at the profile's MXFP8 fraction, the others at the FP8 one."""
    b200 = cluster_from_device("b200", 8).device
    tokens, n_in, n_out = 8192, 8192, 28672
    op, _, _ = gemm(tokens, n_in, n_out)
    forward, _, backward_weight = op_seconds(op, b200, ShardSpec(precision="fp8", fp8_recipe=recipe))
    hbm = b200.hbm_bandwidth_gbytes_per_s * 1e9 * b200.hbm_bandwidth_fraction
    assert forward - backward_weight == pytest.approx(bytes_per_element * tokens * n_in / hbm, rel=1e-9)
    fraction = b200.gemm.mxfp8_peak_fraction if recipe == "mxfp8" else b200.gemm.fp8_peak_fraction
    half = b200.gemm.fp8_half_work_gflop * 1e9
    efficiency = fraction * b200.gemm.sustained_fraction * op.forward_flops / (op.forward_flops + half)
    assert backward_weight == pytest.approx(op.forward_flops / (b200.peak_flops("fp8") * efficiency), rel=1e-9)


def test_mxfp8_is_refused_where_the_tensor_cores_lack_it():
    """TE's support matrix lists MXFP8 on Blackwell data-center parts only: an H100 plan naming it exits 2."""
    from hardware_profiles import UserInputError
    from planner.api import evaluate
    with pytest.raises(UserInputError, match="mxfp8 on h100-sxm"):
        evaluate("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, precision="fp8",
                 layout="tp=1,pp=1,dp=8,cp=1,mbs=1,fp8_recipe=mxfp8")
    assert evaluate("llama3-8b", device="b200", num_devices=8, global_batch=64, precision="fp8",
                    layout="tp=1,pp=1,dp=8,cp=1,mbs=1,fp8_recipe=mxfp8").layout.fp8_recipe == "mxfp8"


def test_devices_without_fp8_ignore_the_recipe():
    a100 = cluster_from_device("a100-80g", 8).device
    op, _, _ = gemm(8192, 8192, 8192)
    assert op_seconds(op, a100, ShardSpec(precision="fp8", fp8_recipe="tensorwise")) == op_seconds(op, a100, ShardSpec())


def test_fp8_leaves_the_output_layer_in_bf16():
    # Megatron runs the embedding and output layers in bf16 under FP8 (the memory model keeps them bf16 too)
    from cost_models.compute import layer_compute
    from planner.graph_capture.model_capture import capture
    costs = capture("llama3-8b").costs_record
    fp8, bf16 = ShardSpec(precision="fp8"), ShardSpec()
    assert layer_compute(costs.head, H100, fp8) == layer_compute(costs.head, H100, bf16)
    block = next(kind for kind in costs.kinds if kind.role == "block")
    assert layer_compute(block, H100, fp8).forward_s < layer_compute(block, H100, bf16).forward_s


def test_flash_backward_recomputes_the_scores():
    # a fused (flash) backward recomputes q k^T: 2.5 x the forward FLOPs (Dao 2023); an unfused backward of
    # the same matmuls does 2 x (on a device whose GEMM efficiency does not depend on size: ratios are exact)
    a100 = cluster_from_device("a100-80g", 8).device
    flops = 2.0 * 32 * 4096 * 4096 * 256
    fused = OpCost("sdpa", OpKind.attention, Sharding.tensor, flops, 2 * flops, 0.0, 0.0, None)
    unfused = OpCost("qk", OpKind.attention_matmul, Sharding.tensor, flops, 2 * flops, 0.0, 0.0, (4096, 4096, 128), 32)
    forward, backward, _ = op_seconds(fused, a100, ShardSpec())
    assert backward == pytest.approx(2.5 * forward, rel=1e-9)
    forward, backward, _ = op_seconds(unfused, a100, ShardSpec())
    assert backward == pytest.approx(2.0 * forward, rel=1e-9)


def test_the_dispatchers_sorts_cost_their_bytes_where_a_rank_holds_several_experts():
    """A stack's sorts by local expert (`moe_sort_copies`) each move the routed copy once forward and once
    back (the reverse copy): bytes over the profile's sustained HBM bandwidth; nothing where each rank holds
    one expert (Megatron-Core sorts only with more than one local expert) or the stack makes none."""
    device = cluster_from_device("h100-sxm", 8).device
    nbytes = 2.0 * 4096 * 8 * 7168 * 2   # 4,096 tokens, top-8, h 7168, bf16, read and written
    copy = OpCost("moe.dispatcher_copy", OpKind.token_copy, Sharding.sequence, 0.0, 0.0, 0.0, nbytes, None, 256)
    bandwidth = device.hbm_bandwidth_gbytes_per_s * 1e9 * device.hbm_bandwidth_fraction
    assert op_seconds(copy, device, ShardSpec(ep=64, sort_copies=2)) == \
        pytest.approx((2 * nbytes / bandwidth, 2 * nbytes / bandwidth, 0.0))
    assert op_seconds(copy, device, ShardSpec(ep=256, sort_copies=2)) == (0.0, 0.0, 0.0)
    assert op_seconds(copy, device, ShardSpec(ep=64, sort_copies=0)) == (0.0, 0.0, 0.0)
