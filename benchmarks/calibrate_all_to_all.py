"""Fit the cluster profiles' `inter_node.all_to_all_fraction` on published MoE runs whose expert all-to-alls
cross nodes, and report the error on the runs left out of the fit (`benchmarks/calibrate.py` runs it first).

NCCL's all-to-all sends each GPU's tokens to every remote peer at once through that GPU's own NIC (it cannot
aggregate a node's NICs: NVIDIA/nccl-tests issue 267), where a ring talks to one neighbour: the share of the
line rate it keeps is the cluster's own figure, and no vendor publishes it for a training job's shapes. The
runs that depend on it are found by their prediction (the step time moves with the figure); they are split
alternately by id into a fitting half and a held-out half, as `calibrate.py` splits each device's runs.
Layouts come from one search with the current profiles and stay fixed while the figure is fitted by grid
search on the mean absolute percentage error (each run's capped at 25%). Clusters on the same fabric (CX7 NDR
InfiniBand, one NIC per GPU, NCCL) without runs of their own take the fit (`SAME_FABRIC`); `--write` updates
their YAML line in place (comments kept). Independent check, never fitted: docs/setting-ab.md's alltoall arm.

    .venv/bin/python benchmarks/calibrate.py [--write]
"""
from __future__ import annotations

import re
import statistics
from dataclasses import replace
from pathlib import Path

from cost_models.step_time import estimate
from hardware_profiles.loader import CLUSTER_DIR, default_cluster_for
from planner.job import capture_for
from benchmarks.published import run_stack

FRACTIONS = [round(0.40 + 0.01 * i, 2) for i in range(61)]
OUTLIER_CAP = 0.25   # the accuracy target's bound on any one run (as calibrate.py's)
# built-in clusters on the fitted one's fabric: 8 CX7 NDR 400 Gb/s NICs per node, one per GPU, NCCL
SAME_FABRIC = {"dgx-h100": ("dgx-h200", "dgx-b200", "gb200-nvl72", "h800-deepseek")}
PROBE = (0.5, 1.0)   # a run depends on the figure where its prediction differs at these two


def _with_fraction(cluster, fraction: float):
    network = cluster.inter_node.model_copy(update={"all_to_all_fraction": fraction})
    return cluster.model_copy(update={"inter_node": network})


def predicted_s(run, layout, fraction: float) -> float:
    stack = run_stack(run.id)
    record = capture_for(run.model, run.seq_len, (), stack).costs_record
    return estimate(record, _with_fraction(run.cluster, fraction), layout, stack).step_time_s


def depends(run, layout) -> bool:
    low, high = (predicted_s(run, layout, f) for f in PROBE)
    return abs(low - high) > 1e-6 * high


def template_of(run) -> str:
    """The built-in cluster whose network figures the run's cluster took (`cluster_from_device`)."""
    return default_cluster_for(run.cluster.device).name


def errors_with(items, fraction: float) -> list[float]:
    return [abs(predicted_s(run, layout, fraction) / run.measured_step_s - 1) for run, layout in items]


def fit(items) -> tuple[float, float]:
    """(capped mean error, fraction): the grid's best on the fitting runs."""
    return min((statistics.mean(min(e, OUTLIER_CAP) for e in errors_with(items, f)), f) for f in FRACTIONS)


def split(items) -> dict[str, tuple[list, list]]:
    """Per template cluster, the dependent runs sorted by id, split alternately (fitting, held out)."""
    by_cluster: dict[str, list] = {}
    for run, layout in sorted(items, key=lambda item: item[0].id):
        if depends(run, layout):
            by_cluster.setdefault(template_of(run), []).append((run, layout))
    return {name: (group[0::2], group[1::2]) for name, group in by_cluster.items()}


def leave_one_out(items):
    """Each (run, layout) with the others, where there are others to fit on."""
    return [(item, items[:i] + items[i + 1:]) for i, item in enumerate(items)] if len(items) > 1 else []


def write_cluster(name: str, fraction: float, source: str) -> None:
    """Set (or add after `busbw_fraction`) the profile's `all_to_all_fraction` line."""
    path = CLUSTER_DIR / f"{name}.yaml"
    text = path.read_text()
    line = f"  all_to_all_fraction: {fraction}   # {source}"
    if re.search(r"^  all_to_all_fraction: .*$", text, flags=re.M):
        text = re.sub(r"^  all_to_all_fraction: .*$", line, text, count=1, flags=re.M)
    else:
        text = re.sub(r"^(  busbw_fraction: .*)$", lambda m: m.group(1) + "\n" + line, text, count=1, flags=re.M)
    path.write_text(text)


def calibrate(items, write: bool) -> dict[str, float]:
    """Fit, report and (with `write`) record each cluster's figure; `items` are (run, fixed layout) pairs.
    Returns the fitted figure by built-in cluster name, the same-fabric ones included."""
    fitted: dict[str, float] = {}
    for name, (fitting, held_out) in sorted(split(items).items()):
        score, fraction = fit(fitting)
        held = errors_with(held_out, fraction)
        print(f"{name}: all_to_all_fraction={fraction}  fit MAPE {score:.1%} on {len(fitting)} runs "
              f"({', '.join(run.id for run, _ in fitting)}); held-out MAPE "
              f"{(statistics.mean(held) if held else float('nan')):.1%} on {len(held)} runs "
              f"({', '.join(run.id for run, _ in held_out)})")
        left_out = [(item[0].id, fit(others)[1], item) for item, others in leave_one_out(fitting + held_out)]
        print(f"{name}: each run left out of a fit on the others (reported, not written): " + "; ".join(
            f"{run_id} {errors_with([item], f)[0]:.1%} at {f}" for run_id, f, item in left_out))
        fitted.update({cluster: fraction for cluster in (name, *SAME_FABRIC.get(name, ()))})
        if write:
            source = (f"fitted by benchmarks/calibrate.py on {len(fitting)} MoE run(s) whose all-to-alls cross "
                      f"nodes, {len(held)} held out (docs/accuracy.md)")
            for cluster in (name, *SAME_FABRIC.get(name, ())):
                write_cluster(cluster, fraction, source if cluster == name else source + f", as {name}'s fabric")
    return fitted


def with_fitted(items, fitted: dict[str, float]):
    """The (run, layout) pairs with each run's cluster taking its template's fitted figure."""
    return [(replace(run, cluster=_with_fraction(run.cluster, fitted[template_of(run)]))
             if template_of(run) in fitted else run, layout) for run, layout in items]


if __name__ == "__main__":   # pragma: no cover - run through calibrate.py
    raise SystemExit(f"run {Path(__file__).with_name('calibrate.py')}")
