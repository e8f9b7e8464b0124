"""`Plan`: the search's typed result, saved to and loaded from YAML or JSON unchanged."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from cost_models.layout import Layout, Recompute
from cost_models.layout_codec import FIELDS, layout_from, parse_values
from cost_models.layout_domains import MAX_DEGREE
from cost_models.step_time import Estimate
from hardware_profiles.errors import format_pydantic_error
from hardware_profiles.parsing import parse_json, parse_yaml, read_bounded_text
from hardware_profiles.stack import DEFAULT_STACK, SoftwareStack

from .output_paths import write_no_follow
from .rules.plan_file import plan_problems, record_problems


MAX_PLAN_FILE_BYTES = 64 << 20   # a plan of 16,384 devices and 1,000 stages is under 1 MB
PLAIN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._+:/-]{0,199}$"   # goes into shell commands: no spaces, quotes or ;
REPORT_KEYS = ("recompute_per_layer", "peak_memory_bytes_per_stage", "goodput")   # derived, in --json only


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)




class StackAssumptions(_Frozen):
    """What the prediction assumed of the software stack beside the layout (a plan file's layout record)."""
    moe_shared_expert_overlap: bool = False   # shared experts beside the all-to-alls
    precision_aware_optimizer: bool = False   # Megatron-Core's precision-aware optimizer (memory.py)
    fused_loss: bool = False                  # Transformer Engine's fused cross-entropy (memory.py)
    adam_moment_bytes: Literal[2, 4] = 4      # each Adam moment kept in these bytes
    # the kernels of the deepep dispatcher on this plan's device (Megatron --moe-flex-dispatcher-backend)
    flex_dispatcher_backend: Literal["deepep", "hybridep"] | None = None


class _LayoutRecordRules(_Frozen):
    @model_validator(mode="after")
    def _consistent(self):
        problems = record_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def of(cls, layout: Layout, layer_recompute: tuple[Recompute, ...], stack: SoftwareStack,
           device=None) -> "LayoutRecord":
        """The record of a planned layout: each declared field's value as a plan file keeps it, with what the
        prediction took of the stack (SP in effect, combined 1F1B where it hides the all-to-alls, TP overlap where it
        runs)."""
        values = {declared.field.plan_key: declared.field.domain.to_plan(getattr(layout, declared.reads))
                  for declared in FIELDS.values() if declared.field.plan_key}
        kinds = {r.value for r in layer_recompute} or {layout.recompute.value}
        values.update(sp=layout.sp, recompute=kinds.pop() if len(kinds) == 1 else "per-layer",
                      moe_a2a_overlap=stack.hides_moe_a2a(layout),
                      tp_comm_overlap=stack.tp_overlap_in(layout, device) if device is not None else
                      layout.tp_comm_overlap and stack.tp_overlap_applies(layout))
        return cls(**values, moe_shared_expert_overlap=stack.runs_shared_experts_beside_a2a(layout),
                   precision_aware_optimizer=stack.precision_aware_in(layout),
                   fused_loss=stack.loss_gradient == "fused", adam_moment_bytes=stack.moment_bytes_in(layout),
                   flex_dispatcher_backend=device.flex_dispatcher_backend if device is not None and layout.ep > 1
                   and layout.moe_dispatcher == "deepep" else None)

    def as_layout(self, **fixed) -> Layout:
        """The record as a `Layout` (`fixed`: attributes beside it, e.g. the stage split); a per-layer
        recomputation reads as none, the stages saying per layer what it is."""
        values = self.layout_values()
        if values["recompute"] == "per-layer":
            values["recompute"] = Recompute.none
        return layout_from(parse_values(values, "layout"), **fixed)

    def layout_values(self) -> dict:
        """The record's layout fields as typed values by user key (`layout_codec`)."""
        return {key: declared.field.domain.from_plan(getattr(self, declared.field.plan_key))
                for key, declared in FIELDS.items() if declared.field.plan_key}

    @property
    def mesh_order(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))


def _record_fields() -> dict:
    """The layout record's fields: each declared layout field with a plan key (older files may lack those
    marked plan_default), then the stack's assumptions."""
    out = {}
    for declared in FIELDS.values():
        field = declared.field
        if field.plan_key is None:
            continue
        default = field.domain.to_plan(Layout.__dataclass_fields__[declared.attribute].default) \
            if field.plan_default else ...
        out[field.plan_key] = (field.domain.plan_annotation(), default)
    return out | {name: (info.annotation, info) for name, info in StackAssumptions.model_fields.items()}


# a plan file's layout: the keys of the layout text as declared on `Layout`, one value each
LayoutRecord = create_model("LayoutRecord", __base__=_LayoutRecordRules, __module__=__name__, **_record_fields())


class StageRecord(_Frozen):
    index: int = Field(ge=0)               # virtual stage (chunk); runs on pipeline rank index % pp (a V: DualPipeV)
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
    # times are reported (CLI, API) but kept out of plan files, which must be byte-identical per input
    wall_s: float = Field(default=0.0, exclude=True)
    cpu_s: float = Field(default=0.0, exclude=True)
    # complete: every candidate bounded away or solved to a proof, so the plan is the model's optimum;
    # time-limited: the wall-clock limit left candidates unexplored; unproven: a leaf's solver stopped at
    # its work limit without a proof. Only a complete search's plan is independent of machine load.
    status: Literal["complete", "time-limited", "unproven"]
    candidates: int
    pruned_memory: int
    pruned_bound: int
    solved: int
    unexplored: int = 0
    unproven_leaves: int = 0
    gap: float                  # of the plan's own partition (0 when proven optimal)


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
    stack: str = Field(default=DEFAULT_STACK, pattern=PLAIN_NAME)   # the software stack predicted for
    num_devices: int = Field(gt=0, le=MAX_DEGREE)
    devices_per_node: int | None = Field(default=None, gt=0)   # of the cluster planned for (launch commands)
    segment_devices: int | None = Field(default=None, gt=0)   # per scale-up domain (Cluster.segment_devices)
    # the profiles planned on, as another process loads them again (built-in name or absolute path);
    # cluster_profile is "" for a cluster made from --device; both "" in plans written before they were kept
    cluster_profile: str = ""
    device_profile: str = ""
    placement: str = ""                 # how the devices fill the scale-up domains (Cluster.placement_text)
    seq_len: int = Field(gt=0)
    layout: LayoutRecord
    stages: list[StageRecord]
    step_time_s: float
    # the measured step times this prediction is consistent with (planner/error_bands.py: the 90% conformal band
    # of the residuals of published runs of its class, fitted on one half, coverage counted on the other); []
    # where none is known
    step_time_band_s: list[float] = []
    band_basis: str = ""
    # per-rank shapes outside the range the published runs measured (planner/region.py): where it extrapolates
    outside_measured: list[str] = []
    # where it extrapolates: the best plan the search finds with the per-rank shapes kept inside that range
    inside_measured: Alternative | None = None
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
    capture_front_end: str = "torch.fx"   # how the model was read: symbolic fx trace, or recorded eager run on meta
    capture_notes: list[str] = []         # what capture could not see or bill exactly, with the effect
    mtp_layers: int = Field(default=0, ge=0)   # multi-token prediction modules: the last blocks are their layers
    ep_imbalance: float = Field(default=1.0, ge=1.0)   # the busiest expert rank's routed tokens over the mean, as given

    @model_validator(mode="after")
    def _layout_matches(self):
        problems = plan_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def to_layout(self) -> Layout:
        """The runnable layout: degrees plus the stage partition and per-layer recomputation."""
        return self.layout.as_layout(stage_layers=tuple(len(stage.layers) for stage in self.stages),
                                     layer_recompute=tuple(Recompute(r) for stage in self.stages
                                                           for r in stage.recompute))

    def report(self, goodput: dict | None = None) -> dict:
        """What `--json` prints: the plan file's object plus derived keys (REPORT_KEYS) and the timings,
        which `load` drops again, so the JSON of `plan` and `evaluate` is a plan file too."""
        data = self.model_dump(mode="json")
        data["layout"]["recompute_per_layer"] = [r for s in self.stages for r in s.recompute]
        data["peak_memory_bytes_per_stage"] = [m.total_bytes for m in self.memory]
        if self.search is not None:
            data["search"].update(wall_s=self.search.wall_s, cpu_s=self.search.cpu_s)
        if goodput:
            data["goodput"] = goodput
        return data

    def save(self, path: str | Path) -> None:
        path = Path(path)
        data = self.model_dump(mode="json")
        text = json.dumps(data, indent=2, sort_keys=False) + "\n" if path.suffix == ".json" \
            else yaml.safe_dump(data, sort_keys=False)
        write_no_follow(path, text.encode())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        text = read_bounded_text(path, "plan file written by 'planner plan --out'", MAX_PLAN_FILE_BYTES)
        data = parse_json(text, str(path)) if path.suffix == ".json" else parse_yaml(text, str(path))
        if isinstance(data, dict):   # the JSON printed by --json: its derived keys go
            data = {k: v for k, v in data.items() if k not in REPORT_KEYS}
            if isinstance(data.get("layout"), dict):
                data["layout"] = {k: v for k, v in data["layout"].items() if k not in REPORT_KEYS}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise format_pydantic_error(str(path), exc, "plan") from None


def stage_records(estimate: Estimate, block_names: tuple[str, ...], first: tuple[str, ...] = (),
                  last: tuple[str, ...] = ()) -> list[StageRecord]:
    records, start = [], 0
    chunks = len(estimate.stage_layers)
    for j, count in enumerate(estimate.stage_layers):
        blocks = list(range(start, start + count))
        modules = (list(first) if j == 0 else []) + [block_names[b] for b in blocks] + \
            (list(last) if j == chunks - 1 else [])
        records.append(StageRecord(index=j, pipeline_rank=estimate.layout.chunk_rank(j), layers=blocks, modules=modules,
                                   recompute=[estimate.layer_recompute[b].value for b in blocks]))
        start += count
    return records


def memory_records(estimate: Estimate) -> list[MemoryRecord]:
    return [MemoryRecord(stage=m.stage, total_bytes=m.total, capacity_bytes=m.capacity, parts=m.parts())
            for m in estimate.stage_memory]
