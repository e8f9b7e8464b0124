"""Fit the two calibrated compute figures of each device profile on published runs, and report the
error on the runs left out of the fit.

For each device with published runs: `gemm.sustained_fraction` (share of the measured MAMF kept inside a
training step) and `gemm.half_work_gflop` (how fast GEMM efficiency saturates with size), the latter
taken from GPU measurements where the silicon has them (`MEASURED_GEMMS`, docs/gpu-validation.md), as
is FP8's own scale there (`gemm.fp8_half_work_gflop`; elsewhere FP8 GEMMs share the fitted one). Runs are
split alternately (sorted by id) into a fitting half and a held-out half. Layouts (partition,
recomputation, unknown fields) come from one search with the current profiles and stay fixed while
the figures are fitted by grid search on mean absolute percentage error, each run's error capped at 25%. `--write` updates the YAML
profiles in place (their comments kept).

    .venv/bin/python benchmarks/calibrate.py [--write]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from cost_models.step_time import estimate  # noqa: E402
from hardware_profiles.errors import UserInputError  # noqa: E402
from hardware_profiles.loader import DEVICE_DIR  # noqa: E402
from planner.api import capture_for  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, load_runs, predict, run_stack  # noqa: E402
from benchmarks.gpu_compare import DEFAULT_RESULTS, HALF_WORK_GRID_GFLOP, measured_half_work  # noqa: E402

# profiles without published runs of their own that share the fitted GPU's silicon and software
SAME_SILICON = {"a100-80g": ("a100-40g",), "h100-sxm": ("h200", "h800"), "b200": ("gb200",)}
OUTLIER_CAP = 0.25   # the accuracy target's bound on any one run
MIN_RUNS_FOR_TWO = 3  # fitting runs needed to fit the saturation scale as well
SUSTAINED = [round(0.40 + 0.01 * i, 2) for i in range(61)]
# GEMM saturation measured on a GPU of the same silicon (benchmarks/gpu_measure.py): measured, not fitted
MEASURED_GEMMS = {"h100-sxm": DEFAULT_RESULTS}


def split_runs(runs) -> dict[str, tuple[list, list]]:
    """Per device, the runs sorted by id and split alternately into the fitting half and the held-out half
    (before any prediction, so that a run the planner cannot predict moves no other run across)."""
    by_device: dict[str, list] = {}
    for run in sorted(runs, key=lambda r: r.id):
        by_device.setdefault(run.cluster.device.name, []).append(run)
    return {device: (group[0::2], group[1::2]) for device, group in by_device.items()}


def fixed_layouts(runs, time_limit_s):
    out = []
    for run in runs:
        try:
            result = predict(run, time_limit_s)
        except UserInputError:
            continue
        out.append((run, result.to_layout()))
    return out


def errors_with(items, sustained: float, half: float) -> list[float]:
    errs = []
    for run, layout in items:
        gemm = run.cluster.device.gemm.model_copy(update={"sustained_fraction": sustained, "half_work_gflop": half})
        device = run.cluster.device.model_copy(update={"gemm": gemm})
        cluster = run.cluster.model_copy(update={"device": device})
        stack = run_stack(run.id)
        predicted = estimate(capture_for(run.model, run.seq_len, (), stack).costs_record, cluster, layout,
                             stack).step_time_s
        errs.append(abs(predicted / run.measured_step_s - 1))
    return errs


def fit(items, measured_half: float | None = None):
    """Grid search on the mean error with each run's error capped at OUTLIER_CAP: a run the model misses
    for reasons it does not represent (docs/accuracy.md) must not drag a figure every run shares. Fewer
    runs than MIN_RUNS_FOR_TWO fit the sustained fraction only (two figures on one run are underdetermined);
    a saturation scale measured on the silicon is kept, not fitted."""
    best = None
    halves = HALF_WORK_GRID_GFLOP if len(items) >= MIN_RUNS_FOR_TWO else HALF_WORK_GRID_GFLOP[:1]
    for half in ([measured_half] if measured_half is not None else halves):
        score, sustained = fit_sustained(items, half)
        if best is None or score < best[0]:
            best = (score, sustained, half)
    return best


def fit_sustained(items, half: float) -> tuple[float, float]:
    """(capped mean error, sustained fraction) of the best sustained fraction at a saturation scale."""
    return min((statistics.mean(min(e, OUTLIER_CAP) for e in errors_with(items, sustained, half)), sustained)
               for sustained in SUSTAINED)


def fit_silicon_half(fitting_by_device: dict[str, list]) -> float:
    """The GEMM saturation scale shared by devices of one silicon (B200 alone and in GB200 NVL72: the same
    GPU and kernels), fitted on their fitting runs together, each device keeping its own sustained fraction
    (clocks and power differ): the scale is the kernels', and one device's few runs cannot fix it alone."""
    items = [item for group in fitting_by_device.values() for item in group]
    if len(items) < MIN_RUNS_FOR_TWO:
        return HALF_WORK_GRID_GFLOP[0]
    def pooled(half: float) -> float:
        errors = [fit_sustained(group, half)[0] * len(group) for group in fitting_by_device.values() if group]
        return sum(errors) / len(items)
    return min(HALF_WORK_GRID_GFLOP, key=pooled)


def write_profile(device: str, sustained: float, half: float, fp8_half: float | None) -> None:
    path = DEVICE_DIR / f"{device}.yaml"
    text = path.read_text()
    text = re.sub(r"(  sustained_fraction: )[0-9.]+", rf"\g<1>{sustained}", text, count=1)
    text = re.sub(r"(  half_work_gflop: )[0-9.]+", rf"\g<1>{half}", text, count=1)
    if fp8_half is not None:   # measured apart: the profile's line is rewritten, never added
        text = re.sub(r"(  fp8_half_work_gflop: )[0-9.]+", rf"\g<1>{fp8_half}", text, count=1)
    path.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    parser.add_argument("--write", action="store_true", help="update the device YAML files")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args(argv)
    runs, _ = load_runs(args.runs)
    halves = split_runs(runs)
    fitted = {device: (fixed_layouts(fitting_runs, args.time_limit), fixed_layouts(held_runs, args.time_limit))
              for device, (fitting_runs, held_runs) in halves.items()}
    silicon_half = {}
    for device, others in SAME_SILICON.items():   # devices of one silicon that all have runs share the scale
        members = [d for d in (device, *others) if d in fitted and d not in MEASURED_GEMMS]
        if len(members) > 1:
            shared = fit_silicon_half({d: fitted[d][0] for d in members})
            silicon_half.update({d: shared for d in members})
    for device, (fitting_runs, held_runs) in sorted(halves.items()):
        device_runs = fitting_runs + held_runs
        fitting, held_out = fitted[device]
        measured = MEASURED_GEMMS.get(device)
        results = json.loads(measured.read_text()) if measured else None
        profile = device_runs[0].cluster.device
        measured_half = measured_half_work(results, profile) if measured else silicon_half.get(device)
        # FP8's own scale, where measured (the profile's, read by every run's prediction, must be it already)
        fp8_half = measured_half_work(results, profile, "fp8") if measured else None
        if fp8_half is not None and profile.gemm.fp8_half_work_gflop != fp8_half:
            print(f"{device}: the profile's fp8_half_work_gflop {profile.gemm.fp8_half_work_gflop} is not the "
                  f"measured {fp8_half}: set it, then fit", file=sys.stderr)
            return 1
        score, sustained, half = fit(fitting, measured_half)
        held = errors_with(held_out, sustained, half) if held_out else []
        print(f"{device}: sustained_fraction={sustained} half_work_gflop={half}"
              f"{f' fp8_half_work_gflop={fp8_half}' if fp8_half is not None else ''}"
              f"{' (measured)' if measured else ' (silicon)' if device in silicon_half else ''}  fit MAPE {score:.1%} on "
              f"{len(fitting)} runs; held-out MAPE "
              f"{(statistics.mean(held) if held else float('nan')):.1%} on {len(held)} runs "
              f"({', '.join(run.id for run, _ in held_out)})")
        if args.write:
            # a same-silicon device takes this fit only where it has no runs of its own to fit
            for name in (device, *(d for d in SAME_SILICON.get(device, ()) if d not in halves)):
                write_profile(name, sustained, half, fp8_half)
    return 0


if __name__ == "__main__":
    sys.exit(main())
