"""The planner's plan beside the layout its builders published, part by part, with the error bands and the
measured region, for the two flagship jobs issue 43 names: Llama 3.1 405B on 16,384 H100 (Meta) and DeepSeek-V3
on 2,048 H800 (DeepSeek). Both through the plain path: `planner.plan` given the job, `planner.evaluate` given the
published degrees; never fitted (neither run is in shared/validation). Writes docs/flagship-layouts.md.

    .venv/bin/python benchmarks/flagship_layouts.py [--out docs/flagship-layouts.md]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner  # noqa: E402
from benchmarks.stated_job import StatedJob  # noqa: E402

PARTS = ("compute_s", "recompute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "pipeline_bubble_s", "pp_comm_s",
         "dp_comm_s", "zero_comm_s", "optimizer_s", "host_s")


@dataclass(frozen=True)
class Flagship:
    name: str
    job: StatedJob
    published: str          # the builders' degrees, as layout text
    published_source: str
    measured_step_s: float  # derived from the source's figure, as `measured_how` says
    measured_how: str
    ran: str                # what the builders' software did that a plain prediction does not state
    # settings the builders' framework is taken not to run, pinned beside the degrees (layout text), where
    # Megatron-Core's stack would choose them: the report gives the prediction with the stack's choice too
    not_run: str = ""


JOBS = (
    Flagship("Llama 3.1 405B, 16,384 H100, 2,048 x 8K", StatedJob("llama3-405b", "h100-sxm", 16384, 2048, 8192, "bf16"),
             "tp=8,cp=1,pp=16,dp=128",
             "Llama 3 paper (arXiv 2407.21783) Table 4: TP 8, CP 1, PP 16, DP 128, 16 sequences of 8,192 per DP "
             "rank, 400 TFLOPs/GPU (BF16)",
             6.22, "6 N D / (400 TFLOP/s x 16,384): 405e9 parameters x 16.8M tokens; with attention FLOPs "
                   "counted as well, about 4% more (6.48 s)",
             "Meta's own framework (not public), which the paper does not say overlaps TP communication with the "
             "GEMMs (Transformer Engine's userbuffers, Megatron's --tp-comm-overlap); predicted with Megatron-Core's "
             "stack, TP overlap off", not_run="tp_overlap=false"),
    Flagship("DeepSeek-V3, 2,048 H800, 15,360 x 4K, FP8", StatedJob("deepseek-v3", "h800", 2048, 15360, 4096, "fp8"),
             "tp=1,cp=1,pp=16,dp=128,ep=64,zero=1",
             "DeepSeek-V3 report (arXiv 2412.19437) sections 3.2 and 3.3: PP 16, EP 64 over 8 nodes, ZeRO-1 data "
             "parallelism, no TP, FP8 mixed precision, batch 15,360 x 4,096 after its ramp",
             19.9, "upper bound: 180K H800 GPU-hours per trillion tokens (the report's cluster-wide figure, every "
                   "overhead in it) at 62.9M tokens a step",
             "DualPipe (each micro-batch's expert all-to-alls hidden behind another's compute) and node-limited "
             "routing with DeepEP's dispatch (each token sent to at most 4 nodes); through the plain path the "
             "search chooses the dispatcher for the published degrees too (the layout row: DeepEP-style, one copy "
             "per destination node, with no node limit) with nothing overlapping it: Megatron-Core pairs passes "
             "(combined 1F1B, which the search weighs where the stack can run it) only with virtual stages or "
             "without a pipeline, and the published PP 16 has no virtual stages; DualPipe is not a Megatron-Core "
             "schedule"),
)


def row(part: str, plan, published) -> str:
    return f"| {part.removesuffix('_s').replace('_', ' ')} | {plan.breakdown.get(part, 0.0):.3f} | " \
           f"{published.breakdown.get(part, 0.0):.3f} |"


def described(lay) -> str:
    """A plan's layout record in words: degrees, ZeRO, recomputation and the overlaps it runs."""
    overlaps = [name for name, on in (("TP overlap", lay.tp_comm_overlap), ("combined 1F1B", lay.moe_a2a_overlap))
                if on]
    dispatcher = f", {lay.moe_dispatcher} dispatcher" if lay.ep > 1 else ""
    return (f"{lay.tp} tp, {lay.pp} pp x {lay.vp}, {lay.dp} dp, {lay.cp} cp, {lay.ep} ep, mbs {lay.mbs}, ZeRO "
            f"{lay.zero}, {lay.recompute}{dispatcher}" + "".join(f", {name}" for name in overlaps))


def band(result) -> str:
    low, high = result.step_time_band_s or (float("nan"), float("nan"))
    return f"{result.step_time_s:.2f} s ({low:.2f}-{high:.2f})"


def report(job: Flagship) -> list[str]:
    common, model = dict(**job.job.api_args(), time_limit_s=120), job.job.model
    plan = planner.plan(model, **common)
    published = planner.evaluate(model, layout=",".join(filter(None, (job.published, job.not_run))), **common)
    chosen = planner.evaluate(model, layout=job.published, **common) if job.not_run else None
    inside = plan.inside_measured
    lines = [f"## {job.name}", "",
             f"Published: {job.published_source}. Measured: {job.measured_step_s:.2f} s a step ({job.measured_how}). "
             f"The builders ran: {job.ran}.",
             "", "| | the plan | the published layout |", "|---|---|---|",
             f"| layout | {described(plan.layout)} | {described(published.layout)} |",
             f"| step, predicted (band) | {band(plan)} | {band(published)} |",
             f"| MFU predicted | {plan.mfu:.1%} | {published.mfu:.1%} |",
             *(row(part, plan, published) for part in PARTS
               if plan.breakdown.get(part, 0.0) or published.breakdown.get(part, 0.0)),
             f"| outside the measured region | {'; '.join(plan.outside_measured) or 'no'} | "
             f"{'; '.join(published.outside_measured) or 'no'} |"]
    if inside is not None:
        lines.append(f"| the best plan inside the measured region | {inside.layout}: {inside.step_time_s:.2f} s "
                     f"({inside.loses}) | |")
    low, high = published.step_time_band_s or (0.0, 0.0)
    largest = max(PARTS, key=lambda part: published.breakdown.get(part, 0.0) if part != "compute_s" else 0.0)
    lines += ["", f"The published layout's measured {job.measured_step_s:.2f} s is "
              f"{'inside' if low <= job.measured_step_s <= high else 'outside'} its predicted band; the prediction "
              f"is {published.step_time_s / job.measured_step_s - 1:+.1%} against it. Its largest part beside "
              f"compute: {largest.removesuffix('_s').replace('_', ' ')}, {published.breakdown.get(largest, 0.0):.2f} "
              f"s of {published.step_time_s:.2f}."]
    if chosen is not None:
        lines.append(f"With Megatron-Core's stack choosing in place of `{job.not_run}` (as a Megatron-Core user would "
                     f"run the layout), it is predicted at {band(chosen)}, "
                     f"{chosen.step_time_s / job.measured_step_s - 1:+.1%} against the measured step.")
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "flagship-layouts.md"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    body = [line for job in JOBS for line in report(job)]
    header = ["# Two flagship jobs: the plan beside the builders' layouts", "",
              f"Generated by `.venv/bin/python benchmarks/flagship_layouts.py` ({time.perf_counter() - started:.0f} s; "
              "do not edit by hand). `planner.plan` given the job and `planner.evaluate` given the published degrees, "
              "through the plain path (model, devices, batch, sequence, precision; Megatron-Core's stack); parts in "
              "seconds a step; bands: the measured times a prediction of its class is consistent with "
              "(planner/error_bands.py); the measured region: planner/region.py. Never fitted.", ""]
    Path(args.out).write_text("\n".join(header + body) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
