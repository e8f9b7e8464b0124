"""The runs file's Ascend rows: which can be mapped to a 910B/910C profile and predicted, with what their
source leaves open read from the recipe it names, and why the others cannot. Never fitted: the device
profiles keep msmodeling's default efficiencies (no Ascend row has a global batch, so none is calibrated).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from hardware_profiles.errors import UserInputError
from planner.api import evaluate

from benchmarks.published import DEFAULT_RUNS, _model, missing_model_fields

ASCEND_DEVICE_PREFIXES = ("other:ascend", "other:atlas")


@dataclass(frozen=True)
class AscendReading:
    """How one Ascend row is predicted: the profile it maps to and what a user of its recipe would pass."""
    run_id: str
    cluster: str                # cluster profile (its device profile named inside)
    num_devices: int
    layout: str                 # the row's degrees, and the recipe's micro-batch, ZeRO and recomputation
    global_batch: int
    seq_len: int
    stack: str
    recipe: str                 # where the fields the row leaves open come from
    uncertain: str              # what the mapping assumes


READINGS = (
    AscendReading(
        run_id="torchtitan-npu-deepseek-v3-671b", cluster="atlas-a3-superpod-dies", num_devices=128,
        layout="tp=4,pp=1,dp=32,cp=1,ep=128,etp=1,vp=1,mbs=1,zero=3,recompute=full,sp=true",
        global_batch=1024, seq_len=4096, stack="torchtitan-npu",
        recipe="torchtitan-npu `torchtitan_npu/models/deepseek_v3/train_configs/deepseek_v3_671b_61layers_4k_128die"
               ".toml` @ffab7988, the repository's only DeepSeek-V3 recipe on 128 dies and the one whose degrees the "
               "row's 'FSDP32 + TP4 + EP128' names: flavour 671B_debug_128die (61 layers, 3 dense, 256 experts: the "
               "full model), seq_len 4096, local_batch_size 1, global_batch_size 1024, FSDP reshard after forward "
               "always (ZeRO-3), full activation checkpointing, swap_optimizer with swap_optimizer_times 16",
        uncertain="'tokens/p/s' read as tokens per second per process, one process per die (the recipe's 128 ranks "
                  "on '64 cards'); the 910C die profile keeps msmodeling's default efficiencies (compute 0.7, "
                  "memory 0.6, comm 0.7), uncalibrated; the recipe file may have changed after the figure was "
                  "measured; the expert all-to-all uses DeepEP-Ascend's measured bandwidth at the group's size "
                  "(its kernels, not the recipe's npu_permute path); routing taken as balanced "
                  "(moe_force_load_balance is off in the recipe); the host link that the swapped optimizer "
                  "crosses is assumed PCIe 5.0 x16 per package"),
)


@dataclass(frozen=True)
class AscendRow:
    run_id: str
    device: str
    reading: AscendReading | None
    measured_tokens_per_device_s: float | None
    predicted_tokens_per_device_s: float | None
    peak_gb: float | None
    usable_gb: float | None
    why_not: str


def _row_model(row: dict, seq_len: int):
    return _model({**row, "model": {**row["model"], "seq_length": row["model"]["seq_length"] or seq_len}})


def ascend_rows(runs_path: Path | str = DEFAULT_RUNS) -> list[AscendRow]:
    readings = {reading.run_id: reading for reading in READINGS}
    rows = []
    for row in yaml.safe_load(Path(runs_path).read_text()):
        device = row["hardware"]["device"]
        if not device.startswith(ASCEND_DEVICE_PREFIXES):
            continue
        reading = readings.get(row["id"])
        if reading is None:
            missing = missing_model_fields(row)
            why = (f"model fields not given: {', '.join(missing)}" if missing
                   else "no recipe found that gives its global batch, sequence and device count")
            rows.append(AscendRow(row["id"], device, None, row["measured"].get("tokens_per_s_per_device"), None,
                                  None, None, why))
            continue
        try:
            plan = evaluate(_row_model(row, reading.seq_len), reading.cluster, reading.layout,
                            num_devices=reading.num_devices, global_batch=reading.global_batch,
                            seq_len=reading.seq_len, stack=reading.stack, time_limit_s=20)
        except UserInputError as exc:
            rows.append(AscendRow(row["id"], device, reading, row["measured"].get("tokens_per_s_per_device"),
                                  None, None, None, f"not predictable: {exc}"))
            continue
        rows.append(AscendRow(row["id"], device, reading, row["measured"]["tokens_per_s_per_device"],
                              plan.tokens_per_s / reading.num_devices, plan.peak_memory_bytes / 1e9,
                              min(m.capacity_bytes for m in plan.memory) / 1e9, ""))
    return rows


def report_lines(rows: list[AscendRow]) -> list[str]:
    lines = ["", "## Ascend rows", "",
             "Rows whose device is an Ascend NPU, mapped to a profile where the row's source and the recipe it "
             "names allow, and predicted through `planner.evaluate` (never fitted: no Ascend row has a global "
             "batch, so none enters the calibration or the MAPE above); higher is faster:", "",
             "| run | source device | profile, devices | layout | stack | measured tokens/s per device | "
             "predicted | error | peak / usable GB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.predicted_tokens_per_device_s is None:
            continue
        r = row.reading
        lines.append(f"| {row.run_id} | {row.device} | {r.cluster}, {r.num_devices} | {r.layout}, gbs {r.global_batch}, "
                     f"seq {r.seq_len} | {r.stack} | {row.measured_tokens_per_device_s:,.0f} | "
                     f"{row.predicted_tokens_per_device_s:,.0f} | "
                     f"{row.predicted_tokens_per_device_s / row.measured_tokens_per_device_s - 1:+.1%} | "
                     f"{row.peak_gb:.1f} / {row.usable_gb:.1f} |")
    for row in rows:
        if row.reading and row.predicted_tokens_per_device_s is not None:
            lines += ["", f"- **{row.run_id}**: fields the row leaves open, from {row.reading.recipe}. "
                          f"Uncertain: {row.reading.uncertain}."]
    lines += [""] + [f"- {row.run_id} ({row.device}): not predicted: {row.why_not}" for row in rows
                     if row.predicted_tokens_per_device_s is None]
    return lines
