"""Sliding-window attention: capture reads each layer's window from its modules (transformers' Gemma 3, Qwen2,
Mistral, Phi-3), bills a windowed layer's attention for the keys each query sees, and keeps windowed and
full layers apart. Checked against the masks transformers' real Gemma 3 layers attend through on CPU."""
from __future__ import annotations

import pytest
import torch
import transformers

from hardware_profiles.loader import load_stack
from planner.api import capture_for
from planner.capture.graph_analysis import block_window

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
