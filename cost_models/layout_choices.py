"""The choices a layout is made of: text enums for methods, precisions and schedules, and the mesh order."""
from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A choice written as text: equal to, printed and formatted as its value (names equal values, so
    it also hashes as its text and dict lookups by text work)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def texts(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Recompute(TextEnum):
    none = "none"
    selective = "selective"   # recompute the attention core (Megatron --recompute-granularity selective)
    full = "full"             # keep only the layer input, recompute the whole layer


class RecomputeModule(TextEnum):
    """What selective recomputation repeats, as Megatron-Core names it (TransformerConfig.recompute_modules,
    default ["core_attn"]): the first three by checkpointing (the module's input kept, everything it saves
    dropped), the others by output-discarding checkpointing (its output freed once used, remade in backward).
    moe_act and shared_experts lie inside moe: where the expert container is captured as one node, its ops and
    tensors name them as their `inner_module`."""
    core_attn = "core_attn"       # the attention core (softmax(q k^T) v, fused or not)
    mlp = "mlp"                   # a dense layer's MLP: its column -> row pair (not a MoE layer's)
    moe = "moe"                   # a MoE layer's routed experts, as captured in one expert container
    layernorm = "layernorm"       # the norms on the residual stream (input and pre-MLP layernorm)
    mla_up_proj = "mla_up_proj"   # MLA's query and key-value up-projections and RoPE, up to the attention core
    # the routed experts' activation between their GEMMs, gating multiply included: what the down-projection
    # keeps (Megatron-Core's GroupedMLP checkpoints it without its output, experts.py `activation_recompute`)
    moe_act = "moe_act"
    # a MoE layer's shared experts (and their gate), checkpointed with their input kept (Megatron-Core 0.14 on)
    shared_experts = "shared_experts"

    @property
    def discards_output(self) -> bool:
        return self in (RecomputeModule.layernorm, RecomputeModule.mla_up_proj, RecomputeModule.moe_act)

    @property
    def container(self) -> "RecomputeModule | None":
        """The module this one lies inside (moe_act and shared_experts inside moe): recomputing both would
        count its tensors and time twice, so a set names one of them."""
        return RecomputeModule.moe if self in (RecomputeModule.moe_act, RecomputeModule.shared_experts) else None

    @property
    def refused_with_delayed_fp8(self) -> bool:
        """Megatron-Core's TransformerConfig refuses moe_act and layernorm recomputation under FP8 delayed
        scaling (transformer_config.py __post_init__): a recomputed cast would update the amax history twice."""
        return self in (RecomputeModule.layernorm, RecomputeModule.moe_act)


def nested_modules(modules) -> tuple[RecomputeModule, ...]:
    """The modules of a set that lie inside another of it (moe_act or shared_experts beside moe): a set that
    has any counts their tensors and time twice, and is refused or never chosen."""
    return tuple(m for m in modules if m.container in modules)


DEFAULT_RECOMPUTE_MODULES = (RecomputeModule.core_attn,)
MODULE_INDEX = {module: i for i, module in enumerate(RecomputeModule)}   # per-module tuples are in this order


class Precision(TextEnum):
    bf16 = "bf16"
    fp8 = "fp8"                 # FP8 GEMMs (Transformer Engine); embedding and output layers stay bf16


class GradReduce(TextEnum):
    fp32 = "fp32"               # gradient buffers and reductions in fp32 (Megatron-LM with --bf16)
    bf16 = "bf16"               # --grad-reduce-in-bf16


class Fp8Recipe(TextEnum):
    delayed = "delayed"         # amax history (Megatron --fp8-recipe delayed)
    tensorwise = "tensorwise"   # current scaling, one more read per cast (Megatron-Bridge "FP8-CS")
    mxfp8 = "mxfp8"             # an E8M0 scale per 32 elements, Blackwell tensor cores (Megatron-Bridge "FP8-MX")
    blockwise = "blockwise"     # DeepSeek-V3's fp32 scale per 1x128 activation and 128x128 weight tile


class MoeDispatcher(TextEnum):
    """How a MoE layer's tokens reach their experts' ranks (Megatron-Core --moe-token-dispatcher-type)."""
    alltoall = "alltoall"     # one copy per chosen expert, sent by NCCL's all-to-all
    # one copy per destination scale-up domain, forwarded inside it (DeepEP, HybridEP: Megatron-Core
    # --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep|hybridep); FP8 tokens
    # only where the stack sends them (`SoftwareStack.moe_fp8_dispatch`)
    deepep = "deepep"
    allgather = "allgather"   # every token to the expert tp x ep group, outputs reduce-scattered back

    @property
    def words(self) -> str:
        """How it dispatches, as plans and export notes say it."""
        return {MoeDispatcher.alltoall: "by NCCL's all-to-all, one copy per chosen expert",
                MoeDispatcher.deepep: "DeepEP-style, one copy per destination domain",
                MoeDispatcher.allgather: "by all-gather, every token to the expert tp x ep group"}[self]


class Schedule(TextEnum):
    one_f_one_b = "1f1b"
    interleaved = "interleaved-1f1b"
    # DeepSeek's DualPipe cut in half (torch ScheduleDualPipeV): two chunks per rank placed as a V, each
    # forward run beside another micro-batch's backward in the steady state
    dualpipev = "dualpipev"


MEGATRON_ORDER = ("tp", "cp", "ep", "dp", "pp")  # innermost first (design-notes: tp-cp-ep-dp-pp)
