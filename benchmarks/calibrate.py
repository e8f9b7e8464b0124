"""Fit the two calibrated compute figures of each device profile on published runs, and report the
error on the runs left out of the fit; first, the clusters' all-to-all figure (calibrate_all_to_all.py).

For each device with published runs: `gemm.sustained_fraction` (share of the measured MAMF kept inside a
training step) and `gemm.half_work_gflop` (how fast GEMM efficiency saturates with size), the latter
taken from GPU measurements where the silicon has them (`MEASURED_GEMMS`, docs/gpu-validation.md), as
is FP8's own scale there (`gemm.fp8_half_work_gflop`); devices of one silicon without a measurement (B200,
GB200) fit both scales together. Runs are
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from cost_models.step_time import estimate  # noqa: E402
from hardware_profiles.errors import UserInputError  # noqa: E402
from hardware_profiles.loader import DEVICE_DIR  # noqa: E402
from planner.job import capture_for  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, load_runs, predict, run_stack  # noqa: E402
from benchmarks import calibrate_all_to_all as all_to_all  # noqa: E402
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


@dataclass(frozen=True)
class Scales:
    """A device's GEMM saturation scales (GFLOP): BF16's, and FP8's where it has its own (None: BF16's)."""
    bf16: float
    fp8: float | None = None

    def text(self) -> str:
        return f"half_work_gflop={self.bf16}" + (f" fp8_half_work_gflop={self.fp8}" if self.fp8 is not None else "")


def errors_with(items, sustained: float, scales: Scales) -> list[float]:
    errs = []
    for run, layout in items:
        gemm = run.cluster.device.gemm.model_copy(update={"sustained_fraction": sustained, "half_work_gflop": scales.bf16,
                                                          "fp8_half_work_gflop": scales.fp8})
        device = run.cluster.device.model_copy(update={"gemm": gemm})
        cluster = run.cluster.model_copy(update={"device": device})
        stack = run_stack(run.id)
        predicted = estimate(capture_for(run.model, run.seq_len, (), stack).costs_record, cluster, layout,
                             stack).step_time_s
        errs.append(abs(predicted / run.measured_step_s - 1))
    return errs


def fit(items, fixed: Scales | None = None) -> tuple[float, float, Scales]:
    """(capped mean error, sustained fraction, scales): grid search on the mean error with each run's error
    capped at OUTLIER_CAP: a run the model misses for reasons it does not represent (docs/accuracy.md) must
    not drag a figure every run shares. Fewer runs than MIN_RUNS_FOR_TWO fit the sustained fraction only (two
    figures on one run are underdetermined); scales measured on the silicon or fitted for it are kept."""
    if fixed is not None:
        candidates = [fixed]
    else:
        halves = HALF_WORK_GRID_GFLOP if len(items) >= MIN_RUNS_FOR_TWO else HALF_WORK_GRID_GFLOP[:1]
        candidates = [Scales(half) for half in halves]
    return min(((*fit_sustained(items, scales), scales) for scales in candidates), key=lambda fitted: fitted[0])


def fit_sustained(items, scales: Scales) -> tuple[float, float]:
    """(capped mean error, sustained fraction) of the best sustained fraction at given saturation scales."""
    return min((statistics.mean(min(e, OUTLIER_CAP) for e in errors_with(items, sustained, scales)), sustained)
               for sustained in SUSTAINED)


def fit_silicon_scales(fitting_by_device: dict[str, list]) -> Scales:
    """The GEMM saturation scales shared by devices of one silicon (B200 alone and in GB200 NVL72: the same
    GPU and kernels), BF16's and FP8's, fitted on their fitting runs together, each device keeping its own
    sustained fraction (clocks and power differ): the scales are the kernels', and one device's few runs
    cannot fix them alone. FP8's is at least BF16's: no measured FP8 GEMM saturates earlier (Hopper's:
    docs/gpu-validation.md)."""
    items = [item for group in fitting_by_device.values() for item in group]
    if len(items) < MIN_RUNS_FOR_TWO:
        return Scales(HALF_WORK_GRID_GFLOP[0])
    def pooled(scales: Scales) -> float:
        errors = [fit_sustained(group, scales)[0] * len(group) for group in fitting_by_device.values() if group]
        return sum(errors) / len(items)
    return min((Scales(bf16, fp8) for bf16 in HALF_WORK_GRID_GFLOP for fp8 in HALF_WORK_GRID_GFLOP if fp8 >= bf16),
               key=pooled)


def write_profile(device: str, sustained: float, scales: Scales) -> None:
    path = DEVICE_DIR / f"{device}.yaml"
    text = path.read_text()
    text = re.sub(r"(  sustained_fraction: )[0-9.]+", rf"\g<1>{sustained}", text, count=1)
    text = re.sub(r"(  half_work_gflop: )[0-9.]+", rf"\g<1>{scales.bf16}", text, count=1)
    if scales.fp8 is not None:   # its own: the profile's line is rewritten, never added
        text = re.sub(r"(  fp8_half_work_gflop: )[0-9.]+", rf"\g<1>{scales.fp8}", text, count=1)
    path.write_text(text)


@dataclass(frozen=True)
class DeviceFit:
    """One device's fitted GEMM figures, and how well they predict its two halves of the runs."""
    sustained: float
    scales: Scales
    fit_error: float               # capped mean error on the fitting half
    fit_runs: int                  # the fitting half's runs the planner could predict
    held_errors: tuple[float, ...]  # each held-out run's error
    held_ids: tuple[str, ...]
    measured: bool                 # the scales measured on the silicon (MEASURED_GEMMS)
    shared: bool                   # the scales fitted with another device of the silicon (SAME_SILICON)


def fit_devices(runs, time_limit_s: float, write_all_to_all: bool = False) -> dict[str, DeviceFit]:
    """Per device, the figures the committed procedure fits: the clusters' all-to-all figure first
    (benchmarks/calibrate_all_to_all.py), then the saturation scales (measured, shared by a silicon, or fitted)
    and the sustained fraction on the fitting half."""
    halves = split_runs(runs)
    fitted = {device: (fixed_layouts(fitting_runs, time_limit_s), fixed_layouts(held_runs, time_limit_s))
              for device, (fitting_runs, held_runs) in halves.items()}
    # the GEMM figures are fitted on the MoE runs' predictions with the all-to-all figure
    fractions = all_to_all.calibrate([item for pair in fitted.values() for half in pair for item in half],
                                     write_all_to_all)
    fitted = {device: tuple(all_to_all.with_fitted(half, fractions) for half in pair)
              for device, pair in fitted.items()}
    silicon_scales = {}
    for device, others in SAME_SILICON.items():   # devices of one silicon that all have runs share the scales
        members = [d for d in (device, *others) if d in fitted and d not in MEASURED_GEMMS]
        if len(members) > 1:
            shared = fit_silicon_scales({d: fitted[d][0] for d in members})
            silicon_scales.update({d: shared for d in members})
    out = {}
    for device, (fitting_runs, held_runs) in sorted(halves.items()):
        profile = (fitting_runs + held_runs)[0].cluster.device
        fitting, held_out = fitted[device]
        measured = MEASURED_GEMMS.get(device)
        if measured:   # both scales from the GPU's own GEMMs
            results = json.loads(measured.read_text())
            fixed = Scales(measured_half_work(results, profile), measured_half_work(results, profile, "fp8"))
        else:
            fixed = silicon_scales.get(device)
        score, sustained, scales = fit(fitting, fixed)
        held = errors_with(held_out, sustained, scales) if held_out else []
        out[device] = DeviceFit(sustained, scales, score, len(fitting), tuple(held),
                                tuple(run.id for run, _ in held_out), bool(measured), device in silicon_scales)
    return out


def profiles_of(fits: dict[str, DeviceFit]) -> dict[str, DeviceFit]:
    """Every device profile a fit writes: the fitted devices, and a same-silicon device without runs of its own."""
    return {name: fitted for device, fitted in fits.items()
            for name in (device, *(d for d in SAME_SILICON.get(device, ()) if d not in fits))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    parser.add_argument("--write", action="store_true", help="update the device and cluster YAML files")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args(argv)
    runs, _ = load_runs(args.runs)
    fits = fit_devices(runs, args.time_limit, args.write)
    for device, f in fits.items():
        print(f"{device}: sustained_fraction={f.sustained} {f.scales.text()}"
              f"{' (measured)' if f.measured else ' (silicon)' if f.shared else ''}  fit MAPE {f.fit_error:.1%} on "
              f"{f.fit_runs} runs; held-out MAPE "
              f"{(statistics.mean(f.held_errors) if f.held_errors else float('nan')):.1%} on {len(f.held_errors)} "
              f"runs ({', '.join(f.held_ids)})")
    if args.write:
        for name, f in profiles_of(fits).items():
            write_profile(name, f.sustained, f.scales)
    return 0


if __name__ == "__main__":
    sys.exit(main())
