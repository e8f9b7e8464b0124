"""`Layout`: one parallel layout, the third typed input beside the model graph and the cluster."""
from __future__ import annotations

from dataclasses import dataclass
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


class Schedule(TextEnum):
    one_f_one_b = "1f1b"
    interleaved = "interleaved-1f1b"
    # DeepSeek's DualPipe cut in half (torch ScheduleDualPipeV): two chunks per rank placed as a V, each
    # forward run beside another micro-batch's backward in the steady state
    dualpipev = "dualpipev"


MEGATRON_ORDER = ("tp", "cp", "ep", "dp", "pp")  # innermost first (design-notes: tp-cp-ep-dp-pp)


@dataclass(frozen=True)
class Layout:
    """Degrees, batch split, ZeRO, schedule and (optionally) the stage partition and recomputation.

    With MoE parallel folding, attention layers use tp x cp x dp x pp and expert layers etp x ep x edp x pp
    over the same ranks: ep divides dp x cp x tp / etp.
    """
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    zero: int = 1
    sequence_parallel: bool = True
    # Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm): MoE all-to-alls beside another
    # micro-batch's compute, where the stack has it and the layout pairs passes (SoftwareStack.hides_moe_a2a)
    moe_a2a_overlap: bool = False
    # the DualPipeV schedule (layout text `schedule=dualpipev`, vp = 2): chunk j < pp on rank j, chunk j >= pp
    # on rank 2 pp - 1 - j; where the stack has it (SoftwareStack.dualpipev_schedule)
    dualpipev: bool = False
    recompute: Recompute = Recompute.none
    precision: Precision = Precision.bf16
    grad_reduce: GradReduce = GradReduce.fp32
    fp8_recipe: Fp8Recipe = Fp8Recipe.delayed
    mesh_order: tuple[str, ...] = MEGATRON_ORDER
    stage_layers: tuple[int, ...] | None = None        # blocks per virtual stage (pp * vp entries)
    layer_recompute: tuple[Recompute, ...] | None = None  # per block; overrides `recompute`
    # what a selectively recomputed layer repeats (Megatron --recompute-modules), in RecomputeModule order
    recompute_modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES
    # with recompute=full: the first N blocks of each chunk recompute fully, the others not at all (Megatron
    # --recompute-method block --recompute-num-layers N, TransformerBlock._checkpointed_forward: per chunk)
    recompute_layers: int | None = None

    def __post_init__(self):
        # choices given as their text become the enum; anything else is left for value_problems to name
        for name, kind in (("recompute", Recompute), ("precision", Precision), ("grad_reduce", GradReduce),
                           ("fp8_recipe", Fp8Recipe)):
            value = getattr(self, name)
            if isinstance(value, str) and not isinstance(value, kind) and value in kind.texts():
                object.__setattr__(self, name, kind(value))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def pairs_passes_across_micro_batches(self) -> bool:
        """Megatron's combined 1F1B (MoE A2A overlap) runs without a pipeline or with virtual stages."""
        return (self.pp == 1 or self.vp > 1) and not self.dualpipev

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def schedule(self) -> Schedule:
        if self.dualpipev:
            return Schedule.dualpipev
        return Schedule.interleaved if self.vp > 1 else Schedule.one_f_one_b

    def chunk_rank(self, chunk: int) -> int:
        """The pipeline rank that runs chunk `chunk` of pp * vp: round robin (Megatron's and torch's
        interleaving), or a V under DualPipeV (torch generate_stage_to_rank_mapping style "v")."""
        if self.dualpipev:
            return chunk if chunk < self.pp else 2 * self.pp - 1 - chunk
        return chunk % self.pp

    @property
    def expert_data_parallel(self) -> int:
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def gradient_bytes(self) -> int:
        # design-notes, mixed-precision Adam: 4 B fp32 gradient accumulation, or 2 B in bf16
        return 2 if self.grad_reduce == "bf16" else 4

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def block_recompute(self, stage_layers: tuple[int, ...]) -> tuple[Recompute, ...]:
        """Each block's recomputation under the partition `stage_layers`: the per-block list where given, else
        the first `recompute_layers` blocks of each chunk fully, else `recompute` everywhere."""
        if self.layer_recompute is not None:
            return self.layer_recompute
        if self.recompute_layers is not None:
            return first_blocks_of_each_chunk(stage_layers, self.recompute_layers)
        return tuple(self.recompute for _ in range(sum(stage_layers)))

    def recompute_of(self, block_index: int) -> Recompute:
        if self.layer_recompute is not None:
            return self.layer_recompute[block_index]
        return self.recompute

    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        sizes = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return tuple((name, sizes[name]) for name in self.mesh_order if name in sizes)


def first_blocks_of_each_chunk(stage_layers: tuple[int, ...], count: int) -> tuple[Recompute, ...]:
    """Megatron's block method: in each chunk, its first `count` blocks recompute fully and the rest none."""
    return tuple(Recompute.full if position < count else Recompute.none
                 for blocks in stage_layers for position in range(blocks))
