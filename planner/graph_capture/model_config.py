"""The project's model schema (docs/models.md): what the reference decoder is built from."""
from __future__ import annotations

import json

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


# Input limits, far above any model trained (Kimi-K2: 61 layers, 7,168 wide, 384 experts): a value past
# them is a typo or an attack, and building or costing it would take unbounded time or memory.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20          # hidden, ffn, head and latent sizes
MAX_HEADS = 1 << 16
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_SEQ = 1 << 24


class _Strict(BaseModel):
    # strict: a size given as text or as true/false is an error, never coerced
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class MLAConfig(_Strict):
    """Multi-head latent attention (DeepSeek-V2/V3)."""
    q_lora_rank: int | None = Field(default=None, gt=0, le=MAX_WIDTH)
    kv_lora_rank: int = Field(gt=0, le=MAX_WIDTH)
    qk_nope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    qk_rope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    v_head_dim: int = Field(gt=0, le=MAX_WIDTH)


class MoEConfig(_Strict):
    num_experts: int = Field(gt=1, le=MAX_EXPERTS)
    router_topk: int = Field(gt=0)
    moe_ffn_hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    num_shared_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    shared_expert_ffn_hidden_size: int | None = Field(default=None, gt=0, le=MAX_WIDTH)
    first_k_dense_layers: int = Field(default=0, ge=0, le=MAX_LAYERS)
    router_fp32: bool = False       # the router GEMM on fp32 copies of tokens and weight (DeepSeek-V2/V3)
    layer_frequency: int = Field(default=1, gt=0, le=MAX_LAYERS)
    # group-limited routing (DeepSeek-V3's node-limited routing; Megatron --moe-router-num-groups /
    # --moe-router-group-topk; config.json n_group / topk_group): experts in equal groups, each token's
    # experts taken from its best `router_group_topk` groups only
    router_num_groups: int = Field(default=1, gt=0, le=MAX_EXPERTS)
    router_group_topk: int = Field(default=1, gt=0, le=MAX_EXPERTS)

    @model_validator(mode="after")
    def _topk_fits(self):
        if self.router_topk > self.num_experts:
            raise ValueError(f"router_topk={self.router_topk} exceeds num_experts={self.num_experts}")
        if self.num_experts % self.router_num_groups:
            raise ValueError(f"router_num_groups={self.router_num_groups} does not divide num_experts={self.num_experts}")
        if self.router_group_topk > self.router_num_groups:
            raise ValueError(f"router_group_topk={self.router_group_topk} exceeds router_num_groups="
                             f"{self.router_num_groups}")
        return self


class TorchtitanModel(_Strict):
    """The same model in torchtitan's registry: `python -m torchtitan.train --module MODULE --config CONFIG`
    (torchtitan/models/MODULE/config_registry.py), and the registry's configs with an FP8 converter, by the
    planner's FP8 recipe it is exported for (torchtitan 0.3 sets converters in Python, not by flag)."""
    module: str = Field(pattern=r"^[a-z0-9_]{1,64}$")
    config: str | None = Field(default=None, pattern=r"^[a-z0-9_]{1,96}$")   # BF16 (None: the registry has none)
    fp8_recipe: str | None = None     # the planner's FP8 recipe its FP8 config is exported for
    fp8_config: str | None = Field(default=None, pattern=r"^[a-z0-9_]{1,96}$")

    def config_for(self, fp8_recipe: str | None) -> str | None:
        """The registry config that trains in this FP8 recipe (None: none has it), or the BF16 one."""
        if fp8_recipe is None:
            return self.config
        return self.fp8_config if fp8_recipe == self.fp8_recipe else None


# the sizes a config.json states and the fields they must equal: capture builds the transformers class
# from hf_config, so one that disagrees would plan another model than the file's own fields say
HF_SIZES = (("num_hidden_layers", "num_layers"), ("n_layer", "num_layers"), ("hidden_size", "hidden_size"),
            ("n_embd", "hidden_size"), ("num_attention_heads", "num_attention_heads"),
            ("n_head", "num_attention_heads"), ("intermediate_size", "ffn_hidden_size"),
            ("vocab_size", "vocab_size"))


class ModelConfig(_Strict):
    name: str = Field(default="custom", pattern=r"^[A-Za-z0-9][A-Za-z0-9._+:/-]{0,199}$")
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS)
    num_query_groups: int | None = Field(default=None, gt=0, le=MAX_HEADS)
    head_dim: int | None = Field(default=None, gt=0, le=MAX_WIDTH)
    ffn_hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    seq_length: int = Field(gt=0, le=MAX_SEQ)
    activation: Literal["gelu", "swiglu", "geglu", "relu2"] = "swiglu"
    normalization: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    position_embedding: Literal["rope", "learned"] = "rope"
    tied_embeddings: bool = False
    attention: Literal["mha", "gqa", "mla"] = "gqa"
    attention_impl: Literal["flash", "math"] = "flash"
    add_bias: bool = False
    qkv_bias: bool = False          # biases on q, k and v only (Qwen2)
    qk_norm: bool = False           # RMSNorm over each head's q and k (Qwen3, Gemma 3)
    parallel_residual: bool = False # attention and MLP both read the layer input (GPT-NeoX)
    sandwich_norm: bool = False     # a norm after attention and after the MLP too (Gemma 2/3)
    # sliding-window attention: each query sees this many keys (itself and those before) on the layers
    # `sliding_layers` names (0-based), or on every layer where it names none (transformers' sliding_window
    # and layer_types); a layer's window is a kind apart in capture (graph_analysis.block_window)
    sliding_window: int | None = Field(default=None, gt=0, le=MAX_SEQ)
    sliding_layers: tuple[int, ...] | None = Field(default=None, strict=False)
    attention_softcap: float | None = Field(default=None, gt=0, strict=False)  # cap*tanh(s/cap) on scores
    logit_softcap: float | None = Field(default=None, gt=0, strict=False)      # the same on the logits
    dropout: float = Field(default=0.0, ge=0, lt=1, strict=False)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # multi-token prediction modules after the last layer (DeepSeek-V3 2.2, num_nextn_predict_layers; Megatron
    # --mtp-num-layers): module k embeds the tokens k+1 further ahead, projects [norm(hidden), norm(embedding)]
    # from 2h to h, runs one more layer like the last (experts where it has them), and the shared output layer
    # and its own loss; Megatron-Core places them on the last pipeline stage
    mtp_layers: int = Field(default=0, ge=0, le=MAX_LAYERS)
    # the Hugging Face config.json this was read from (JSON text): capture builds the transformers class
    # from it where transformers is installed, else this reference decoder (docs/models.md)
    hf_config: str | None = None
    # where torchtitan has this model (its pipeline split then names torchtitan's modules: docs/cli.md)
    torchtitan: TorchtitanModel | None = None

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _shapes_agree(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} does not divide "
                             f"hidden_size={self.hidden_size} (set head_dim if heads are not hidden/heads)")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_query_groups={self.query_groups} does not divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.attention == "mla" and self.mla is None:
            raise ValueError("attention is 'mla' but the 'mla' section is missing")
        if self.moe and self.moe.first_k_dense_layers > self.num_layers:
            raise ValueError("moe.first_k_dense_layers exceeds num_layers")
        if self.sliding_layers is not None and any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers names a layer outside 0..{self.num_layers - 1}")
        self._hf_config_agrees()
        return self

    def _hf_config_agrees(self) -> None:
        if self.hf_config is None:
            return
        try:
            config = json.loads(self.hf_config)
        except (ValueError, RecursionError):
            raise ValueError("hf_config is not the JSON text of a config.json") from None
        if not isinstance(config, dict):
            raise ValueError("hf_config is not the JSON text of a config.json object")
        for key, field in HF_SIZES:
            if key in config and config[key] != getattr(self, field) and not (
                    field == "ffn_hidden_size" and self.moe is not None):   # MoE: the dense layers' width
                raise ValueError(f"hf_config says {key}={config[key]!r} where this file says {field}="
                                 f"{getattr(self, field)!r}: capture would build the hf_config's model")

    def window_of(self, index: int) -> int:
        """The keys each query of layer `index` sees, 0 for all (multi-token prediction layers: full)."""
        if self.sliding_window is None or index >= self.num_layers:
            return 0
        return self.sliding_window if self.sliding_layers is None or index in self.sliding_layers else 0

    def is_moe_layer(self, index: int) -> bool:
        if self.moe is None or index < self.moe.first_k_dense_layers:
            return False
        return (index - self.moe.first_k_dense_layers) % self.moe.layer_frequency == 0
