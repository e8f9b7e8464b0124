"""Where a model comes from: a built-in name, a model YAML, a Hugging Face config.json, or a user module.

The first three give a `ModelConfig` that builds the reference decoder; the last gives any
`torch.nn.Module` from `path/to/file.py:factory`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from pydantic import ValidationError
from torch import nn

from hardware_profiles.errors import UserInputError, format_pydantic_error
from hardware_profiles.loader import read_small_text, read_yaml_mapping
from hardware_profiles.parsing import parse_json

from .model_config import MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_SEQ, MAX_VOCAB, MAX_WIDTH, ModelConfig
from .transformers_models import transformers_available, transformers_model

MODEL_DIR = Path(__file__).resolve().parents[1] / "models"
MODULE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class UserModule:
    """A user's module: a factory returning an nn.Module, with its source for messages."""
    name: str
    factory: Callable[[], nn.Module]
    source: str
    module: nn.Module | None = None   # an existing module object (captured from a meta copy)
    seq_len: int | None = None        # the sequence a job without one takes (a config.json's positions)


def list_builtin_models() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def _validate(data: dict, source: str) -> ModelConfig:
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise format_pydantic_error(source, exc, "model config") from None


def load_model_yaml(path: Path) -> ModelConfig:
    data = read_yaml_mapping(path, "model YAML")
    data.setdefault("name", path.stem)
    return _validate(data, str(path))


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


# model_type values whose config.json this reader maps (decoder families; docs/models.md)
HF_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2",
                  "deepseek_v3", "gpt2", "gpt_neox", "phi3", "gemma", "gemma2", "gemma3_text", "gpt_oss")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")       # RMSNorm on each head's q and k
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")                      # q, k, v projections carry biases
SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text")               # norms after attention and MLP as well
FP32_ROUTER_TYPES = ("deepseek_v2", "deepseek_v3")            # the router GEMM in fp32
TIED_BY_DEFAULT = ("gpt2", "gemma", "gemma2", "gemma3_text")  # their config classes default to tied embeddings
BIASED_TYPES = ("gpt_oss",)   # biases on every linear: attention_bias, the experts' and the router's own
HF_INT_KEYS = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer",
               "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "vocab_size",
               "max_position_embeddings", "n_positions", "n_ctx", "num_local_experts", "n_routed_experts",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
               "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "max_window_layers", "sliding_window_pattern")
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")   # q_lora_rank may be null
HF_BOOL_KEYS = ("tie_word_embeddings", "use_parallel_residual", "attention_bias")
HF_FLOAT_KEYS = ("resid_pdrop", "hidden_dropout", "embd_pdrop", "attn_logit_softcapping", "final_logit_softcapping")


# the largest value of each size key of any family's config.json (the reference decoder's own limits), checked
# before transformers builds a class from it: a hand-edited 10^9 layers would build for hours
HF_SIZE_LIMITS = {**dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), MAX_LAYERS),
                  **dict.fromkeys(("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "head_dim",
                                   "moe_intermediate_size", "shared_expert_intermediate_size", "kv_lora_rank",
                                   "q_lora_rank"), MAX_WIDTH),
                  **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads"), MAX_HEADS),
                  **dict.fromkeys(("num_local_experts", "n_routed_experts", "num_experts", "num_experts_per_tok",
                                   "n_shared_experts"), MAX_EXPERTS),
                  "vocab_size": MAX_VOCAB,
                  **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), MAX_SEQ)}


def _check_hf_sizes(config: dict, source: str, prefix: str = "") -> None:
    """Each size a config.json (or its text_config) states is an integer within the reference decoder's limits."""
    for key, limit in HF_SIZE_LIMITS.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit):
            raise UserInputError(f"{value!r}", source=source, field=prefix + key,
                                 expected=f"an integer from 0 to {limit:,}")
    nested = config.get("text_config")
    if isinstance(nested, dict) and not prefix:
        _check_hf_sizes(nested, source, "text_config.")


def _check_hf_types(config: dict, source: str) -> None:
    """Sizes are integers and switches booleans: '"tie_word_embeddings": "false"' would read as true and
    a string hidden size would multiply as text."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UserInputError(f"model_type {model_type!r} is not a decoder family this reader maps",
                             source=source, field="model_type", expected=f"one of {', '.join(HF_MODEL_TYPES)} "
                             "(other models: pass the nn.Module, or write a model YAML)")
    for key in HF_INT_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserInputError(f"{value!r} is not an integer", source=source, field=key, expected="an integer")
    for key in HF_BOOL_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise UserInputError(f"{value!r} is not a boolean", source=source, field=key,
                                 expected="true or false (JSON booleans, not strings)")
    for key in HF_FLOAT_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserInputError(f"{value!r} is not a number", source=source, field=key, expected="a number")


def config_from_hf(config: dict, source: str = "config.json") -> ModelConfig:
    """Map Hugging Face key names (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, DeepSeek-V2/V3, GPT-2, NeoX,
    Phi-3, Gemma 1/2/3) onto the reference decoder; docs/models.md lists what it does not model."""
    _check_hf_types(config, source)
    model_type = config["model_type"]
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    layers = _first(config, "num_hidden_layers", "n_layer")
    missing = [name for name, value in (("hidden_size", hidden), ("num_attention_heads", heads),
                                        ("num_hidden_layers", layers)) if value is None]
    if missing:
        raise UserInputError(f"missing {', '.join(missing)}", source=source,
                             expected="a Hugging Face config.json of a decoder model")
    gpt_like = model_type in ("gpt2", "gpt_neox")
    act = str(_first(config, "hidden_activation", "hidden_act", "activation_function", default="silu"))
    softcap = config.get("attn_logit_softcapping")
    data = {
        "name": _plain_name(config.get("_name_or_path")) or (Path(source).stem if source.endswith(".json")
                                                              else model_type) or "hf-model",
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": _first(config, "num_key_value_heads", default=heads),
        "head_dim": config.get("head_dim"),
        "ffn_hidden_size": _first(config, "intermediate_size", "n_inner", default=4 * hidden),
        "vocab_size": config.get("vocab_size"),
        "seq_length": _first(config, "max_position_embeddings", "n_positions", "n_ctx", default=4096),
        # GPT-2 and NeoX: a plain GELU MLP; the rest gate it (Gemma's gelu_pytorch_tanh: GeGLU)
        "activation": "gelu" if gpt_like else "geglu" if "gelu" in act else "swiglu",
        "normalization": "layernorm" if gpt_like else "rmsnorm",
        "position_embedding": "learned" if model_type == "gpt2" else "rope",
        "tied_embeddings": bool(config.get("tie_word_embeddings", model_type in TIED_BY_DEFAULT)),
        "attention": "gqa",
        "add_bias": gpt_like or model_type in BIASED_TYPES,
        "qkv_bias": model_type in QKV_BIAS_TYPES or bool(config.get("attention_bias")),
        "qk_norm": model_type in QK_NORM_TYPES,
        "parallel_residual": model_type == "gpt_neox" and config.get("use_parallel_residual", True),
        "sandwich_norm": model_type in SANDWICH_NORM_TYPES,
        "dropout": float(_first(config, "resid_pdrop", "hidden_dropout", "embd_pdrop", default=0.0)),
        # softcapped scores cannot run in a fused kernel: transformers runs such models' attention eagerly
        "attention_softcap": softcap,
        "logit_softcap": config.get("final_logit_softcapping"),
        **_sliding(config, model_type, layers),
    }
    if softcap:
        data["attention_impl"] = "math"
    data["hf_config"] = json.dumps(config, sort_keys=True)
    if data["num_query_groups"] == heads:
        data["attention"] = "mha"
    if config.get("kv_lora_rank"):
        data["attention"] = "mla"
        missing = [key for key in MLA_KEYS if config.get(key) is None]
        if missing:
            raise UserInputError(f"multi-latent attention (kv_lora_rank {config['kv_lora_rank']}) without "
                                 f"{', '.join(missing)}", source=source, field=missing[0],
                                 expected="the MLA sizes of a DeepSeek config.json: " + ", ".join(MLA_KEYS))
        data["mla"] = {"q_lora_rank": config.get("q_lora_rank"),   # null: queries unfactored (DeepSeek-V2-Lite)
                       **{key: config[key] for key in MLA_KEYS}}
    experts = _first(config, "num_local_experts", "n_routed_experts", "num_experts")
    if experts:
        if config.get("num_experts_per_tok") is None:   # transformers' DeepseekV2Config defaults it to null
            raise UserInputError(f"{experts} routed experts but no number of experts per token", source=source,
                                 field="num_experts_per_tok", expected="the router's top-k, a positive integer "
                                 "(DeepSeek-V2: 6; Mixtral: 2)")
        data["moe"] = {
            "num_experts": experts,
            "router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": _first(config, "moe_intermediate_size", "intermediate_size"),
            "num_shared_experts": config.get("n_shared_experts") or 0,
            "first_k_dense_layers": config.get("first_k_dense_replace") or 0,
            "router_fp32": model_type in FP32_ROUTER_TYPES,
            "router_num_groups": config.get("n_group") or 1,
            "router_group_topk": config.get("topk_group") or 1,
        }
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise _in_config_json_keys(format_pydantic_error(source, exc, "model config"), config) from None


def transformers_family(config: dict, source: str) -> UserModule | None:
    """A config.json of a causal-LM family this reader does not map (HF_MODEL_TYPES), built as transformers' own
    class where transformers is installed and knows its model_type: captured as that module, its structure read
    from its graph; None otherwise (the reader maps it, or says it cannot)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type in HF_MODEL_TYPES or not transformers_available():
        return None
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        causal = CONFIG_MAPPING[model_type] in MODEL_FOR_CAUSAL_LM_MAPPING
    except KeyError:   # a model_type transformers does not know
        return None
    if not causal:
        return None
    _check_hf_sizes(config, source)
    name = _plain_name(config.get("_name_or_path")) or (Path(source).stem if source.endswith(".json") else model_type)
    positions = _first(config, "max_position_embeddings", "n_positions", "n_ctx", default=4096)   # as config_from_hf
    return UserModule(name=name, factory=partial(transformers_model, config, None, name),
                      source=f"{source} (transformers' class for model_type '{model_type}')",
                      seq_len=positions if isinstance(positions, int) and not isinstance(positions, bool) else None)


def _plain_name(name) -> str:
    """A `_name_or_path` as a plan names the model: its last path part, other characters as '-'."""
    if not isinstance(name, str) or not name.strip():
        return ""
    tail = name.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._+-]", "-", tail).lstrip("-._+")[:200]


# the reference decoder's fields as a config.json names them (the first key of each that the file holds)
HF_KEY_OF = {"num_layers": ("num_hidden_layers", "n_layer"), "hidden_size": ("hidden_size", "n_embd", "d_model"),
             "num_attention_heads": ("num_attention_heads", "n_head"), "num_query_groups": ("num_key_value_heads",),
             "ffn_hidden_size": ("intermediate_size", "n_inner"), "seq_length": ("max_position_embeddings",
                                                                                 "n_positions", "n_ctx"),
             "attention_softcap": ("attn_logit_softcapping",), "logit_softcap": ("final_logit_softcapping",),
             "dropout": ("resid_pdrop", "hidden_dropout", "embd_pdrop"), "sliding_layers": ("layer_types",
                                                                                            "max_window_layers"),
             "moe.num_experts": ("num_local_experts", "n_routed_experts", "num_experts"),
             "moe.router_topk": ("num_experts_per_tok",), "moe.moe_ffn_hidden_size": ("moe_intermediate_size", "intermediate_size"),
             "moe.num_shared_experts": ("n_shared_experts",), "moe.first_k_dense_layers": ("first_k_dense_replace",),
             "moe.router_num_groups": ("n_group",), "moe.router_group_topk": ("topk_group",),
             **{name: (name,) for name in ("vocab_size", "head_dim", "sliding_window")},
             **{f"mla.{name}": (name,) for name in ("q_lora_rank", *MLA_KEYS)}}


def _in_config_json_keys(error: UserInputError, config: dict) -> UserInputError:
    """The error with each field the reader filled named by the config.json key the user wrote."""
    text = str(error)
    for field, keys in HF_KEY_OF.items():
        key = next((k for k in keys if k in config), None)
        named = f"config.json key '{key}'" if key else f"config.json key '{keys[0]}' (missing" + (
            f"; or {', '.join(keys[1:])})" if len(keys) > 1 else ")")
        # in a field's error, and in a rule's message that quotes it (num_query_groups=3 ...)
        text = text.replace(f"field '{field}'", named).replace(f" {field}=", f" {key or keys[0]}=")
    renamed = UserInputError(text.rstrip("."))
    renamed.field = error.field
    return renamed


def load_user_module(spec: str) -> UserModule:
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text)
    if not os.path.isfile(path):
        raise UserInputError("file not found", source=path_text, expected="'path/to/file.py:factory'")
    module_spec = importlib.util.spec_from_file_location(f"user_model_{path.stem}", path)
    if not MODULE_NAME.match(path.stem) or not MODULE_NAME.match(factory_name):
        raise UserInputError(f"'{path.name}:{factory_name}' is not a plain file and factory name", source=path_text,
                             expected="letters, digits, '_', '.' and '-' (the name goes into plans and commands)")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() in the user's file must not end the planner with its status
        raise UserInputError(f"importing the file called sys.exit({exc.code!r})", source=path_text,
                             expected="a module that defines the factory without exiting") from None
    except Exception as exc:  # the user's file: report, never a traceback
        raise UserInputError(f"importing the file failed: {type(exc).__name__}: {exc}", source=path_text) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UserInputError(f"no callable named '{factory_name}'", source=path_text,
                             expected="a function or class that returns a torch.nn.Module")
    return UserModule(name=f"{path.stem}:{factory_name}", factory=factory, source=spec)


def resolve_model(spec) -> ModelConfig | UserModule:
    """A model argument as the CLI and API accept it."""
    if isinstance(spec, ModelConfig | UserModule):
        return spec
    if isinstance(spec, dict):
        if "model_type" in spec or "n_embd" in spec:
            return transformers_family(spec, "config dict") or config_from_hf(spec, "config dict")
        return _validate(spec, "model dict")
    if isinstance(spec, nn.Module):
        return UserModule(name=type(spec).__name__, factory=lambda: spec, source="module object", module=spec)
    text = str(spec)
    if text.endswith(".py") or ".py:" in text:
        if ":" not in text.split(".py")[-1]:
            raise UserInputError("a Python model needs a factory name", source=text,
                                 expected="'path/to/file.py:factory'")
        return load_user_module(text)
    path = Path(text)
    if path.suffix == ".json":
        content = read_small_text(path, "Hugging Face config.json")
        config = parse_json(content, text)
        if not isinstance(config, dict):
            raise UserInputError("the file does not hold a JSON object", source=text,
                                 expected="a Hugging Face config.json")
        return transformers_family(config, text) or config_from_hf(config, text)
    if path.suffix in (".yaml", ".yml"):
        return load_model_yaml(path)
    if text in list_builtin_models():
        return load_model_yaml(MODEL_DIR / f"{text}.yaml")
    raise UserInputError(f"unknown model '{text}'",
                         expected="a built-in name (" + ", ".join(list_builtin_models())
                         + "), a model .yaml, a config.json or 'file.py:factory'")


def _sliding(config: dict, model_type: str, layers: int) -> dict:
    """A config.json's sliding window and the layers it applies to: its layer_types where it lists them, else as
    transformers derives them (Gemma 2 and GPT-OSS alternate from a sliding first layer; Gemma 3 makes every
    sliding_window_pattern-th layer full; Qwen2's use_sliding_window from max_window_layers on), else every layer."""
    window = config.get("sliding_window")
    # Qwen's configs (max_window_layers beside it) slide only where use_sliding_window says so, default off
    switched_off = config.get("use_sliding_window", "max_window_layers" not in config) is not True
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or switched_off:
        return {}
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    elif model_type in ("gemma2", "gpt_oss"):   # GptOssConfig too: sliding where (i + 1) % 2
        sliding = list(range(0, layers, 2))
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = config.get("sliding_window_pattern") or 6
        sliding = [i for i in range(layers) if (i + 1) % pattern]
    elif config.get("max_window_layers") is not None:
        sliding = list(range(config["max_window_layers"], layers))
    else:
        sliding = list(range(layers))
    return {"sliding_window": window, "sliding_layers": tuple(sliding)}
