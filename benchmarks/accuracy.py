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
from planner.graph_capture.model_sources import resolve_model  # noqa: E402
from planner.explain import PART_NAMES  # noqa: E402
from benchmarks.published import (DEFAULT_RUNS, check_published, load_runs, missing_model_fields, predict,  # noqa: E402
                                  run_stack)
from planner.rules.layout import layout_problems  # noqa: E402
from benchmarks.calibrate import split_runs  # noqa: E402
from benchmarks.ascend_runs import ascend_rows  # noqa: E402
from benchmarks.accuracy_sources import COMPLETED_MODELS, NOT_USABLE, OTHER_MEASUREMENTS, UNPREDICTED_NOTES  # noqa: E402
from benchmarks.accuracy_report import write_report  # noqa: E402


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
    # Meta's own framework: the paper does not say it overlaps TP communication with the GEMMs as Transformer
    # Engine's userbuffers do (Megatron --tp-comm-overlap, which Megatron-Core's stack would choose): pinned off
    ("Llama 3 405B, 16,384 H100", "Dubey et al. 2024 (arXiv 2407.21783), Table 4: TP8 CP1 PP16 DP128, 16M-token "
     "batches, 400 TFLOP/s per GPU; Meta's own framework, no TP communication overlap stated", ("llama3-405b", {}),
     "h100-sxm", 16384, 2048, 8192, "tp=8,pp=16,dp=128,cp=1,tp_overlap=false", "bf16",
     {}, 400.0, "TFLOP/s per GPU"),
    ("DeepSeek-V3, 2,048 H800", "DeepSeek-AI 2024 (arXiv 2412.19437), 3.1-3.3: PP16 EP64 ZeRO-1, FP8, DeepEP "
     "dispatch (one copy per node, FP8), node-limited routing, one MTP module (4.2: depth D = 1), 180K GPU hours "
     "per trillion tokens", ("deepseek-v3", {"mtp_layers": 1}), "h800", 2048, 15360, 4096, "tp=1,pp=16,ep=64,zero=1,fp8_recipe=tensorwise", "fp8",
     {"moe_dispatcher": "deepep", "moe_fp8_dispatch": True}, 1e12 / (180e3 * 3600), "tokens/s per GPU"),
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
     "stages=1-2*30-0,a2a_overlap=false,dispatcher=alltoall", "fp8",
     # the guide's baseline lists its features (section 1: MXFP8, grouped GEMM, fusions, the PP layout, BF16
     # optimizer states, selective recomputation, the AlltoAll dispatcher): no combined 1F1B
     {"precision_aware_optimizer": "on", "adam_moment_bytes": 2},
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
     {"moe_dispatcher": "deepep", "moe_fp8_dispatch": True, "dualpipev_schedule": True,
      "dualpipev_hides_moe_a2a": True},
     1e12 / (180e3 * 3600), "tokens/s per GPU"),
]


def expert_layout_rows(entries=EXPERT_LAYOUTS) -> list[tuple]:
    return [row for row, _ in expert_layout_plans(entries)]


def expert_layout_plans(entries) -> list[tuple[tuple, object]]:
    """Each entry predicted through planner.evaluate: its table row and the plan."""
    out = []
    for name, source, model, device, count, batch, seq, layout, precision, flags, published, unit in entries:
        # --moe-dispatcher: the only dispatcher the stack runs (planner/cli.py)
        only = {"moe_dispatchers": (flags["moe_dispatcher"],)} if "moe_dispatcher" in flags else {}
        stack = load_stack("megatron-core").model_copy(update={**flags, **only})
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
    errors = [abs(e) for run, _, e, _ in rows if run.id not in NOT_USABLE]
    print(f"MAPE {statistics.mean(errors):.1%} over {len(errors)} usable runs, worst {max(errors):.1%}")
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


if __name__ == "__main__":
    sys.exit(main())
