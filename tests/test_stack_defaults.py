"""What a stack fills in for a model that leaves it out (dropout), against the framework's own defaults and
Korthikanti et al. 2022's activation memory."""
import dataclasses
import warnings

import pytest

from hardware_profiles.loader import list_stacks, load_stack
from planner import api
from planner.graph_capture.model_config import ModelConfig

MEGATRON_LM_DEFAULTS = ("megatron-lm-2021", "megatron-lm-2021-zero", "megatron-lm-2022", "megatron-deepspeed-2021")
S, H, A, T, B = 2048, 6144, 64, 8, 4   # Korthikanti 22B's width, tp 8, micro-batch 4


def gpt(layers: int, **stated) -> ModelConfig:
    return ModelConfig(name=f"korthikanti-22b-{layers}l", num_layers=layers, hidden_size=H, num_attention_heads=A,
                       ffn_hidden_size=4 * H, vocab_size=51200, seq_length=S, activation="gelu",
                       normalization="layernorm", position_embedding="learned", tied_embeddings=True,
                       attention="mha", add_bias=True, **stated)


def megatron_core_default_dropouts() -> set[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer import TransformerConfig
    return {f.default for f in dataclasses.fields(TransformerConfig) if f.name in ("hidden_dropout",
                                                                                     "attention_dropout")}


@pytest.mark.parametrize("name", MEGATRON_LM_DEFAULTS)
def test_megatron_lm_stacks_default_to_the_frameworks_dropout(name):
    # Megatron-LM's --hidden-dropout/--attention-dropout and Megatron-Core's TransformerConfig share the default
    assert megatron_core_default_dropouts() == {load_stack(name).model_dropout}


def test_stacks_whose_models_train_without_dropout_assume_none():
    assert {n for n in list_stacks() if load_stack(n).model_dropout} == set(MEGATRON_LM_DEFAULTS)


def _activations_per_layer(recompute: str, **stated) -> tuple[float, list[str]]:
    """One layer's activations: the difference of 6 and 2 layers over 4 (the embedding's and head's cancel)."""
    plans = [api.evaluate(gpt(layers, **stated), device="a100-80g", num_devices=T, layout={
        "tp": T, "pp": 1, "dp": 1, "mbs": B, "sp": True, "recompute": recompute, "zero": 0}, global_batch=B,
        seq_len=S, precision="bf16", stack="megatron-lm-2022") for layers in (2, 6)]
    return (plans[1].memory[0].parts["activations"] - plans[0].memory[0].parts["activations"]) / 4, plans[0].reasons


@pytest.mark.parametrize("recompute,per_sbh", [("none", 34 / T + 5 * A * S / (H * T)), ("selective", 34 / T)])
def test_an_unstated_dropout_is_billed_as_the_stack_runs_it(recompute, per_sbh):
    # Korthikanti et al. 2022 Table 2 with sequence parallelism: sbh (34/t + 5as/(ht)) per layer, the dropout
    # masks (sbh each after attention and the MLP, as^2b in attention) and the dropped probabilities included
    got, reasons = _activations_per_layer(recompute)
    assert got == pytest.approx(S * B * H * per_sbh, rel=0.03)
    assert any("dropout 0.1" in r and "stack's default assumed" in r for r in reasons)


@pytest.mark.parametrize("recompute,per_sbh", [("none", 32 / T + 2 * A * S / (H * T)), ("selective", 32 / T)])
def test_a_stated_dropout_of_zero_keeps_no_masks_and_says_nothing(recompute, per_sbh):
    # Table 2 less its dropout terms: two sbh masks, and as^2b + 2as^2b of the attention dropout
    got, reasons = _activations_per_layer(recompute, dropout=0.0)
    assert got == pytest.approx(S * B * H * per_sbh, rel=0.03)
    assert not any("dropout" in r for r in reasons)
