"""The error band each prediction carries (issue 43): fitted on one half of the published runs, checked on the other.

Every usable run of shared/validation is predicted through the plain path as the user states it
(`benchmarks/plain_path.plain`, the row's own layout), a MoE run with its recipe's dispatcher and combined 1F1B
pinned (`plain_path.recipe_choices`): a band bounds the model's error for the configuration a plan predicts, and
the plain path's own choices of those (which the plan states, with what the alternatives cost) are another
configuration than the one a recipe ran. The runs split as `benchmarks/calibrate.py` splits them
(per device, alternately by id): on the fitting half, the signed residuals (predicted / measured - 1) of each
class (dense, MoE) give the band's ends by split conformal prediction (`band`: two order statistics whose
finite-sample coverage is at least 90% for a run like them); a measured time lies inside the band when
measured * (1 + low) <= predicted <= measured * (1 + high). Its coverage is then counted on the held-out half,
which set nothing. Writes planner/error_bands.yaml (read by every plan: `Plan.step_time_band_s`).

    .venv/bin/python benchmarks/error_bands.py [--runs ../shared/validation/published_runs.yaml]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hardware_profiles.errors import UserInputError  # noqa: E402
from benchmarks.accuracy_sources import NOT_USABLE  # noqa: E402
from benchmarks.calibrate import split_runs  # noqa: E402
from benchmarks.plain_path import plain, recipe_choices  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, load_runs  # noqa: E402
from planner.error_bands import BANDS_PATH  # noqa: E402

MISS_PERCENT_EACH_SIDE = 5   # a 90% band: at most 5% of runs like the fitted ones above it, 5% below


def residuals(runs, time_limit_s: float) -> dict[str, float]:
    out = {}
    for run in runs:
        try:
            as_run = recipe_choices(run) if run.model.moe else None
            out[run.id] = plain(run, time_limit_s, whole_row=True, settings=as_run).step_time_s / \
                run.measured_step_s - 1
        except UserInputError:
            continue
    return out


def conformal_ranks(n: int) -> tuple[int, int] | None:
    """The 1-based ranks, among n sorted residuals, of a split-conformal band's ends (Lei, G'Sell, Rinaldo, Tibshirani
    and Wasserman 2018, JASA 113:1094, section 2.2; per side): the floor((n+1) a)-th and ceil((n+1)(1-a))-th
    smallest, a = MISS_PERCENT_EACH_SIDE / 100, between which a next exchangeable residual lies with probability at
    least 1 - 2a. None where n is too small for a finite band (n < 19 at 5% each side). The interpolated 5th and
    95th percentiles this replaced carry no such guarantee: with 20 residuals they cover about 82%. The fitting
    half's residuals are in-sample for calibrate.py's per-device fraction, so only nearly exchangeable with a next
    run's: the held-out half says how nearly."""
    low = (n + 1) * MISS_PERCENT_EACH_SIDE // 100
    high = -(-(n + 1) * (100 - MISS_PERCENT_EACH_SIDE) // 100)
    return (low, high) if 1 <= low and high <= n else None


MIN_CLASS_RUNS = next(n for n in range(1, 1000) if conformal_ranks(n))   # fewer: every class's runs pooled


def band(errors: list[float]) -> tuple[float, float]:
    ordered = sorted(errors)
    low, high = conformal_ranks(len(ordered))
    return ordered[low - 1], ordered[high - 1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args(argv)
    runs, _ = load_runs(args.runs)
    runs = [run for run in runs if run.id not in NOT_USABLE]
    halves = split_runs(runs)
    fitting = [run for fit, _ in halves.values() for run in fit]
    held = [run for _, out in halves.values() for run in out]
    errors = residuals(runs, args.time_limit)
    bands, lines = {}, []
    pooled = [errors[r.id] for r in fitting if r.id in errors]
    for kind in ("dense", "MoE"):
        def of(group):
            return [errors[r.id] for r in group if r.id in errors and bool(r.model.moe) == (kind == "MoE")]
        fit_errors, held_errors = of(fitting), of(held)
        few = len(fit_errors) < MIN_CLASS_RUNS
        low, high = band(pooled if few else fit_errors)
        covered = sum(low <= e <= high for e in held_errors)
        bands[kind] = {"low": round(low, 4), "high": round(high, 4),
                       "fitted_runs": len(pooled) if few else len(fit_errors), "pooled": few,
                       "held_out_runs": len(held_errors), "held_out_covered": covered}
        lines.append(f"{kind}: predicted/measured - 1 in [{low:+.1%}, {high:+.1%}] from "
                     f"{len(pooled) if few else len(fit_errors)} runs{' (every class pooled)' if few else ''}; "
                     f"covers {covered} of {len(held_errors)} held-out runs")
    total = sum(b["held_out_covered"] for b in bands.values())
    count = sum(b["held_out_runs"] for b in bands.values())
    header = ("# Written by benchmarks/error_bands.py (do not edit): the split-conformal 90% band of the plain path's\n"
              "# residuals (predicted / measured - 1; MoE runs with their recipes' dispatcher and combined 1F1B) on\n"
              f"# the fitting half of shared/validation's usable runs, by class (pooled where a class has fewer than\n"
              f"# {MIN_CLASS_RUNS} fitting runs); held-out coverage {total} of {count}.\n")
    BANDS_PATH.write_text(header + yaml.safe_dump(bands, sort_keys=False))
    print("\n".join(lines) + f"\nheld-out coverage: {total} of {count} ({total / count:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
