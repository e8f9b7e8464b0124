"""A Hugging Face config.json built as the real transformers class, on meta, where transformers is installed.

transformers is an optional extra: without it a config.json is built as the reference decoder
(reference_model.py), whose numbers the tests hold to the transformers classes' (tests/test_capture_hf.py).
"""
from __future__ import annotations

import importlib.util
import json
import logging

import torch
from torch import nn

from hardware_profiles.errors import UserInputError

from .model_config import ModelConfig

ACTIVATION_DTYPE = torch.bfloat16


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def build_transformers_model(cfg: ModelConfig) -> nn.Module | None:
    """The transformers class for `cfg.hf_config`, weightless; None where transformers is not installed or
    does not know the model type (the reference decoder stands in)."""
    if not cfg.hf_config or not transformers_available() or eager_only_class(cfg):
        return None
    # the stack runs no fused attention (or the model cannot: softcapping): transformers' eager attention
    return transformers_model(json.loads(cfg.hf_config), "eager" if cfg.attention_impl == "math" else None, cfg.name)


def eager_only_class(cfg: ModelConfig) -> str | None:
    """The transformers class's name where it runs attention only eagerly (no SDPA: GPT-OSS's sinks) and the
    stack fuses it: recording that class would bill the eager scores, so the reference decoder stands in."""
    if not cfg.hf_config or cfg.attention_impl != "flash" or not transformers_available():
        return None
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    model_type = json.loads(cfg.hf_config).get("model_type")
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]
    except KeyError:
        return None
    return None if getattr(model_class, "_supports_sdpa", True) else model_class.__name__


def transformers_model(raw: dict, attn_implementation: str | None = None, name: str = "the model") -> nn.Module | None:
    """`AutoModelForCausalLM.from_config` on meta for a config.json's contents (bf16); None for a model type
    transformers does not know. What transformers refuses is one UserInputError naming config.json."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "_name_or_path")}
    try:
        config_class = CONFIG_MAPPING[raw["model_type"]]
    except KeyError:
        return None
    try:
        config = config_class(**fields)
    except Exception as exc:   # transformers validates its config fields (huggingface_hub strict dataclasses)
        raise UserInputError(f"transformers' {config_class.__name__} refuses it: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}", field="config.json",
                             expected="the fields and types transformers' config class for this model_type takes"
                             ) from None
    kwargs = {"dtype": ACTIVATION_DTYPE}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)   # config sanity warnings (token ids outside a resized vocabulary) are not ours
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as exc:
        raise UserInputError(f"transformers could not build {name} from its config: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}", field="config.json",
                             expected="a config.json that transformers' AutoModelForCausalLM.from_config accepts"
                             ) from None
    finally:
        quiet.setLevel(level)
