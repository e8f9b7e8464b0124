"""`Layout`: one parallel layout, the third typed input beside the model graph and the cluster.

Each attribute is declared here once, with what it carries (`layout_domains.LayoutField`): the key users
write, the plan file's key, its domain, whether the search chooses it and the stack's default.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .layout_choices import (DEFAULT_RECOMPUTE_MODULES, MEGATRON_ORDER, MODULE_INDEX, Fp8Recipe, GradReduce,
                             MoeDispatcher, Precision, Recompute, RecomputeModule, Schedule, TextEnum, nested_modules)
from .layout_domains import (Choice, Count, LayoutField, MeshOrder, ModuleSet, StageCounts, Switch, ZeroStage,
                             declare)

__all__ = ["Layout", "first_blocks_of_each_chunk", "passes_pair_across_micro_batches", "DEFAULT_RECOMPUTE_MODULES",
           "MEGATRON_ORDER", "MODULE_INDEX", "Fp8Recipe", "GradReduce", "MoeDispatcher", "Precision", "Recompute", "RecomputeModule",
           "Schedule", "TextEnum", "nested_modules"]

DEGREE = Count()
RECOMPUTE_WHAT = "none, selective or full"
SCHEDULE_WHAT = "1f1b (vp=1), interleaved-1f1b (vp > 1) or dualpipev (vp=2, two chunks per rank as a V)"


def _degree(key: str, whole: bool = True) -> object:
    return declare(1, LayoutField(key, DEGREE, plan_key=key, searched=True, whole=whole))


@dataclass(frozen=True)
class Layout:
    """Degrees, batch split, ZeRO, schedule and (optionally) the stage partition and recomputation.

    With MoE parallel folding, attention layers use tp x cp x dp x pp and expert layers etp x ep x edp x pp
    over the same ranks: ep divides dp x cp x tp / etp.
    """
    # the degrees (whole: a layout that gives them all is evaluated as given; the search chooses them)
    tp: int = _degree("tp")
    pp: int = _degree("pp")
    dp: int = _degree("dp")
    cp: int = _degree("cp")
    ep: int = _degree("ep")
    etp: int = _degree("etp")
    vp: int = _degree("vp")
    micro_batch: int = _degree("mbs")
    zero: int = declare(1, LayoutField("zero", ZeroStage(), plan_key="zero", searched=True, whole=True))
    recompute: Recompute = declare(Recompute.none, LayoutField(
        "recompute", Choice(Recompute, RECOMPUTE_WHAT, plan_extra=("per-layer",)), plan_key="recompute",
        searched=True, whole=True))
    # the job's: given beside the layout (--global-batch, --precision), the same if also in the layout text
    global_batch: int = declare(1, LayoutField("gbs", Count(plan_most=None), plan_key="gbs", pin=False))
    sequence_parallel: bool = declare(True, LayoutField(
        "sp", Switch(), plan_key="sp", stack_default=lambda stack: None if stack.sequence_parallel else False))
    # the DualPipeV schedule (layout text `schedule=dualpipev`, vp = 2): chunk j < pp on rank j, chunk j >= pp
    # on rank 2 pp - 1 - j; where the stack has it (SoftwareStack.dualpipev_schedule). The text's `schedule`
    # reads the `schedule` property: 1f1b and interleaved-1f1b follow vp
    dualpipev: bool = declare(False, LayoutField("schedule", Choice(Schedule, SCHEDULE_WHAT), plan_key="schedule",
                                                 searched=True, reads="schedule"))
    precision: Precision = declare(Precision.bf16, LayoutField(
        "precision", Choice(Precision, "bf16 or fp8"), plan_key="precision", pin=False))
    mesh_order: tuple[str, ...] = declare(MEGATRON_ORDER, LayoutField("order", MeshOrder(), plan_key="order",
                                                                      searched=True))
    # Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm): MoE all-to-alls beside another
    # micro-batch's compute, where the stack has it and the layout pairs passes (SoftwareStack.hides_moe_a2a)
    moe_a2a_overlap: bool = declare(False, LayoutField(
        "a2a_overlap", Switch(), plan_key="moe_a2a_overlap", searched=True, plan_default=True,
        stack_default=lambda stack: stack.moe_a2a_overlap))
    # TP communication overlap (Megatron --tp-comm-overlap, Transformer Engine userbuffers: the TP collectives
    # as chunked rings beside the GEMMs), where the stack runs it (SoftwareStack.tp_comm_overlap) and the layout
    # has sequence-parallel TP collectives; the search turns it on where nothing rules it out
    # (SoftwareStack.tp_overlap_choice: combined 1F1B on a device that wants one CUDA connection for it)
    tp_comm_overlap: bool = declare(False, LayoutField(
        "tp_overlap", Switch(), plan_key="tp_comm_overlap", searched=True, plan_default=True))
    # the MoE token dispatcher: chosen by the search among those the stack runs on this device where experts
    # spread (ep > 1), the stack's default elsewhere; the exports write it (--moe-token-dispatcher-type)
    moe_dispatcher: MoeDispatcher = declare(MoeDispatcher.alltoall, LayoutField(
        "dispatcher", Choice(MoeDispatcher, "alltoall, deepep or allgather (Megatron --moe-token-dispatcher-type)"),
        plan_key="moe_dispatcher", searched=True, plan_default=True, stack_default=lambda stack: stack.moe_dispatcher))
    grad_reduce: GradReduce = declare(GradReduce.fp32, LayoutField(
        "grad_reduce", Choice(GradReduce, "fp32 or bf16"), plan_key="grad_reduce", plan_default=True,
        stack_default=lambda stack: stack.gradient_reduce))
    fp8_recipe: Fp8Recipe = declare(Fp8Recipe.delayed, LayoutField(
        "fp8_recipe", Choice(Fp8Recipe, "delayed, tensorwise, mxfp8 or blockwise (Megatron --fp8-recipe)"),
        plan_key="fp8_recipe", plan_default=True,
        stack_default=lambda stack: stack.fp8_recipes[0] if stack.fp8_recipes else None))
    # what a selectively recomputed layer repeats (Megatron --recompute-modules), in RecomputeModule order;
    # chosen with the partition where the stack recomputes more than core_attn
    recompute_modules: tuple[RecomputeModule, ...] = declare(DEFAULT_RECOMPUTE_MODULES, LayoutField(
        "recompute_modules", ModuleSet(), plan_key="recompute_modules", searched=True, plan_default=True))
    # with recompute=full: the first N blocks of each chunk recompute fully, the others not at all (Megatron
    # --recompute-method block --recompute-num-layers N, TransformerBlock._checkpointed_forward: per chunk);
    # a plan file's stages say per layer what this meant
    recompute_layers: int | None = declare(None, LayoutField("recompute_layers", Count()))
    # activation offloading (Megatron-Core --cpu-offloading-num-layers N, Transformer Engine's
    # get_cpu_offload_context): the saved activations of the first N blocks go to host memory in forward, each copy
    # beside the next block's forward, and come back beside the next block's backward; where the stack runs it
    # (SoftwareStack.activation_offload) at pp = 1 without recomputation (TransformerConfig's rules). The search
    # takes the fewest blocks that fit where that beats recomputing (cost_models/offload.py)
    offload_layers: int = declare(0, LayoutField("offload_layers", Count(least=0), plan_key="offload_layers",
                                                 searched=True, plan_default=True))
    # blocks per virtual stage (pp * vp entries), chosen by the search; a plan file keeps them as stage records
    stage_layers: tuple[int, ...] | None = declare(None, LayoutField("stages", StageCounts(), pin=False,
                                                                     searched=True))
    layer_recompute: tuple[Recompute, ...] | None = None  # per block; overrides `recompute` (the partition's)

    def __post_init__(self):
        # choices given as their text become the enum; anything else is left for value_problems to name
        for name, kind in _CHOICE_ATTRIBUTES:
            value = getattr(self, name)
            if isinstance(value, str) and not isinstance(value, kind) and value in kind.texts():
                object.__setattr__(self, name, kind(value))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def pairs_passes_across_micro_batches(self) -> bool:
        return passes_pair_across_micro_batches(self.pp, self.vp, self.dualpipev)

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


# the attributes whose declared domain is a choice of a text enum (their values are that enum)
_CHOICE_ATTRIBUTES = tuple((item.name, item.metadata["layout"].domain.kind) for item in fields(Layout)
                           if "layout" in item.metadata and isinstance(item.metadata["layout"].domain, Choice)
                           and item.metadata["layout"].reads is None)


def passes_pair_across_micro_batches(pp: int, vp: int, dualpipev: bool) -> bool:
    """Megatron's combined 1F1B (MoE A2A overlap) runs without a pipeline or with virtual stages."""
    return (pp == 1 or vp > 1) and not dualpipev


def first_blocks_of_each_chunk(stage_layers: tuple[int, ...], count: int) -> tuple[Recompute, ...]:
    """Megatron's block method: in each chunk, its first `count` blocks recompute fully and the rest none."""
    return tuple(Recompute.full if position < count else Recompute.none
                 for blocks in stage_layers for position in range(blocks))
