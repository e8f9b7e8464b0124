"""Compare what one GPU measured (`benchmarks/gpu_measure.py`) with what the profiles and cost models
predict for it, and write docs/gpu-validation.md. Runs on any machine; no GPU needed.

    .venv/bin/python benchmarks/gpu_compare.py [--results benchmarks/results/h200-2026-11-30.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.compute import FLASH_BACKWARD_RECOMPUTE, memory_seconds  # noqa: E402
from hardware_profiles.loader import load_device  # noqa: E402
from planner.api import evaluate  # noqa: E402
from planner.graph_capture.model_config import ModelConfig  # noqa: E402

DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "h200-2026-11-30.json"
LAUNCH_BOUND_S = 20e-6   # GEMMs shorter than this measured the host's launch rate (about 12-18 us), not the GPU
HALF_WORK_GRID_GFLOP = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
FLASH_BACKWARD_FLOPS = 2 * FLASH_BACKWARD_RECOMPUTE   # x forward FLOPs; an unfused backward does 2
# gpu_measure's loop as a stack file: gradients allocated by backward and released by the step,
# F.cross_entropy on fp32 logits (two fp32 gradient buffers of the logits' size at backward start)
MEASURED_STACK = str(ROOT / "benchmarks" / "stacks" / "gpu-measure-loop.yaml")


def measured_half_work(results: dict, device, precision: str = "bf16") -> float:
    """GEMM saturation scale (GFLOP) of the profile's curve W / (W + W_half), least squares on the measured
    GEMMs of `precision` (bf16, or fp8: `torch._scaled_mm` on FP8 operands) as a share of the profile's MAMF
    ceiling in it, over those the GPU rather than the host bounds."""
    fraction = device.gemm.fp8_peak_fraction if precision == "fp8" else device.gemm.peak_fraction
    ceiling = device.peak_flops(precision) * fraction
    points = [(work, work / g[f"{precision}_s"] / ceiling) for g in results["gemm"]
              if g[f"{precision}_s"] >= LAUNCH_BOUND_S for work in [2.0 * g["m"] * g["n"] * g["k"]]]
    return min(HALF_WORK_GRID_GFLOP,
               key=lambda half: sum((eff - work / (work + half * 1e9)) ** 2 for work, eff in points))


def predict_training(record: dict, device: str = "h200") -> dict:
    """The planner's prediction for one measured training step: 1 device, no parallelism, no recomputation."""
    cfg = ModelConfig(name=record["model"], **record["config"])
    mbs = record["micro_batch"]
    plan = evaluate(cfg, device=device, num_devices=1, devices_per_node=1, global_batch=mbs,
                    layout=f"tp=1,pp=1,dp=1,cp=1,ep=1,vp=1,mbs={mbs},zero=0,recompute=none", stack=MEASURED_STACK)
    parts = plan.memory[0].parts
    return {"step_s": plan.step_time_s, "states_bytes": parts["weights"] + parts["optimizer"],
            "forward_saved_bytes": parts["activations"] + parts["logits"],
            "gradient_bytes": parts["gradients"], "total_bytes": plan.memory[0].total_bytes}


def _pct(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.1%}"


def gemm_section(results: dict, device) -> list[str]:
    ceiling = {"bf16": device.peak_flops("bf16") * device.gemm.peak_fraction,
               "fp8": device.peak_flops("fp8") * device.gemm.fp8_peak_fraction}
    best = {"bf16": max(2 * g["m"] * g["n"] * g["k"] / g["bf16_s"] for g in results["gemm"]),
            "fp8": max(2 * g["m"] * g["n"] * g["k"] / g["fp8_s"] for g in results["gemm"])}
    lines = ["## GEMMs", "",
             f"Best measured: BF16 {best['bf16'] / 1e12:.0f} TFLOP/s, FP8 {best['fp8'] / 1e12:.0f} TFLOP/s; the "
             f"profile's achievable ceilings (peak x `peak_fraction`, from published MAMF tables) are "
             f"{ceiling['bf16'] / 1e12:.0f} and {ceiling['fp8'] / 1e12:.0f} TFLOP/s "
             f"({_pct(ceiling['bf16'], best['bf16'])}, {_pct(ceiling['fp8'], best['fp8'])}). 'FP8 + quantise' "
             "includes current scaling of the activation (amax, scale, cast: unfused eager ops, as a "
             "framework without fused casts pays them).", "",
             f"The rates of GEMMs longer than {LAUNCH_BOUND_S * 1e6:.0f} us (shorter ones measure the host's "
             f"launches) follow the profile's saturating curve W / (W + W_half) best at W_half = "
             f"{measured_half_work(results, device):g} GFLOP in BF16 and "
             f"{measured_half_work(results, device, 'fp8'):g} GFLOP in FP8 (least squares on the grid "
             "`benchmarks/calibrate.py` uses): an FP8 GEMM of a given size reaches a smaller share of its "
             "ceiling. Calibrate takes both for Hopper profiles (`half_work_gflop`, `fp8_half_work_gflop`) "
             "instead of fitting them.", "",
             "| GEMM | M x N x K | BF16 TFLOP/s | FP8 TFLOP/s | FP8 + quantise TFLOP/s |", "|---|---|---|---|---|"]
    for g in results["gemm"]:
        flops = 2 * g["m"] * g["n"] * g["k"]
        lines.append(f"| {g['name']} | {g['m']} x {g['n']} x {g['k']} | {flops / g['bf16_s'] / 1e12:.0f} | "
                     f"{flops / g['fp8_s'] / 1e12:.0f} | {flops / g['fp8_quantized_s'] / 1e12:.0f} |")
    return lines + [""]


def experts_section(results: dict) -> list[str]:
    lines = ["## Fine-grained experts (forward, SwiGLU)", "",
             "One GEMM per expert in a loop (as grouped-GEMM layers issue them), all experts in one batched "
             "GEMM, and the loop in FP8 with current scaling. Where the time stays flat as tokens grow, the "
             "host's launches, not the GPU, set it.", "",
             "| local experts | tokens each | h x ffn | loop BF16 ms | batched BF16 ms | loop FP8 + quantise ms |",
             "|---|---|---|---|---|---|"]
    for e in results["experts"]:
        lines.append(f"| {e['local_experts']} | {e['tokens_per_expert']} | {e['hidden']} x {e['ffn']} | "
                     f"{e['bf16_loop_s'] * 1e3:.2f} | {e['bf16_bmm_s'] * 1e3:.2f} | "
                     f"{e['fp8_quantized_loop_s'] * 1e3:.2f} |")
    return lines + [""]


def attention_section(results: dict) -> list[str]:
    lines = ["## Fused attention (SDPA, causal, BF16)", "",
             f"Rates count the causal half of 4 b h s^2 d forward and {FLASH_BACKWARD_FLOPS} times that backward "
             "(the backward recomputes the scores).", "",
             "| batch x heads (kv) x seq x d | flash kernel | forward TFLOP/s | backward TFLOP/s | backward / forward time |",
             "|---|---|---|---|---|"]
    for a in results["attention"]:
        fwd, bwd = a["forward_s"], a["forward_backward_s"] - a["forward_s"]
        flops = a["causal_forward_flops"]
        lines.append(f"| {a['batch']} x {a['heads']} ({a['kv_heads']}) x {a['seq']} x {a['head_dim']} | "
                     f"{a.get('flash_kernel')} | {flops / fwd / 1e12:.0f} | "
                     f"{FLASH_BACKWARD_FLOPS * flops / bwd / 1e12:.0f} | {bwd / fwd:.2f} |")
    ratios = [(a["forward_backward_s"] - a["forward_s"]) / a["forward_s"] for a in results["attention"]]
    return lines + ["", f"Measured, the backward takes {min(ratios):.1f} to {max(ratios):.1f} x the forward; the compute "
                    f"model bills it {FLASH_BACKWARD_FLOPS:g} x the forward's work at one efficiency (the "
                    "recomputed scores, `cost_models/compute.py`).", ""]


def memory_section(results: dict, device) -> list[str]:
    m = results["memory"]
    measured = 2 * m["copy_bytes"] / m["copy_s"]
    modelled = 1.0 / memory_seconds(device, 1.0)
    return ["## HBM and host", "",
            f"Device-to-device copy: {measured / 1e9:.0f} GB/s (read + write) against the profile's "
            f"{modelled / 1e9:.0f} GB/s ({_pct(modelled, measured)}). Host time per launched small op "
            f"(eager PyTorch, {results['torch']}): {m['host_s_per_small_op'] * 1e6:.1f} us.", ""]


def training_section(results: dict, predictions: list[dict]) -> list[str]:
    lines = ["## Training steps of the reference decoder", "",
             "bf16 weights, fp32 master weights and Adam moments, bf16 gradients (converted per parameter "
             "for the step), fp32 cross-entropy; one GPU, no recomputation. Predicted by `planner evaluate` "
             "with the `h200` profile (`benchmarks/gpu_compare.py`). States are measured between steps "
             "(weights and optimizer); 'saved by forward' is the memory the forward pass adds (activations "
             "kept for backward and the fp32 log-probabilities).", "",
             "| model | mbs | step ms measured | predicted | error | states GB measured | predicted | "
             "saved by forward GB measured | predicted | error | peak GB measured | predicted peak | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, p in zip(results["train"], predictions):
        lines.append(
            f"| {r['model']} | {r['micro_batch']} | {r['step_s'] * 1e3:.1f} | {p['step_s'] * 1e3:.1f} | "
            f"{_pct(p['step_s'], r['step_s'])} | {r['states_bytes'] / 1e9:.2f} | {p['states_bytes'] / 1e9:.2f} | "
            f"{r['forward_saved_bytes'] / 1e9:.2f} | {p['forward_saved_bytes'] / 1e9:.2f} | "
            f"{_pct(p['forward_saved_bytes'], r['forward_saved_bytes'])} | {r['peak_bytes'] / 1e9:.2f} | "
            f"{p['total_bytes'] / 1e9:.2f} | {_pct(p['total_bytes'], r['peak_bytes'])} |")
    errors = [p["step_s"] / r["step_s"] - 1 for r, p in zip(results["train"], predictions)]
    totals = [p["total_bytes"] / r["peak_bytes"] - 1 for r, p in zip(results["train"], predictions)]
    return lines + ["", f"Step-time errors run from {min(errors):+.1%} to {max(errors):+.1%}: the GEMM efficiency "
                    "the profiles share was fitted to Megatron-LM and NeMo runs, and eager PyTorch (unfused "
                    "norms, rotary and optimizer-side casts, one launch per op) is slower. The predicted peak "
                    f"is {min(totals):+.1%} to {max(totals):+.1%} off the measured peak (`max_memory_allocated`), "
                    f"predicted with the loop's own stack file (`benchmarks/stacks/gpu-measure-loop.yaml`): the peak "
                    "is at the start of backward, states plus the saved activations plus the cross-entropy's two "
                    "fp32 gradient buffers of the logits' size, with no gradient allocated yet "
                    "(`cost_models/memory.py`, `StageMemory.total`).", ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=str(DEFAULT_RESULTS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpu-validation.md"))
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    device = load_device("h200")
    predictions = [predict_training(r) for r in results["train"]]
    results_name = Path(args.results).resolve().relative_to(ROOT) if ROOT in Path(args.results).resolve().parents \
        else Path(args.results).name
    lines = ["# Cost models against one GPU", "",
             f"Generated by `.venv/bin/python benchmarks/gpu_compare.py` from `{results_name}`, which "
             f"`benchmarks/gpu_measure.py` wrote on {results.get('gpu')} ({results.get('nvidia_smi')}; torch "
             f"{results['torch']}). Do not edit by hand.", ""]
    lines += training_section(results, predictions) + gemm_section(results, device) + experts_section(results)
    lines += attention_section(results) + memory_section(results, device)
    Path(args.out).write_text("\n".join(lines))
    for r, p in zip(results["train"], predictions):
        print(f"{r['model']:16s} mbs {r['micro_batch']}: step {_pct(p['step_s'], r['step_s'])}, "
              f"saved {_pct(p['forward_saved_bytes'], r['forward_saved_bytes'])}, "
              f"states {_pct(p['states_bytes'], r['states_bytes'])}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
