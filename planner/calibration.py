"""Close the loop: a job's telemetry (runtime/telemetry.py, `python -m runtime.train --telemetry DIR`) against its
plan's prediction, part by part, and the device profile's efficiencies refitted from it.

A step waits for its slowest rank, so each part is the maximum over ranks of one step, then the median
over the steps after the first few (allocations, first-call costs). Two figures are refitted, in order:

* `hbm_bandwidth_fraction` (or the bandwidth past 1), scaled by predicted over measured optimizer step
  (AdamW is memory-bound), from ZeRO-0 runs only: a sharded optimizer's step includes an all-gather;
* `gemm.sustained_fraction` (or the peak past a fraction of 1), so that the job's own plan, predicted
  again under the profile with the bandwidth refit, takes the measured compute: the measured
  forward+backward less the exposed communication and pipeline waits the job measured inside it (by kind,
  on the steps its communication recorder ran; the plan's predicted ones where it did not). The plan is
  re-predicted until it agrees, because compute also holds memory-bound ops (norms, activations) that the
  GEMM rate does not scale and the bandwidth refit does: one ratio on the GEMM rate would undo neither.
  Telemetry without its plan (an older header, or a model that is not built in) gets the one-ratio refit,
  and a note that says so.

The refit profile is written to a file of the user's (`--out`): the shipped profiles are fitted on the
published runs only (benchmarks/calibrate.py), never on a job's own telemetry.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from hardware_profiles.errors import UserInputError
from hardware_profiles.loader import device_profile_path, load_device, read_yaml_mapping
from hardware_profiles.parsing import parse_json, read_bounded_text

from .output_paths import check_plan_file, write_no_follow

MEASURED_PARTS = ("step_s", "forward_backward_s", "checks_s", "optimizer_s", "checkpoint_blocking_s")
# inside forward_backward_s, on the steps the runtime's communication recorder ran (runtime/comm_telemetry.py),
# named as the plan's breakdown names them
EXPOSED_PARTS = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "zero_comm_s", "pipeline_bubble_s", "dp_comm_s",
                 "other_comm_s")
PIPELINE_WAIT = ("pipeline_bubble_s", "pp_comm_s")   # measured as one: a stage's waits for its neighbours
COMPUTE_PARTS = ("compute_s", "recompute_s")
MEASURED_COMPUTE = "compute_s"   # measured: forward+backward less the exposed parts, on the steps that split them
OPTIMIZER_PART = "optimizer_s"
REFIT_ROUNDS = 8          # re-predictions of the plan; each multiplies the error by the memory-bound share
MAX_TELEMETRY_BYTES = 256 << 20   # a rank writes a line of about 300 bytes a step: 256 MB is 800,000 steps
REFIT_TOLERANCE = 1e-3    # re-predicted compute within 0.1% of the measured


@dataclass(frozen=True)
class PartComparison:
    name: str
    predicted_s: float | None   # None: the plan does not predict it
    measured_s: float


@dataclass(frozen=True)
class Refit:
    field: str      # a profile field, or 'peak_tflops x' / 'hbm_bandwidth_gbytes_per_s x': a scale on it
    old: float
    new: float


@dataclass(frozen=True)
class Calibration:
    directory: str
    header: dict
    ranks: int
    steps_used: tuple[int, ...]
    parts: tuple[PartComparison, ...]
    refits: tuple[Refit, ...]
    notes: tuple[str, ...]


def read_telemetry(directory: str) -> tuple[dict, dict[int, dict[int, dict]]]:
    """The header every rank wrote and the records: step -> rank -> record."""
    files = sorted(Path(directory).glob("rank-*.jsonl")) if Path(directory).is_dir() else []
    if not files:
        raise UserInputError("no rank-R.jsonl files", source=directory,
                             expected="a directory written by 'python -m runtime.train --telemetry DIR'")
    header, steps = None, {}
    for path in files:
        for number, line in enumerate(read_bounded_text(path, "telemetry file", MAX_TELEMETRY_BYTES).splitlines(),
                                       start=1):
            record = _parse_line(path, number, line)
            if "header" in record:
                if header is not None and record["header"] != header:
                    raise UserInputError("its header differs from another rank's", source=f"{path}:{number}",
                                         expected="the telemetry of one job")
                header = record["header"]
                continue
            steps.setdefault(record["step"], {})[record["rank"]] = record
    if header is None:
        raise UserInputError("no header line", source=directory, expected="a telemetry directory of one job")
    return header, steps


def _parse_line(path: Path, number: int, line: str) -> dict:
    where = f"{path}:{number}"
    record = parse_json(line, where)
    if not isinstance(record, dict):
        raise UserInputError("not an object", source=where, expected="one JSON object per line")
    if "header" in record:
        if not isinstance(record["header"], dict) or not isinstance(record["header"].get("predicted"), dict):
            raise UserInputError("a header without 'predicted'", source=where, field="header")
        return record
    for key in ("step", "rank"):
        if not isinstance(record.get(key), int):
            raise UserInputError(f"'{key}' missing or not a whole number", source=where, field=key)
    for key in (*MEASURED_PARTS, *(part for part in EXPOSED_PARTS if part in record)):
        value = record.get(key)
        if not isinstance(value, (int, float)) or value < 0 or value != value:
            raise UserInputError(f"'{key}' missing or not seconds >= 0", source=where, field=key)
    return record


def calibrate(directory: str, warmup_steps: int = 2, model: str | None = None) -> Calibration:
    """Measured step parts against the plan's, and the device refitted from them. `model`: the model as the
    user names it (a `file.py:factory` is imported only from here, never because a telemetry file names it)."""
    header, steps = read_telemetry(directory)
    header = {**header, "model_source": model or data_model_source(header, directory)}
    ranks = max(len(by_rank) for by_rank in steps.values())
    complete = sorted(step for step, by_rank in steps.items() if len(by_rank) == ranks)
    used = tuple(complete[warmup_steps:])
    if not used:
        raise UserInputError(f"{len(complete)} complete steps, {warmup_steps} of them warm-up", source=directory,
                             expected="more steps than --warmup-steps")
    measured = {part: statistics.median(max(r[part] for r in steps[s].values()) for s in used)
                for part in MEASURED_PARTS}
    measured.update(_exposed_by_kind(steps, used))
    predicted = header["predicted"]
    parts = tuple(PartComparison(name, _predicted(name, header), measured[name])
                  for name in (*MEASURED_PARTS, *EXPOSED_PARTS, MEASURED_COMPUTE) if name in measured)
    notes = [] if predicted else ["the job ran a --layout, not a plan: nothing predicted, nothing refitted"]
    refits = _refits(header, predicted, measured, notes) if predicted else ()
    return Calibration(directory, header, ranks, used, parts, refits, tuple(notes))


def _exposed_by_kind(steps: dict, used: tuple[int, ...]) -> dict[str, float]:
    """Each kind's exposed seconds on the steps that measured them: per step the slowest rank's (the step
    waits for it), then the median. A pipeline's measured waits differ by stage (the first stage waits on
    the last one's backward, the last on the first's forward): the stage that waited longest is the step's."""
    recorded = [s for s in used if all(EXPOSED_PARTS[0] in r for r in steps[s].values())]
    if not recorded:
        return {}
    by_kind = {part: statistics.median(max(r.get(part, 0.0) for r in steps[s].values()) for s in recorded)
               for part in EXPOSED_PARTS}
    # compute: the step's forward+backward (every step's: the recorder slows the steps it runs on) less what the
    # step spent beyond its slowest rank's own compute (that rank's forward+backward less what it waited for)
    beyond_compute = statistics.median(
        max(r["forward_backward_s"] for r in steps[s].values())
        - max(r["forward_backward_s"] - sum(r.get(part, 0.0) for part in EXPOSED_PARTS) for r in steps[s].values())
        for s in recorded)
    forward_backward = statistics.median(max(r["forward_backward_s"] for r in steps[s].values()) for s in used)
    by_kind[MEASURED_COMPUTE] = forward_backward - beyond_compute
    return by_kind


def _predicted(part: str, header: dict) -> float | None:
    predicted, step = header["predicted"], header.get("predicted_step_s")
    if not predicted or step is None:
        return None
    if part == PIPELINE_WAIT[0]:
        return sum(predicted.get(name, 0.0) for name in PIPELINE_WAIT)
    if part in EXPOSED_PARTS:
        return predicted.get(part)   # None for other_comm_s: the plan has no such part
    return {"step_s": step, "forward_backward_s": step - predicted.get(OPTIMIZER_PART, 0.0),
            "optimizer_s": predicted.get(OPTIMIZER_PART, 0.0),
            MEASURED_COMPUTE: sum(predicted.get(name, 0.0) for name in COMPUTE_PARTS)}.get(part)


def _refits(header: dict, predicted: dict, measured: dict, notes: list[str]) -> tuple[Refit, ...]:
    device = load_device(header["device"])
    refits: list[Refit] = []
    sharded_optimizer = not re.search(r"(^|,)zero=0(,|$)", header.get("layout", ""))
    if sharded_optimizer:   # ZeRO-1/2/3: the optimizer step carries the parameter all-gather after it
        notes.append("optimizer not refitted: under ZeRO-1/2/3 the measured optimizer step includes the "
                     "parameters' all-gather (refit on a zero=0 run)")
    elif predicted.get(OPTIMIZER_PART) and measured["optimizer_s"] > 0:
        refits += _fraction_then_peak("hbm_bandwidth_fraction", device.hbm_bandwidth_fraction,
                                      "hbm_bandwidth_gbytes_per_s", predicted[OPTIMIZER_PART] / measured["optimizer_s"])
    compute = sum(predicted.get(part, 0.0) for part in COMPUTE_PARTS)
    if MEASURED_COMPUTE in measured:   # the job measured its exposed communication and waits: compute is the rest
        measured_compute = measured[MEASURED_COMPUTE]
        exposed, which = measured["forward_backward_s"] - measured_compute, "measured"
    else:
        exposed = sum(seconds for part, seconds in predicted.items() if part not in (*COMPUTE_PARTS, OPTIMIZER_PART))
        measured_compute, which = measured["forward_backward_s"] - exposed, "predicted"
        notes.append("the telemetry carries no exposed communication by kind (--telemetry-comm-every 0): compute "
                     "is the measured forward+backward less the communication and bubble the plan predicts")
    if not (measured_compute > 0 and compute > 0):
        notes.append(f"compute not refitted: the measured forward+backward ({measured['forward_backward_s']:.4f} s) "
                     f"is not above the exposed communication {which} inside it ({exposed:.4f} s)")
        return tuple(refits)
    return tuple(refits) + _compute_refit(header, device, refits, compute / measured_compute, measured_compute, notes)


def _compute_refit(header: dict, device, earlier: list[Refit], speedup: float, measured_compute: float,
                   notes: list[str]) -> tuple[Refit, ...]:
    """The GEMM rate at which the job's plan, re-predicted with the earlier refits, takes the measured compute."""
    def at(scale: float) -> list[Refit]:
        return _fraction_then_peak("gemm.sustained_fraction", device.gemm.sustained_fraction, "peak_tflops", scale)
    plan = _plan_of(header)
    try:
        if plan is not None:
            for _ in range(REFIT_ROUNDS):
                again = _predicted_compute(plan, header, [*earlier, *at(speedup)])
                ratio = again / measured_compute
                if abs(ratio - 1) <= REFIT_TOLERANCE:
                    return tuple(at(speedup))
                speedup *= ratio
            notes.append(f"compute refit did not settle within {REFIT_ROUNDS} rounds (the plan's memory-bound ops "
                         "alone take about the measured compute): the last round is written")
            return tuple(at(speedup))
        why = "the telemetry carries no plan"
    except UserInputError as exc:   # the model cannot be captured here (moved, or not importable)
        why = f"the plan could not be predicted again: {str(exc).splitlines()[0]}"
    notes.append(f"compute refitted by one ratio ({why}): the memory-bound share of compute is scaled with "
                 "the GEMM rate")
    return tuple(at(speedup))


def _plan_of(header: dict):
    """The job's plan from the telemetry header (None for telemetry written without one)."""
    from pydantic import ValidationError

    from .plans import Plan
    if not isinstance(header.get("plan"), dict):
        return None
    try:
        return Plan.model_validate(header["plan"])
    except ValidationError as exc:
        raise UserInputError(f"not a plan ({exc.error_count()} problems, the first: {exc.errors()[0]['msg']})",
                             field="header.plan", expected="the plan the job ran, as the runtime writes it") from None


def data_model_source(header: dict, directory: str) -> str:
    """The model the telemetry names, where it is data (a built-in name, a model YAML or a config.json): a
    telemetry file is data, and names no code for the planner to run."""
    source = str(header.get("model_source") or header.get("model") or "")
    if source.endswith(".py") or ".py:" in source:
        raise UserInputError(f"the telemetry names the Python model {source}, and calibrate imports no code that "
                             "a data file names", source=directory, field="header.model_source",
                             expected=f"--model {source} if you trust that file, or a built-in name, model YAML "
                             "or config.json")
    return source


def _predicted_compute(plan, header: dict, refits: list[Refit]) -> float:
    """Compute and recomputation of the job's plan predicted through the public API under the refitted profile."""
    import tempfile

    from .api import evaluate
    device = header["device"]
    with tempfile.TemporaryDirectory() as scratch:
        profile = Path(scratch) / f"{Path(device).stem}.yaml"
        profile.write_text(yaml.safe_dump(_refitted_profile(device, refits), sort_keys=False))
        again = evaluate(header["model_source"] or plan.model, device=str(profile), num_devices=plan.num_devices,
                         devices_per_node=plan.devices_per_node, layout=plan.to_layout(),
                         global_batch=plan.layout.gbs, seq_len=plan.seq_len, precision=str(plan.layout.precision),
                         stack=plan.stack)
    return sum(again.breakdown.get(part, 0.0) for part in COMPUTE_PARTS)


def _fraction_then_peak(fraction: str, old: float, peak: str, speedup: float) -> list[Refit]:
    """Scale a fraction of peak by the measured speed-up; what a fraction cannot exceed (1) raises the peak."""
    wanted = old * speedup
    if wanted <= 1.0:
        return [Refit(fraction, old, wanted)]
    return [Refit(fraction, old, 1.0), Refit(f"{peak} x", 1.0, wanted)]   # the device is faster than its peak


def _refitted_profile(device: str, refits) -> dict:
    """The job's device profile's YAML data (built-in or the user's file) with the refits applied."""
    data = read_yaml_mapping(device_profile_path(device))
    for refit in refits:
        if refit.field == "peak_tflops x":
            data["peak_tflops"] = {dtype: value * refit.new for dtype, value in data["peak_tflops"].items()
                                   if value is not None}
        elif refit.field == "hbm_bandwidth_gbytes_per_s x":
            data["hbm_bandwidth_gbytes_per_s"] *= refit.new
        elif refit.field.startswith("gemm."):
            data["gemm"][refit.field.split(".", 1)[1]] = refit.new
        else:
            data[refit.field] = refit.new
    return data


def write_device_profile(calibration: Calibration, out_path: str) -> Path:
    """The job's device profile with the refitted figures, checked by loading it back."""
    device = calibration.header["device"]
    path = check_plan_file(out_path)   # a .yaml or .json file, not a link, FIFO or directory
    write_no_follow(path, (f"# {device} refitted by 'planner calibrate --telemetry {calibration.directory}'\n"
                           + yaml.safe_dump(_refitted_profile(device, calibration.refits), sort_keys=False)).encode())
    load_device(str(path))   # a refit that breaks the schema is said here, naming the file
    return path
