"""Ranking as a measure (issue 43): does the planner order layouts of one job as measurements do?

Two tables: the never-fitted published sweeps in benchmarks/sweeps.yaml (each variant predicted through
`planner.evaluate` with what its source states, the rest searched), and the jobs that shared/validation holds
under more than one layout or setting (predicted as benchmarks/accuracy.py predicts them, with each run's
recipe settings; the calibration fits one sustained fraction per device on half of those rows, so they are
reported apart). For each: the pairwise order agreement (a pair agrees where the predicted order is the
measured one; a predicted tie does not) and the top-1 regret (how much slower, measured, the variant
predicted fastest is than the measured fastest). Writes docs/ranking.md.

    .venv/bin/python benchmarks/ranking.py [--runs ../shared/validation/published_runs.yaml]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hardware_profiles.loader import load_stack  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.graph_capture.model_sources import resolve_model  # noqa: E402
from benchmarks.accuracy_sources import NOT_USABLE  # noqa: E402
from benchmarks.plain_choices import megatron_flops_per_sequence  # noqa: E402
from cost_models.layout_codec import parse_text  # noqa: E402
from benchmarks.published import DEFAULT_RUNS, load_runs, predict  # noqa: E402

SWEEPS = ROOT / "benchmarks" / "sweeps.yaml"
OUT = ROOT / "docs" / "ranking.md"


@dataclass(frozen=True)
class Variant:
    """One layout or setting of a sweep's job: its step seconds as measured and as predicted."""
    label: str
    measured_s: float      # step seconds
    predicted_s: float
    measured_peak_gb: float | None = None    # the peak allocated memory its source measured, where it gives one
    predicted_peak_gb: float | None = None   # the plan's fullest stage, beside it


@dataclass(frozen=True)
class Sweep:
    """One job under several variants, and where its source published them."""
    name: str
    source: str
    variants: tuple[Variant, ...]
    note: str = ""         # what the sweep shows of the model, where it says something (benchmarks/sweeps.yaml)

    @property
    def pairs(self) -> list[tuple[Variant, Variant]]:
        return list(itertools.combinations(self.variants, 2))

    def agreeing(self) -> int:
        """Pairs whose predicted order is the measured order (a predicted or measured tie agrees with neither)."""
        return sum((a.predicted_s - b.predicted_s) * (a.measured_s - b.measured_s) > 0 for a, b in self.pairs)

    def top1_regret(self) -> float:
        """Measured seconds of the variant predicted fastest over the measured fastest, minus one."""
        chosen = min(self.variants, key=lambda v: v.predicted_s)
        return chosen.measured_s / min(v.measured_s for v in self.variants) - 1


def narayanan_flops(model, global_batch: int, seq_len: int) -> float:
    """A step's FLOPs as Narayanan et al. 2021 count them for their teraFLOP/s figures (arXiv 2104.04473, eq. 3:
    matrix products only, activation recomputation included): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    l, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 96 * global_batch * seq_len * l * h * h * (1 + seq_len / (6 * h) + v / (16 * l * h))


def step_s(figure: float, unit: str, entry: dict, layout: str = "") -> float:
    """A published figure as step seconds: tokens/s per GPU (higher is faster), teraFLOP/s per GPU as Narayanan
    et al. 2021 count FLOPs or as Megatron-LM's logs count them (at the variant's `layout` tp, which pads the
    vocabulary; higher is faster), or step seconds."""
    devices, batch, seq = entry["num_devices"], entry["global_batch"], entry["seq_len"]
    if unit.startswith("tokens/s per GPU"):
        return batch * seq / (figure * devices)
    if unit.startswith("TFLOP/s per GPU, Narayanan eq. 3"):
        return narayanan_flops(resolve_model(entry["model"]), batch, seq) / (figure * 1e12 * devices)
    if unit.startswith("model TFLOP/s per GPU, Megatron-LM"):
        tp = parse_text(layout).get("tp", 1) if layout else 1
        flops = batch * megatron_flops_per_sequence(resolve_model(entry["model"]), seq, tp)
        return flops / (figure * 1e12 * devices)
    if unit.startswith("s"):
        return figure
    raise ValueError(f"unit {unit!r}: expected 'tokens/s per GPU', 'TFLOP/s per GPU, Narayanan eq. 3', "
                     "'model TFLOP/s per GPU, Megatron-LM' or 's'")


def variant_layout(variant: dict) -> str:
    """A variant's layout: its degrees and, where it states them apart, the framework settings it ran."""
    return ",".join(filter(None, (variant["layout"], variant.get("settings", ""))))


def published_sweeps(path: Path = SWEEPS, time_limit_s: float = 20.0) -> list[Sweep]:
    out = []
    for entry in yaml.safe_load(path.read_text()):
        variants = []
        for v in entry["variants"]:
            stack = load_stack(v.get("stack", entry["stack"])).model_copy(
                update={**entry["stack_flags"], **v.get("stack_flags", {})})
            model = resolve_model(entry["model"]).model_copy(update=entry.get("model_overrides", {}))
            plan = evaluate(model, layout=variant_layout(v), device=entry["device"],
                            num_devices=entry["num_devices"], global_batch=entry["global_batch"],
                            seq_len=entry["seq_len"], precision=v.get("precision", entry["precision"]), stack=stack,
                            time_limit_s=time_limit_s)
            peak = v.get("peak_allocated_gb")
            variants.append(Variant(v["label"], step_s(v["measured"], entry["unit"], entry, v["layout"]),
                                    plan.step_time_s, peak, None if peak is None else plan.peak_memory_bytes / 1e9))
        out.append(Sweep(entry["name"], " ".join(entry["source"].split()), tuple(variants),
                         " ".join(entry.get("note", "").split())))
    return out


def validation_sweeps(runs_path=DEFAULT_RUNS, time_limit_s: float = 20.0) -> list[Sweep]:
    """Jobs shared/validation holds under more than one layout or setting: same model shape, device, count,
    batch, sequence and precision."""
    runs, _ = load_runs(runs_path)
    groups = defaultdict(list)
    for run in runs:
        if run.id in NOT_USABLE:
            continue
        m = run.model
        groups[(m.hidden_size, m.num_layers, run.cluster.device.name, run.cluster.num_devices, run.global_batch,
                run.seq_len, run.precision)].append(run)
    out = []
    for key, members in sorted(groups.items(), key=lambda item: item[1][0].id):
        if len(members) < 2:
            continue
        variants = tuple(Variant(run.id, run.measured_step_s, predict(run, time_limit_s).step_time_s)
                         for run in sorted(members, key=lambda r: r.id))
        hidden, layers, device, count, batch, seq, precision = key
        out.append(Sweep(f"{layers} layers x {hidden}, {count} {device}, batch {batch} x {seq}, {precision}",
                         "shared/validation", variants))
    return out


def table(sweeps: list[Sweep]) -> list[str]:
    lines = ["| sweep | variant | measured s | predicted s | predicted / measured |", "|---|---|---|---|---|"]
    for sweep in sweeps:
        for v in sweep.variants:
            lines.append(f"| {sweep.name} | {v.label} | {v.measured_s:.3f} | {v.predicted_s:.3f} | "
                         f"{v.predicted_s / v.measured_s:.2f} |")
    pairs = sum(len(s.pairs) for s in sweeps)
    agree = sum(s.agreeing() for s in sweeps)
    regrets = ", ".join(f"{s.name}: {s.top1_regret():+.1%}" for s in sweeps)
    lines += ["", f"Pairwise order agreement: **{agree} of {pairs}** ({agree / pairs:.0%}); top-1 regret: {regrets}."
              if pairs else "No pairs."]
    return lines


def memory_table(sweeps: list[Sweep]) -> list[str]:
    """The variants whose source measured their peak allocated memory, beside the plan's fullest stage."""
    rows = [(sweep, v) for sweep in sweeps for v in sweep.variants if v.measured_peak_gb is not None]
    if not rows:
        return []
    return ["| sweep | variant | measured peak allocated GB | predicted peak GB | predicted / measured |",
            "|---|---|---|---|---|"] + [
        f"| {sweep.name} | {v.label} | {v.measured_peak_gb:.3f} | {v.predicted_peak_gb:.3f} | "
        f"{v.predicted_peak_gb / v.measured_peak_gb:.2f} |" for sweep, v in rows]


def write(published: list[Sweep], validation: list[Sweep], seconds: float, out: Path) -> None:
    lines = ["# Ranking: do predictions order layouts as measurements do?", "",
             f"Generated by `.venv/bin/python benchmarks/ranking.py` ({seconds:.0f} s; do not edit by hand). "
             "Issue 43's bar: pairwise agreement >= 85% over a never-fitted table of published sweeps, top-1 regret "
             "reported. A pair agrees where the predicted order is the measured one (a predicted tie does not); the "
             "top-1 regret is how much slower, measured, the variant predicted fastest ran than the fastest. "
             "torchtitan's sweeps ran on Grand Teton H100s (96 GB HBM2e at 500 W), which the h100-sxm profile is "
             "not: their step times are compared by order only.", "",
             "## Published sweeps, never fitted (benchmarks/sweeps.yaml)", ""]
    lines += [f"- {s.name}: {s.source}" + (f". What it shows: {s.note}" if s.note else "") for s in published]
    lines += [""] + table(published)
    memory = memory_table(published)
    if memory:
        lines += ["", "### Memory the sweeps' runs had", "",
                  "Where a source measured its variants' peak allocated memory (torch's, as each source reports "
                  "it: the sweep's source says which), the plan's fullest stage beside it: the memory model's own "
                  "never-fitted check.", ""] + memory
    lines += ["", "## Jobs shared/validation holds under several layouts or settings", "",
              "Predicted with each run's recipe settings (docs/accuracy.md); the calibration fits one sustained "
              "fraction per device on half of these rows, which scales every variant of a job alike, so the order "
              "is not fitted, but these rows are not never-fitted either.", ""] + table(validation)
    out.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    published = published_sweeps()
    validation = validation_sweeps(args.runs) if Path(args.runs).exists() else []
    write(published, validation, time.perf_counter() - started, Path(args.out))
    print("\n".join(table(published) + [""] + table(validation)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
