"""Expert load imbalance (--ep-imbalance): the busiest expert-parallel rank takes more than the mean of the
routed tokens, and the all-to-all waits for it. Checked against what transformers' real expert modules keep on
CPU, the token count the routed GEMMs see, and the refusals of impossible values."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import planner
from cost_models.compute import ShardSpec, layer_compute, rank_load
from cost_models.layout import Recompute
from cost_models.memory import activation_bytes
from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import load_device, load_stack

SEQ = 32
TOPK = 2   # the tiny transformers models' experts per token
MOE_LAYOUT = "tp=1,pp=1,dp=8,cp=1,ep=8,etp=1,vp=1,mbs=1,zero=1,recompute=none"
COMMON = dict(device="h100-sxm", num_devices=8, global_batch=16, seq_len=4096)


def _routed_bytes_kept_by_real_experts(factory: str) -> float:
    """Bytes transformers' expert module keeps for backward in tensors of the SEQ x TOPK routed rows, run on CPU
    in bf16 on SEQ tokens with the model's real routing (its experts implementation sorts the routed rows by
    expert and runs them together, whatever each expert got)."""
    import models.hf_tiny as hf_tiny

    torch.manual_seed(0)
    layer = getattr(hf_tiny, factory)().to(torch.bfloat16).model.model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.dim() > 0 and t.shape[0] == SEQ * TOPK:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hidden = torch.randn(SEQ, layer.mlp.gate.weight.shape[1], dtype=torch.bfloat16, requires_grad=True)
    _, weights, chosen = layer.mlp.gate(hidden)
    with saved_tensors_hooks(pack, lambda t: t):
        layer.mlp.experts(hidden, chosen, weights)
    return float(sum(seen.values()))


@pytest.mark.parametrize("factory", ["mixtral_logits", "qwen3_moe_logits"])
def test_the_busiest_rank_keeps_its_share_of_the_routed_activations(factory):
    """At load L the busiest rank keeps (L - 1) x more of what the routed experts keep. The truth: what
    transformers' own expert module keeps of its routed rows on CPU. The model leaves out the routing weights
    and token indices (10-12 bytes per routed row, against 2 x (h + 3f) of activations), which indexing nodes
    beside the expert GEMMs make: its figure sits within 5% below (2-3% measured)."""
    from planner.job import capture_for

    own_code = load_stack("megatron-core").model_copy(update={"fused_kernels": False, "fused_gated_activation": False})
    graph = capture_for(f"tests/models/hf_tiny.py:{factory}", SEQ, (), own_code)
    kind = graph.kind(graph.blocks[0].kind)
    balanced = activation_bytes(kind, Recompute.none, 1, False, 1, 1)
    for load in (1.5, 2.0):
        extra = activation_bytes(kind, Recompute.none, 1, False, 1, 1, expert_load=load) - balanced
        truth = (load - 1) * _routed_bytes_kept_by_real_experts(factory)
        assert 0.95 * truth <= extra <= truth


def test_the_routed_gemms_of_the_busiest_rank_see_its_tokens():
    """The busiest rank's expert GEMMs and sorts at load L run on L x the mean of the routed tokens: the time a
    balanced rank takes for an L x longer micro-batch (the routed work scales with tokens alone); what is not
    routed (attention, router) stays as it was."""
    from planner.graph_capture.model_capture import capture

    kind = next(k for k, _ in capture("mixtral-8x7b", 4096).costs_record.block_counts if k.num_experts)
    device = load_device("h100-sxm")
    base = ShardSpec(ep=8, micro_batch=1, sort_copies=2)
    loaded = layer_compute(kind, device, replace(base, expert_load=2.0))
    doubled = layer_compute(kind, device, replace(base, micro_batch=2))
    balanced = layer_compute(kind, device, base)
    assert loaded.experts_s == pytest.approx(doubled.experts_s, rel=1e-12)
    assert loaded.attention_core_forward_s == balanced.attention_core_forward_s
    assert loaded.forward_s - balanced.forward_s == pytest.approx(loaded.experts_s[0] - balanced.experts_s[0])


def test_rank_load_is_bounded_by_the_expert_parallel_degree():
    """Every routed token on one rank is ep x the mean; at ep = 1 every rank runs every expert on its own
    tokens, so no rank can take more than another."""
    assert rank_load(3.0, 2) == 2
    assert rank_load(1.3, 8) == 1.3
    assert rank_load(4.0, 1) == 1.0


def test_a_plan_says_what_it_assumed_of_the_routing_and_pays_for_imbalance():
    balanced = planner.evaluate("mixtral-8x7b", layout=MOE_LAYOUT, **COMMON)
    skewed = planner.evaluate("mixtral-8x7b", layout=MOE_LAYOUT, ep_imbalance=1.5, **COMMON)
    assert any("routing assumed balanced" in reason for reason in balanced.reasons)
    assert any("1.5 x the mean of the routed tokens" in reason for reason in skewed.reasons)
    assert skewed.ep_imbalance == 1.5
    assert skewed.breakdown["compute_s"] > balanced.breakdown["compute_s"]
    # the all-to-all's bandwidth term takes the busiest rank's bytes, its latency stays (test_communication)
    assert balanced.breakdown["ep_comm_s"] < skewed.breakdown["ep_comm_s"] < 1.5 * balanced.breakdown["ep_comm_s"]
    assert skewed.peak_memory_bytes > balanced.peak_memory_bytes
    dense = planner.evaluate("llama3-8b", layout=MOE_LAYOUT.replace("ep=8", "ep=1"), **COMMON)
    assert not any("rout" in reason for reason in dense.reasons)


@pytest.mark.parametrize("value", [0.5, float("nan"), float("inf"), True, "2"])
def test_an_impossible_imbalance_is_refused(value):
    with pytest.raises(UserInputError, match="--ep-imbalance"):
        planner.evaluate("mixtral-8x7b", layout=MOE_LAYOUT, ep_imbalance=value, **COMMON)
