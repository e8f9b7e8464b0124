"""Sliding-window attention: capture reads each layer's window from its modules (transformers' Gemma 3, Qwen2,
Mistral, Phi-3), bills a windowed layer's attention for the keys each query sees, and keeps windowed and
full layers apart. Checked against the masks transformers' real Gemma 3 layers attend through on CPU."""
from __future__ import annotations

import pytest
import torch
import transformers

from hardware_profiles.loader import load_stack
from planner.job import capture_for
from cost_models.records import OpKind
from planner.graph_capture.graph_analysis import block_window

SEQ, WINDOW, HEADS, HEAD_DIM = 32, 8, 4, 16


def _pairs_each_layer_attends() -> list[float]:
    """Query-key pairs per head that the real Gemma 3 layers' scaled_dot_product_attention calls let through
    (their masks, or the causal triangle where transformers passes none), run on CPU."""
    import models.hf_tiny as hf_tiny

    torch.manual_seed(0)
    model = hf_tiny.gemma3_logits()
    pairs, real_sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        s, s_kv = q.shape[-2], k.shape[-2]
        if attn_mask is None:
            allowed = torch.ones(s, s_kv).tril() if is_causal else torch.ones(s, s_kv)
        else:
            mask = attn_mask[0, 0]
            allowed = mask.float() if mask.dtype == torch.bool else (mask == 0).float()
        pairs.append(float(allowed.sum()))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            model(torch.randint(0, 256, (1, SEQ)))
    finally:
        torch.nn.functional.scaled_dot_product_attention = real_sdpa
    return pairs


def _attention_ops():
    graph = capture_for("tests/models/hf_tiny.py:gemma3_logits", SEQ, (), load_stack("torchtitan"))
    kinds = [graph.kind(slot.kind) for slot in graph.blocks]
    return [next(op for op in kind.ops if op.kind.value == "attention") for kind in kinds], graph


def test_a_sliding_layer_is_billed_for_the_pairs_its_mask_lets_through():
    """Gemma 3's first layer slides over 8 keys, its second attends to all: the windowed layer's counted FLOPs are
    2 h s w (d + d_v), and the share a causal kernel computes of them is exactly the pairs the real mask allows
    (w s - w (w - 1) / 2 = 228 per head); the full layer's is the stack's causal half (512 of the real 528)."""
    real = _pairs_each_layer_attends()
    (sliding, full), graph = _attention_ops()
    assert len(graph.costs_record.kinds) == 4   # embedding, the two layer kinds, head
    per_pair = 2 * HEADS * 2 * HEAD_DIM   # FLOPs of one query-key pair over the heads: q k and p v
    assert sliding.forward_flops == per_pair * SEQ * WINDOW
    assert sliding.forward_flops / per_pair * sliding.causal_work == pytest.approx(real[0], rel=1e-12)
    assert full.forward_flops == per_pair * SEQ * SEQ and full.causal_work is None
    causal_half = load_stack("torchtitan").causal_attention_work
    assert full.forward_flops / per_pair * causal_half == pytest.approx(real[1], rel=1 / SEQ)


def test_the_window_is_read_per_layer_or_from_the_config():
    """Gemma 3 and Qwen2 set the window on each attention module by its layer type (None on full layers);
    Mistral's modules read it from the config."""
    gemma = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                          sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    layers = transformers.Gemma3ForCausalLM(gemma).model.layers
    assert [block_window(layer) for layer in layers] == [8, 0]
    mistral = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256, sliding_window=16)
    assert block_window(transformers.MistralForCausalLM(mistral).model.layers[0]) == 16
    mistral.sliding_window = None
    assert block_window(transformers.MistralForCausalLM(mistral).model.layers[0]) == 0


@pytest.mark.parametrize("name,seq,costs", [("gemma3-12b", 2048, 2), ("gemma2-9b", 8192, 1)])
def test_the_config_path_windows_the_layers_the_transformers_class_windows(name, seq, costs):
    """A config.json read without transformers (the reference decoder) windows the same layers as the
    transformers class built from it (Gemma 3's every-sixth-layer-full pattern), and bills each layer's
    attention alike, past the window. Gemma 2 caps its scores (softcapping), so both run its attention
    unfused, computing every pair whatever the mask: one cost for all its layers."""
    from tests.test_capture_hf import hf_module, raw_config
    from planner.graph_capture.model_capture import capture
    from planner.graph_capture.model_sources import config_from_hf

    def attention_flops(graph):
        return [next(op.forward_flops for op in graph.kind(slot.kind).ops if op.kind.value.startswith("attention"))
                for slot in graph.blocks]

    module = capture(hf_module(name), seq_len=seq, fused_kernels=True)
    config = config_from_hf(raw_config(name), name).model_copy(update={"hf_config": None})
    reference = capture(config, seq_len=seq, fused_kernels=True)
    assert attention_flops(reference) == pytest.approx(attention_flops(module), rel=1e-9)
    assert len(set(attention_flops(reference))) == costs   # windowed and full layers, where the kernel skips


def test_the_reference_decoders_window_lets_each_query_see_its_last_w_keys():
    """The reference decoder's windowed attention (what the runtime trains) equals softmax over the keys j with
    i - w < j <= i, computed by hand, in both its fused and its math form."""
    from planner.graph_capture.model_config import ModelConfig
    from planner.graph_capture.reference_model import CoreAttention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, SEQ, HEAD_DIM) for _ in range(3))
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    scores = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
    want = torch.softmax(scores.masked_fill(~((j <= i) & (j > i - WINDOW)), float("-inf")), dim=-1) @ v
    for impl in ("flash", "math"):
        cfg = ModelConfig(num_layers=1, hidden_size=2 * HEAD_DIM, num_attention_heads=2, ffn_hidden_size=64,
                          vocab_size=64, seq_length=SEQ, attention_impl=impl, sliding_window=WINDOW)
        assert torch.allclose(CoreAttention(cfg, cfg.window_of(0))(q, k, v), want, atol=1e-5), impl


def test_the_runtime_stack_refuses_context_parallelism_of_sliding_layers():
    """The runtime's context parallelism gathers K and V for causal attention without a window: a model whose
    reference decoder slides is refused at cp > 1, by the one rule set the planner and the runtime share."""
    from hardware_profiles.errors import UserInputError
    import planner
    from planner.graph_capture.model_sources import resolve_model

    windowed = resolve_model("tiny-llama").model_copy(update={"sliding_window": 64})
    common = dict(device="h100-sxm", num_devices=2, devices_per_node=2, global_batch=2, seq_len=256,
                  stack="parallel-planner")
    with pytest.raises(UserInputError, match="slide"):
        planner.evaluate(windowed, layout="tp=1,pp=1,dp=1,cp=2,ep=1,vp=1,mbs=1,zero=0,recompute=none", **common)
    assert planner.evaluate(windowed, layout="tp=1,pp=1,dp=2,cp=1,ep=1,vp=1,mbs=1,zero=0,recompute=none",
                            **common).fits


TINY_GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "vocab_size": 256, "sliding_window": 8, "max_position_embeddings": 64}


@pytest.mark.parametrize("stack,stands_in", [("megatron-bridge", True), ("megatron-lm-2021", False)])
def test_gpt_oss_config_runs_attention_as_the_stack_does(stack, stands_in):
    """transformers' GptOssForCausalLM runs attention only eagerly (its sinks; no SDPA). Under a stack that fuses
    attention the config.json is captured as the reference decoder, which bills fused attention and says so;
    under one that does not (megatron-lm-2021: flash_attention false) the class itself is recorded. The parameters are
    the class's, less what the reference decoder does not build (the experts' biases, sinks and the router's
    bias: 0.03% of GPT-OSS 120B); windowed layers (the class's layer_types) are a kind apart under fused
    attention, and the class's eager scores are billed only where the stack runs them."""
    import transformers
    seq = 32
    graph = capture_for(dict(TINY_GPT_OSS), seq, (), load_stack(stack))
    config = transformers.GptOssConfig(**{k: v for k, v in TINY_GPT_OSS.items() if k != "model_type"})
    with torch.device("meta"):
        reference = sum(p.numel() for p in transformers.GptOssForCausalLM(config).parameters())
    # what the reference decoder leaves out: the experts' biases, each head's sink, the router's bias
    c = TINY_GPT_OSS
    unbuilt = c["num_hidden_layers"] * (c["num_local_experts"] * (2 * c["intermediate_size"] + c["hidden_size"])
                                        + c["num_attention_heads"] + c["num_local_experts"])
    assert graph.total_params == reference - (unbuilt if stands_in else 0)
    said = [n for n in graph.capture_notes if "GptOssForCausalLM runs attention only eagerly" in n]
    assert bool(said) == stands_in
    layers = [slot.kind for slot in graph.layers[1:-1]]
    kinds = [graph.kind(name) for name in layers]
    assert [any(op.kind is OpKind.attention_matmul for op in kind.ops) for kind in kinds] == [not stands_in] * 4
    if stands_in:   # windowed layers (layer_types' sliding ones) a kind apart, billed for fewer pairs
        sliding = [kind == "sliding_attention" for kind in config.layer_types]
        assert [layers[i] == layers[0] for i in range(4)] == [s == sliding[0] for s in sliding] and len(set(layers)) == 2
        work = {name: next(op.causal_work for op in graph.kind(name).ops if op.kind is OpKind.attention)
                for name in set(layers)}
        window = c["sliding_window"]   # of the w s pairs billed, those a causal window of w lets through
        assert work[layers[0]] == pytest.approx((window * seq - window * (window - 1) / 2) / (window * seq))
        assert work[layers[1]] is None   # full: the stack's causal share
    else:           # eager attention computes every pair whatever the window: the same FLOPs in every layer
        assert len({sum(op.forward_flops for op in kind.ops) for kind in kinds}) == 1
