"""`Plan`: the search's typed result, saved to and loaded from YAML or JSON unchanged."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cost_models.layout import Layout, OverlapModel, Recompute
from cost_models.step_time import Estimate
from hardware_profiles.errors import UserInputError, format_pydantic_error


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LayoutRecord(_Frozen):
    dp: int
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    etp: int
    mbs: int
    gbs: int
    zero: int
    sp: bool
    recompute: str
    schedule: str
    precision: str
    mesh_order: list[str]
    tp_comm_overlap: bool = False   # the prediction assumed TP collectives overlapped with GEMMs
    moe_a2a_overlap: bool = False   # ... and MoE all-to-alls beside another micro-batch's compute
    grad_reduce: str = "fp32"       # gradient buffers and reductions (bf16: --grad-reduce-in-bf16)
    fp8_recipe: str = "delayed"     # FP8 scaling recipe (Megatron --fp8-recipe), with precision fp8

    @classmethod
    def of(cls, layout: Layout, layer_recompute: tuple[Recompute, ...],
           overlap: OverlapModel = OverlapModel()) -> "LayoutRecord":
        kinds = {r.value for r in layer_recompute} or {layout.recompute.value}
        summary = kinds.pop() if len(kinds) == 1 else "per-layer"
        return cls(dp=layout.dp, tp=layout.tp, pp=layout.pp, vp=layout.vp, cp=layout.cp, ep=layout.ep,
                   etp=layout.etp, mbs=layout.micro_batch, gbs=layout.global_batch, zero=layout.zero,
                   sp=layout.sp, recompute=summary, schedule=layout.schedule.value, precision=layout.precision,
                   mesh_order=list(layout.mesh_order), tp_comm_overlap=overlap.tp_comm_overlap and layout.tp > 1,
                   moe_a2a_overlap=overlap.hides_moe_a2a(layout),
                   grad_reduce=layout.grad_reduce, fp8_recipe=layout.fp8_recipe)


class StageRecord(_Frozen):
    index: int               # virtual stage (chunk); runs on pipeline rank index % pp
    pipeline_rank: int
    layers: list[int]        # block indices
    modules: list[str]       # module names, as torchtitan's pipeline splitting takes them
    recompute: list[str]     # per block of this stage


class MemoryRecord(_Frozen):
    stage: int
    total_bytes: float
    capacity_bytes: float
    parts: dict[str, float]


class SearchStats(_Frozen):
    # wall time is reported (CLI, API) but kept out of plan files, which must be byte-identical per input
    wall_s: float = Field(default=0.0, exclude=True)
    candidates: int
    pruned_memory: int
    pruned_bound: int
    solved: int
    solver_status: str
    gap: float


class Alternative(_Frozen):
    layout: str
    step_time_s: float
    mfu: float
    loses: str


class Plan(_Frozen):
    model: str
    cluster: str
    num_devices: int
    placement: str = ""                 # how the devices fill the scale-up domains (Cluster.placement_text)
    seq_len: int
    layout: LayoutRecord
    stages: list[StageRecord]
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hfu: float
    fits: bool
    peak_memory_bytes: float
    memory: list[MemoryRecord]
    breakdown: dict[str, float]
    search: SearchStats | None = None
    alternatives: list[Alternative] = []
    reasons: list[str] = []

    def to_layout(self) -> Layout:
        """The runnable layout: degrees plus the stage partition and per-layer recomputation."""
        lay = self.layout
        stage_layers = tuple(len(stage.layers) for stage in self.stages)
        recompute = tuple(Recompute(r) for stage in self.stages for r in stage.recompute)
        return Layout(dp=lay.dp, tp=lay.tp, pp=lay.pp, vp=lay.vp, cp=lay.cp, ep=lay.ep, etp=lay.etp,
                      micro_batch=lay.mbs, global_batch=lay.gbs, zero=lay.zero, sequence_parallel=lay.sp,
                      precision=lay.precision, grad_reduce=lay.grad_reduce, fp8_recipe=lay.fp8_recipe, mesh_order=tuple(lay.mesh_order),
                      stage_layers=stage_layers,
                      layer_recompute=recompute,
                      recompute=Recompute(lay.recompute) if lay.recompute != "per-layer" else Recompute.none)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        data = self.model_dump(mode="json")
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        else:
            path.write_text(yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise UserInputError("file not found", source=str(path), expected="a plan written by 'planner plan --out'")
        text = path.read_text()
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise UserInputError(f"cannot parse ({str(exc).splitlines()[0]})", source=str(path)) from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise format_pydantic_error(str(path), exc, "plan") from None


def stage_records(estimate: Estimate, block_names: tuple[str, ...], pp: int, first: tuple[str, ...] = (),
                  last: tuple[str, ...] = ()) -> list[StageRecord]:
    records, start = [], 0
    chunks = len(estimate.stage_layers)
    for j, count in enumerate(estimate.stage_layers):
        blocks = list(range(start, start + count))
        modules = (list(first) if j == 0 else []) + [block_names[b] for b in blocks] + \
            (list(last) if j == chunks - 1 else [])
        records.append(StageRecord(index=j, pipeline_rank=j % pp, layers=blocks, modules=modules,
                                   recompute=[estimate.layer_recompute[b].value for b in blocks]))
        start += count
    return records


def memory_records(estimate: Estimate) -> list[MemoryRecord]:
    return [MemoryRecord(stage=m.stage, total_bytes=m.total, capacity_bytes=m.capacity, parts=m.parts())
            for m in estimate.stage_memory]
