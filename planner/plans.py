"""`Plan`: the search's typed result, saved to and loaded from YAML or JSON unchanged."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cost_models.compute import FP8_CAST_BYTES
from cost_models.layout import MEGATRON_ORDER, Layout, OverlapModel, Recompute
from cost_models.step_time import Estimate
from hardware_profiles.errors import UserInputError, format_pydantic_error

from .output_paths import write_no_follow


MAX_PLAN_FILE_BYTES = 64 << 20   # a plan of 16,384 devices and 1,000 stages is under 1 MB
PLAIN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._+:/-]{0,199}$"   # goes into shell commands: no spaces, quotes or ;
MAX_DEGREE = 1 << 20


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


Degree = Field(gt=0, le=MAX_DEGREE)


class LayoutRecord(_Frozen):
    dp: int = Degree
    tp: int = Degree
    pp: int = Degree
    vp: int = Degree
    cp: int = Degree
    ep: int = Degree
    etp: int = Degree
    mbs: int = Degree
    gbs: int = Field(gt=0)
    zero: Literal[0, 1, 2, 3]
    sp: bool
    recompute: Literal["none", "selective", "full", "per-layer"]
    schedule: Literal["1f1b", "interleaved-1f1b"]
    precision: Literal["bf16", "fp8"]
    mesh_order: list[str]
    tp_comm_overlap: bool = False   # the prediction assumed TP collectives overlapped with GEMMs
    moe_a2a_overlap: bool = False   # ... and MoE all-to-alls beside another micro-batch's compute
    grad_reduce: Literal["fp32", "bf16"] = "fp32"   # gradient buffers and reductions (bf16: --grad-reduce-in-bf16)
    fp8_recipe: str = "delayed"     # FP8 scaling recipe (Megatron --fp8-recipe), with precision fp8

    @field_validator("mesh_order")
    @classmethod
    def _is_permutation(cls, order: list[str]) -> list[str]:
        if sorted(order) != sorted(MEGATRON_ORDER):
            raise ValueError(f"must list {', '.join(MEGATRON_ORDER)} once each, innermost first")
        return order

    @field_validator("fp8_recipe")
    @classmethod
    def _known_recipe(cls, recipe: str) -> str:
        if recipe not in FP8_CAST_BYTES:
            raise ValueError(f"must be one of {', '.join(FP8_CAST_BYTES)}")
        return recipe

    @model_validator(mode="after")
    def _consistent(self):
        if self.vp > 1 and self.pp == 1:
            raise ValueError(f"vp={self.vp} needs pp > 1")
        if self.schedule != ("interleaved-1f1b" if self.vp > 1 else "1f1b"):
            raise ValueError(f"schedule {self.schedule} does not match vp={self.vp}")
        if self.gbs % (self.dp * self.mbs):
            raise ValueError(f"gbs={self.gbs} is not a multiple of dp*mbs = {self.dp * self.mbs}")
        return self

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
    index: int = Field(ge=0)               # virtual stage (chunk); runs on pipeline rank index % pp
    pipeline_rank: int = Field(ge=0)
    layers: list[int]        # block indices
    modules: list[str] = Field(min_length=1)   # module names, as torchtitan's pipeline splitting takes them
    recompute: list[Literal["none", "selective", "full"]]     # per block of this stage

    @model_validator(mode="after")
    def _one_method_per_layer(self):
        if len(self.recompute) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers but {len(self.recompute)} recompute entries")
        return self


class MemoryRecord(_Frozen):
    stage: int
    total_bytes: float
    capacity_bytes: float
    parts: dict[str, float]


class SearchStats(_Frozen):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)   # wall_s may be written as an int
    # wall time is reported (CLI, API) but kept out of plan files, which must be byte-identical per input
    wall_s: float = Field(default=0.0, exclude=True)
    candidates: int
    pruned_memory: int
    pruned_bound: int
    solved: int
    solver_status: str
    gap: float


class Alternative(_Frozen):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)
    layout: str
    step_time_s: float
    mfu: float
    loses: str


class Plan(_Frozen):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())
    model: str = Field(pattern=PLAIN_NAME)
    cluster: str = Field(pattern=PLAIN_NAME)
    num_devices: int = Field(gt=0, le=MAX_DEGREE)
    devices_per_node: int | None = Field(default=None, gt=0)   # of the cluster planned for (launch commands)
    placement: str = ""                 # how the devices fill the scale-up domains (Cluster.placement_text)
    seq_len: int = Field(gt=0)
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

    @model_validator(mode="after")
    def _layout_matches(self):
        lay = self.layout
        world = lay.dp * lay.tp * lay.pp * lay.cp
        if world != self.num_devices:
            raise ValueError(f"layout dp*tp*pp*cp = {world} does not equal num_devices={self.num_devices}")
        if len(self.stages) != lay.pp * lay.vp:
            raise ValueError(f"{len(self.stages)} stages where pp*vp = {lay.pp * lay.vp}")
        if self.devices_per_node and self.num_devices % self.devices_per_node \
                and self.devices_per_node % self.num_devices:
            raise ValueError(f"num_devices={self.num_devices} does not fill nodes of {self.devices_per_node}")
        return self

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
        text = json.dumps(data, indent=2, sort_keys=False) + "\n" if path.suffix == ".json" \
            else yaml.safe_dump(data, sort_keys=False)
        write_no_follow(path, text.encode())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not os.path.isfile(path):
            raise UserInputError("file not found", source=str(path), expected="a plan written by 'planner plan --out'")
        if path.stat().st_size > MAX_PLAN_FILE_BYTES:
            raise UserInputError(f"{path.stat().st_size:,} bytes", source=str(path),
                                 expected=f"a plan file under {MAX_PLAN_FILE_BYTES >> 20} MB")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"cannot read ({exc})", source=str(path), expected="a UTF-8 plan file") from None
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
