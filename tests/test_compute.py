"""GEMM time against the roofline written out here: max(work / sustained peak, bytes / sustained HBM)."""
import pytest

from cost_models.compute import ShardSpec, op_seconds
from cost_models.records import OpCost, OpKind, Sharding
from hardware_profiles import cluster_from_device

H100 = cluster_from_device("h100-sxm", 8).device
HBM_BYTES_PER_S = 3350e9 * 0.90                    # h100-sxm.yaml: 3.35 TB/s x 0.90
BF16_FLOPS = 989.4e12 * 0.803 * H100.gemm.sustained_fraction


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
    assert forward == pytest.approx(op.forward_flops / BF16_FLOPS, rel=1e-9)


@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (1, 8, 1), (2, 8, 2)])
def test_expert_weights_are_read_by_the_ranks_that_hold_them(tp, ep, etp):
    # 64 experts with 4 tokens each per micro-batch: a rank reads the weights of 64 / ep experts, 1/etp of
    # each, and its 1/tp share of the tokens
    op, weights, activations = gemm(4, 4096, 1024, Sharding.expert, count=64)
    forward, _, _ = op_seconds(op, H100, ShardSpec(tp=tp, ep=ep, etp=etp))
    assert forward == pytest.approx((weights / (ep * etp) + activations / tp) / HBM_BYTES_PER_S, rel=1e-9)
