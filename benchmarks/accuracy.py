"""Predict every published run with its published layout (unknown fields searched) and write
docs/accuracy.md: predicted vs measured step time, the error, MAPE overall and per device.

    .venv/bin/python benchmarks/accuracy.py [--runs ../shared/validation/published_runs.yaml] [--out docs/accuracy.md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hardware_profiles.errors import UserInputError  # noqa: E402
from hardware_profiles.loader import load_stack  # noqa: E402
from planner.api import evaluate, plan  # noqa: E402
from planner.job import capture_for  # noqa: E402
from planner.capture.model_sources import resolve_model  # noqa: E402
from planner.explain import PART_NAMES  # noqa: E402
from benchmarks.published import (DEFAULT_RUNS, FAMILY_STACKS, UNSTATED_CHOICES, check_published, load_runs,  # noqa: E402
                                  missing_model_fields, predict, run_stack)
from planner.rules.layout import layout_problems  # noqa: E402
from benchmarks.calibrate import split_runs  # noqa: E402
from benchmarks.ascend_runs import ascend_rows, report_lines as ascend_report_lines  # noqa: E402
from benchmarks.accuracy_sources import (COMPLETED_MODELS, MISS_NOTES, OTHER_MEASUREMENTS, UNPREDICTED_NOTES,  # noqa: E402
                                         UNSTATED_PRECISION_NOTE)


def completed_model_rows(path) -> list[tuple]:
    rows = []
    for name, fills, shown, source in COMPLETED_MODELS:
        ids = [r["id"] for r in yaml.safe_load(Path(path).read_text())
               if r["model"].get("name") == name and missing_model_fields(r)]
        runs, _ = load_runs(path, {run_id: fills for run_id in ids})
        for run in runs:
            rows.append((run, shown, source, predict(run)))
    return rows


def unstated_precision_rows(path) -> list[tuple]:
    """(run, BF16 plan, FP8 plan) of each row whose precision is not stated (`load_runs`)."""
    bf16, _ = load_runs(path, unstated_precision="bf16")
    fp8, _ = load_runs(path, unstated_precision="fp8")
    return [(run, predict(run), predict(run_fp8)) for run, run_fp8 in zip(bf16, fp8)]


# Published layouts of runs outside the runs file, predicted through the public API with what the user states
# (model, devices, layout, batch, precision, stack and its flags); never fitted. (name, source, model, device,
# devices, global batch, sequence, layout, precision, stack flags, published figure, its unit)
EXPERT_LAYOUTS = [
    ("Llama 3 405B, 16,384 H100", "Dubey et al. 2024 (arXiv 2407.21783), Table 4: TP8 CP1 PP16 DP128, 16M-token "
     "batches, 400 TFLOP/s per GPU", ("llama3-405b", {}), "h100-sxm", 16384, 2048, 8192, "tp=8,pp=16,dp=128,cp=1", "bf16",
     {}, 400.0, "TFLOP/s per GPU"),
    ("DeepSeek-V3, 2,048 H800", "DeepSeek-AI 2024 (arXiv 2412.19437), 3.1-3.3: PP16 EP64 ZeRO-1, FP8, DeepEP "
     "dispatch (one copy per node, FP8), node-limited routing, one MTP module (4.2: depth D = 1), 180K GPU hours "
     "per trillion tokens", ("deepseek-v3", {"mtp_layers": 1}), "h800", 2048, 15360, 4096, "tp=1,pp=16,ep=64,zero=1,fp8_recipe=tensorwise", "fp8",
     {"moe_dispatcher": "deepep"}, 1e12 / (180e3 * 3600), "tokens/s per GPU"),
]


CLI_STACK_FLAGS = ("tp_comm_overlap", "moe_a2a_overlap", "moe_dispatcher")   # planner/cli.py's stack flags

# Published measurements their authors found bound by the host (kernel launches and small kernels the GPU waits
# for), predicted the same way, host time billed from the profiles' per-call CPU times (cost_models/host_time.py);
# never fitted, not in the 15% check.
GB200_GUIDE = ("Yao et al., 'Optimizing DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72' (NVIDIA/Megatron-LM "
               "docs/discussions/deepseek-v3-gb200-optimization), section 1: TP1 PP8 VPP4 EP32 MBS1 GBS2048, MXFP8, "
               "layout Et\\|(tt\\|)*30L, recompute mlp and up_proj, the NCCL all-to-all dispatcher, BF16 optimizer "
               "states, every EP group inside one NVLink domain (taken as 64 GPUs in each of 4 racks): 494.46 TFLOP/s "
               "per GPU, read as tokens/s with the 25.11 table's 4,018 tokens/s at 1,003 TFLOP/s for this model; "
               "section 2 finds it bound by the host and reaches 970.01 with kernel fusions, CUDA graphs, CPU "
               "binding and HybridEP")
HOST_BOUND_LAYOUTS = [
    ("DeepSeek-V3, 256 GB200, the guide's baseline", GB200_GUIDE, ("deepseek-v3", {}), "gb200", 256, 2048, 4096,
     "tp=1,pp=8,vp=4,dp=32,cp=1,ep=32,etp=1,mbs=1,zero=1,recompute=selective,recompute_modules=mlp+mla_up_proj,"
     "fp8_recipe=mxfp8,"
     "stages=1-2*30-0", "fp8", {"precision_aware_optimizer": "on", "adam_moment_bytes": 2},
     494.46 / 1003 * 4018, "tokens/s per GPU"),
]
SEGMENT_DEVICES = {"DeepSeek-V3, 256 GB200, the guide's baseline": 64}   # --segment-devices, by row name

# The same runs predicted with the schedule their report describes, where the stack above is not it; never
# fitted, not in the 15% check: the stack's fields as a stack file states them
EXPERT_LAYOUT_VARIANTS = [
    ("DeepSeek-V3, 2,048 H800, all-to-alls hidden", "as above; DualPipe overlaps each forward with another "
     "micro-batch's backward and hides the all-to-alls (3.2.1), here in DualPipeV's form (one copy of the weights "
     "where DualPipe holds two)", ("deepseek-v3", {"mtp_layers": 1}), "h800", 2048, 15360, 4096,
     "tp=1,pp=16,ep=64,zero=1,fp8_recipe=tensorwise,schedule=dualpipev", "fp8",
     {"moe_dispatcher": "deepep", "dualpipev_schedule": True, "dualpipev_hides_moe_a2a": True},
     1e12 / (180e3 * 3600), "tokens/s per GPU"),
]


def expert_layout_rows(entries=EXPERT_LAYOUTS) -> list[tuple]:
    return [row for row, _ in expert_layout_plans(entries)]


def expert_layout_plans(entries) -> list[tuple[tuple, object]]:
    """Each entry predicted through planner.evaluate: its table row and the plan."""
    out = []
    for name, source, model, device, count, batch, seq, layout, precision, flags, published, unit in entries:
        stack = load_stack("megatron-core").model_copy(update=flags)
        builtin, changes = model   # a built-in model and what the run changes in it
        plan = evaluate(resolve_model(builtin).model_copy(update=changes), layout=layout, device=device,
                        num_devices=count, segment_devices=SEGMENT_DEVICES.get(name), global_batch=batch,
                        seq_len=seq, precision=precision, stack=stack, time_limit_s=20)
        predicted = plan.tflops_per_device if unit.startswith("TFLOP") else plan.tokens_per_s / count
        flag_text = ", ".join(f"--{k.replace('_', '-')} {v}" if k in CLI_STACK_FLAGS else f"{k}: {str(v).lower()}"
                              for k, v in flags.items()) or "-"
        out.append(((name, source, layout, precision, flag_text, published, predicted, unit), plan))
    return out


def host_bound_rows() -> list[tuple]:
    """The host-bound runs' rows, each with what its plan says of the host (`planner.explain.host_note`)."""
    return [(*row, next((r for r in plan.reasons if r.startswith("the host issues")), "host time not billed"))
            for row, plan in expert_layout_plans(HOST_BOUND_LAYOUTS)]


def other_measurement_rows(runs) -> list[tuple]:
    by_id = {run.id: run for run in runs}
    rows = []
    for other in OTHER_MEASUREMENTS:
        run = by_id.get(other.run_id)
        if run is None:
            continue
        stack = run_stack(run.id).model_copy(update=other.stack_settings)
        batch = other.global_batch or run.global_batch
        predicted = evaluate(run.model, run.cluster, other.layout, global_batch=batch, seq_len=run.seq_len,
                             precision=other.precision, stack=stack, time_limit_s=20).step_time_s
        layout = other.layout + (f", gbs {batch}" if other.global_batch else "")
        rows.append((other.run_id, other.source, layout, other.precision, other.measured_step_s, predicted))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default=str(DEFAULT_RUNS))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "accuracy.md"))
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--only", default="", help="comma-separated run ids")
    args = parser.parse_args(argv)
    runs, skipped = load_runs(args.runs)
    held_ids = {run.id for _, half in split_runs(runs).values() for run in half}   # as calibrate.py splits them
    if args.only:
        runs = [r for r in runs if r.id in args.only.split(",")]
    rows = []
    start = time.perf_counter()
    for run in runs:
        try:
            result = predict(run, args.time_limit)
        except UserInputError as exc:
            note = UNPREDICTED_NOTES.get(run.id)
            skipped.append((run.id, f"not predictable: {exc}" + (f" {note}" if note else "")))
            continue
        error = result.step_time_s / run.measured_step_s - 1
        parts = sorted(((v, k) for k, v in result.breakdown.items() if k != "compute_s"), reverse=True)
        overhead = f"{PART_NAMES[parts[0][1]]} {parts[0][0]:.2f} s" if parts and parts[0][0] > 0 else "-"
        rows.append((run, result, error, overhead))
        print(f"{run.id:48s} measured {run.measured_step_s:8.3f} s  predicted {result.step_time_s:8.3f} s  "
              f"error {error:+7.1%}  {result.layout.tp}/{result.layout.pp}/{result.layout.dp}/{result.layout.cp}")
    checks = [check for check in map(published_layout_check, runs) if check]
    others = other_measurement_rows(runs)
    experts = [] if args.only else expert_layout_rows()
    variants = [] if args.only else expert_layout_rows(EXPERT_LAYOUT_VARIANTS)
    host_bound = [] if args.only else host_bound_rows()
    ascend = [] if args.only else ascend_rows(args.runs)
    completed = [] if args.only else completed_model_rows(args.runs)
    unstated = [] if args.only else unstated_precision_rows(args.runs)
    predicted_elsewhere = {row.run_id for row in ascend if row.predicted_tokens_per_device_s is not None}
    skipped = [(rid, why + (" (predicted with its recipe's batch under 'Ascend rows')" if rid in predicted_elsewhere
                            else " (predicted both ways in the table above)" if rid in {r.id for r, _, _ in unstated}
                            else "")) for rid, why in skipped]
    write_report(Path(args.out), rows, skipped, time.perf_counter() - start, args, checks, others, held_ids, experts,
                 ascend, completed, unstated, variants, host_bound)
    errors = [abs(e) for _, _, e, _ in rows]
    print(f"MAPE {statistics.mean(errors):.1%} over {len(rows)} runs, worst {max(errors):.1%}")
    return 0


def published_layout_check(run) -> tuple | None:
    """Is the run's complete published layout inside the search space, does it fit (or which unstated
    choice makes it fit), and does the full search (nothing pinned) find a plan at least as fast?"""
    check = check_published(run)
    if check is None:
        return None
    stack = run_stack(run.id)
    searched = plan(run.model, run.cluster, global_batch=run.global_batch, seq_len=run.seq_len,
                    precision=run.precision, time_limit_s=60, top_k=1, stack=stack)
    graph = capture_for(run.model, run.seq_len, (), stack)
    inside = not layout_problems(check.predicted.to_layout(), graph, run.cluster.num_devices)
    print(f"{run.id:48s} published {check.predicted.step_time_s:8.3f} s fits {check.predicted.fits!s:5s} "
          f"{check.fits_with or ''} searched {searched.step_time_s:8.3f} s inside {inside}")
    return check, inside, searched


def _layout_cell(lay) -> str:
    """A plan's layout as the report's tables write it: tp/pp/dp/cp/ep, vp, mbs, zero, recompute (with the
    modules selective recomputation repeats where they are not the attention core alone)."""
    modules = f" ({lay.recompute_modules.replace('+', ', ')})" \
        if lay.recompute in ("selective", "per-layer") and lay.recompute_modules != "core_attn" else ""
    return f"{lay.tp}/{lay.pp}/{lay.dp}/{lay.cp}/{lay.ep}, vp {lay.vp}, mbs {lay.mbs}, z{lay.zero}, {lay.recompute}{modules}"


def write_report(path: Path, rows, skipped, wall_s: float, args, checks=(), others=(), held_ids=frozenset(),
                 experts=(), ascend=(), completed=(), unstated=(), variants=(), host_bound=()) -> None:
    errors = [abs(e) for _, _, e, _ in rows]
    by_device: dict[str, list[float]] = {}
    by_class: dict[str, list[float]] = {}
    for run, _, error, _ in rows:
        by_device.setdefault(run.cluster.device.name, []).append(abs(error))
        by_class.setdefault("MoE" if run.model.moe else "dense", []).append(abs(error))
    lines = ["# Prediction accuracy against published runs", "",
             "Generated by `.venv/bin/python benchmarks/accuracy.py` (do not edit by hand). Each run is predicted",
             "with its published layout; fields the source does not give (micro-batch, virtual stages, ZeRO,",
             "recomputation, stage partition) are searched. Step times are compared in seconds, never across",
             "FLOP conventions. Efficiency figures are the device profiles' shared values, the same for every run",
             "on that hardware (see `docs/profiles.md`); no per-run factors. What each run's software could do",
             "(fused attention, sequence parallelism, per-layer recomputation, TP overlap, gradient dtype, FP8 recipe,",
             "what it holds in memory) is the built-in software stack of its source family, passed as `stack=` to",
             "`planner.plan` / `planner.evaluate` exactly as a user passes `--stack` (`benchmarks/published.py`",
             "`FAMILY_STACKS`); layout facts a run's recipe states are pins (`RECIPE_SETTINGS`, each with its source),",
             "stack settings its launcher set are the CLI's flags or a stack file's fields (`RUN_STACK_SETTINGS`: "
             "`--moe-a2a-overlap`, `--moe-dispatcher`, `--tp-comm-overlap`, `dp_window_fraction`, "
             "`precision_aware_optimizer`, `adam_moment_bytes`, `loss_gradient`, `moe_shared_expert_overlap`), "
             "and GB200",
             "runs of Megatron-Bridge take the rack segments its launcher asks Slurm for (`--segment-devices`,",
             "`launcher_segment_devices`).",
             "Stacks by family: " + ", ".join(f"{family} `{name}`" for family, name in sorted(FAMILY_STACKS.items()))
             + " (others `nemo`).", "",
             f"MAPE **{statistics.mean(errors):.1%}** over {len(rows)} runs; worst miss "
             f"**{max(errors):.1%}**; {sum(e <= 0.25 for e in errors)} of {len(rows)} within 25%.", "",
             "| device | runs | MAPE | worst |", "|---|---|---|---|"]
    for device, errs in sorted(by_device.items()):
        lines.append(f"| {device} | {len(errs)} | {statistics.mean(errs):.1%} | {max(errs):.1%} |")
    held_errors = [abs(e) for run, _, e, _ in rows if run.id in held_ids]
    if held_errors:
        lines.append(f"| held-out half (`benchmarks/calibrate.py` fits the other) | {len(held_errors)} | "
                     f"{statistics.mean(held_errors):.1%} | {max(held_errors):.1%} |")
    for name, errs in sorted(by_class.items()):
        lines.append(f"| {name} models | {len(errs)} | {statistics.mean(errs):.1%} | {max(errs):.1%} |")
    lines += ["", "| run | devices | layout predicted (tp/pp/dp/cp/ep, vp, mbs, zero, recompute) | measured s | "
              "predicted s | error | MFU | largest overhead |", "|---|---|---|---|---|---|---|---|"]
    for run, result, error, overhead in rows:
        lines.append(f"| {run.id} | {run.cluster.num_devices} x {run.cluster.device.name} | "
                     f"{_layout_cell(result.layout)} | {run.measured_step_s:.3f} | {result.step_time_s:.3f} | "
                     f"{error:+.1%} | {result.mfu:.1%} | {overhead} |")
    misses = [(run, error) for run, _, error, _ in rows if abs(error) > 0.25]
    if misses:
        lines += ["", "## Runs beyond 25%", ""]
        for run, error in misses:
            lines.append(f"- **{run.id}** ({error:+.1%}): {MISS_NOTES.get(run.id, 'not yet explained.')}")
    if others:
        lines += ["", "Other measurements of missed runs' models on the same devices (and global batch, unless the "
                  "layout gives one), and other "
                  "readings of what a row leaves open, predicted the same way (never fitted):", "", "| run | measured by | layout (others searched) | precision | measured s | "
                  "predicted s | error |", "|---|---|---|---|---|---|---|"]
        for run_id, source, layout, precision, measured, predicted in others:
            lines.append(f"| {run_id} | {source} | {layout} | {precision} | {measured:.2f} | {predicted:.2f} | "
                         f"{predicted / measured - 1:+.1%} |")
    if completed:
        lines += ["", "Rows whose model the source states only in part, completed from the model's public description "
                  "and predicted the same way (never fitted, not in the figures above): "
                  + "; ".join(sorted({source for _, _, source, _ in completed})) + ".", "",
                  "| run | devices | fields completed | layout predicted (tp/pp/dp/cp/ep, vp, mbs, zero, recompute) | "
                  "measured s | predicted s | error |", "|---|---|---|---|---|---|---|"]
        for run, filled, _, result in completed:
            lines.append(f"| {run.id} | {run.cluster.num_devices} x {run.cluster.device.name} | {filled} | "
                         f"{_layout_cell(result.layout)} | {run.measured_step_s:.3f} | {result.step_time_s:.3f} | "
                         f"{result.step_time_s / run.measured_step_s - 1:+.1%} |")
    if unstated:
        lines += ["", "Rows whose precision is not stated, predicted in BF16 and in FP8 the same way: "
                  + UNSTATED_PRECISION_NOTE, "",
                  "| run | devices | layout predicted in BF16 (tp/pp/dp/cp/ep, vp, mbs, zero, recompute) | measured s | "
                  "BF16 s | error | FP8 s | error |", "|---|---|---|---|---|---|---|---|"]
        for run, bf16, fp8 in unstated:
            lines.append(f"| {run.id} | {run.cluster.num_devices} x {run.cluster.device.name} | "
                         f"{_layout_cell(bf16.layout)} | {run.measured_step_s:.3f} | {bf16.step_time_s:.3f} | "
                         f"{bf16.step_time_s / run.measured_step_s - 1:+.1%} | {fp8.step_time_s:.3f} | "
                         f"{fp8.step_time_s / run.measured_step_s - 1:+.1%} |")
        over = [(run, result) for run, bf16, fp8 in unstated for result in (bf16, fp8) if not result.fits]
        if over:
            lines += ["", "Stated layouts these rows ran that exceed the memory model's usable HBM (the runs fit): "
                      + "; ".join(f"{run.id} in {result.layout.precision.value.upper()}, "
                                  f"{result.peak_memory_bytes / 1e9:.1f} GB peak of "
                                  f"{min(m.capacity_bytes for m in result.memory) / 1e9:.1f} usable"
                                  for run, result in over) + "."]
    if experts:
        lines += ["", "## Expert layouts published outside the runs file", "",
                  "Predicted through `planner.evaluate` with the megatron-core stack and the flags shown (never "
                  "fitted); higher is faster:", "", "| run | source | layout | precision | stack flags | published | "
                  "predicted | error |", "|---|---|---|---|---|---|---|---|"]
        for name, source, layout, precision, flag_text, published, predicted, unit in experts:
            lines.append(f"| {name} | {source} | {layout} | {precision} | {flag_text} | {published:,.0f} {unit} | "
                         f"{predicted:,.0f} | {predicted / published - 1:+.1%} |")
    if variants:
        lines += ["", "The megatron-core stack above hides none of DeepSeek-V3's all-to-alls. Predicted with the "
                  "schedule its report describes (a megatron-core stack file with the fields shown), the model is "
                  "faster than the report by the error below: with the all-to-alls hidden as DeepSeek hides them, "
                  "some cost of that run is not billed, and which is not known:", "",
                  "| run | source | layout | precision | stack | published | predicted | error |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, source, layout, precision, flag_text, published, predicted, unit in variants:
            lines.append(f"| {name} | {source} | {layout} | {precision} | megatron-core, {flag_text} | "
                         f"{published:,.0f} {unit} | {predicted:,.0f} | {predicted / published - 1:+.1%} |")
    if host_bound:
        lines += ["", "Published measurements their authors found bound by the host (the GPU waiting for kernel "
                  "launches and small kernels), predicted the same way, with host time billed as the profiles "
                  "give it (per-call CPU times, docs/stacks.md 'Host time'; a pass is host-bound only where the host "
                  "is slower than the device at it); never fitted, not in the figures or the 15% check:", "",
                  "| run | source | layout | precision | stack | published | predicted | error | the plan on its host |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, source, layout, precision, flag_text, published, predicted, unit, host in host_bound:
            lines.append(f"| {name} | {source} | {layout} | {precision} | megatron-core, {flag_text} | "
                         f"{published:,.0f} {unit} | {predicted:,.0f} | {predicted / published - 1:+.1%} | {host} |")
    if ascend:
        lines += ascend_report_lines(ascend)
    lines += ["", "## The search against published layouts", "",
              "Each complete published layout (degrees and micro-batch given; ZeRO-1 and no recomputation where",
              "unstated) is checked against the search's rules and predicted as is, then the search runs with",
              "nothing pinned on the same devices and batch. Where the published layout fits the memory model,",
              "the searched plan must be at least as fast.", "",
              "| run | published layout | inside the space | published predicted s | peak GB | fits | searched s | "
              "searched <= published |",
              "|---|---|---|---|---|---|---|---|"]
    for check, inside, searched in checks:
        published = check.predicted
        ok = "yes" if searched.step_time_s <= published.step_time_s * (1 + 1e-9) else (
            "no" if published.fits else "n/a (does not fit)")
        fits = "yes" if published.fits else (f"with {check.fits_with}" if check.fits_with else "no")
        layout_text = ",".join(f"{k}={v}" for k, v in check.values.items())
        lines.append(f"| {check.run.id} | {layout_text} | {'yes' if inside else 'NO'} | "
                     f"{published.step_time_s:.3f} | {published.peak_memory_bytes / 1e9:.1f} | {fits} | "
                     f"{searched.step_time_s:.3f} | {ok} |")
    over = [c for c, _, _ in checks if not c.predicted.fits]
    if over:
        needs = "; ".join(f"{c.run.id}: {c.fits_with or 'no single unstated choice'}" for c in over if not c.stated)
        lines += ["", f"With unstated recomputation taken as none and ZeRO as 1, {len(over)} of {len(checks)} "
                  "published layouts exceed the memory model's usable HBM. Where the source leaves a choice "
                  "unstated, the first of " + ", ".join(f"{k}={v}" for k, v in UNSTATED_CHOICES) +
                  f" (one at a time, as the run's stack allows) that fits is: {needs}."]
        stated = [c for c in over if c.stated]
        if stated:
            lines += ["", "Stated in full by their sources, and over the memory model's usable HBM though they ran "
                      "(the memory model overestimates them: `tests/test_accuracy.py` keeps each as a strict "
                      "expected failure): " + "; ".join(
                          f"{c.run.id} ({c.predicted.peak_memory_bytes / 1e9:.1f} GB against "
                          f"{max(m.capacity_bytes for m in c.predicted.memory) / 1e9:.1f} GB usable)" for c in stated)
                      + "."]
    lines += ["", "Activation memory: the first pipeline stage of Korthikanti et al.'s four models (Table 3: 22B,",
              "175B, 530B, 1T at t = 8) matches their Section 4.2.3 closed forms within 0.3%, with and without",
              "selective recomputation (`tests/test_capture.py::test_first_stage_activation_memory_of_korthikanti_models`)."]
    lines += ["", "Runs not predicted:", ""] + [f"- {rid}: {why}" for rid, why in skipped]
    lines += ["", f"Wall time of the whole benchmark: {wall_s:.0f} s on this machine."]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
