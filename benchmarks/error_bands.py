"""The error band each prediction carries (issue 43): fitted on one half of the published runs, checked on the other.

Every usable run of shared/validation is predicted through the plain path as the user states it
(`benchmarks/plain_path.plain`, the row's own layout), a MoE run with its recipe's dispatcher and combined 1F1B
pinned (`plain_path.recipe_choices`): a band bounds the model's error for the configuration a plan predicts, and
the plain path's own choices of those (which the plan states, with what the alternatives cost) are another
configuration than the one a recipe ran. The runs split as `benchmarks/calibrate.py` splits them
(per device, alternately by id): on the fitting half, the signed residuals (predicted / measured - 1) of each
class (dense, MoE) give the band's ends, their 5th and 95th percentiles (a 90% band); a measured time lies inside the
band when measured * (1 + low) <= predicted <= measured * (1 + high). Its coverage is then counted on the
held-out half, which set nothing. Writes planner/error_bands.yaml (read by every plan: `Plan.step_time_band_s`).

    .venv/bin/python benchmarks/error_bands.py [--runs ../shared/validation/published_runs.yaml]
"""
from __future__ import annotations

import argparse
import statistics
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

LOW_QUANTILE, HIGH_QUANTILE = 1, 19   # the 5th and 95th percentiles (statistics.quantiles, n=20): a 90% band
# a class with fewer fitting runs than this takes the band of every class's fitting runs pooled: the 5th and 95th
# percentiles of a handful of residuals are their extremes, and say nothing of the next run
MIN_CLASS_RUNS = 10


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


def band(errors: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(errors, n=20, method="inclusive")
    return cuts[LOW_QUANTILE - 1], cuts[HIGH_QUANTILE - 1]


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
    header = ("# Written by benchmarks/error_bands.py (do not edit): the 5th and 95th percentiles of the plain path's\n"
              "# residuals (predicted / measured - 1; MoE runs with their recipes' dispatcher and combined 1F1B) on\n"
              f"# the fitting half of shared/validation's usable runs, by class (pooled where a class has fewer than\n"
              f"# {MIN_CLASS_RUNS} fitting runs); held-out coverage {total} of {count}.\n")
    BANDS_PATH.write_text(header + yaml.safe_dump(bands, sort_keys=False))
    print("\n".join(lines) + f"\nheld-out coverage: {total} of {count} ({total / count:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
