"""The cost models against what one H200 measured (benchmarks/gpu_measure.py, committed results;
the full comparison: benchmarks/gpu_compare.py -> docs/gpu-validation.md). The measurements are the
independent truth: CUDA's allocator and events on a real GPU, not anything this project computed."""
import json

import pytest

from benchmarks.gpu_compare import DEFAULT_RESULTS, measured_half_work, predict_training
from hardware_profiles.loader import load_device

RESULTS = json.loads(DEFAULT_RESULTS.read_text())
TRAIN = {f"{r['model']}-mbs{r['micro_batch']}": r for r in RESULTS["train"]}


@pytest.mark.parametrize("name", sorted(TRAIN))
def test_training_step_memory_and_time_match_the_gpu(name):
    record = TRAIN[name]
    predicted = predict_training(record)   # planner evaluate on one h200, no parallelism, no recomputation
    # saved-for-backward bytes (activations and fp32 logits), flash and math attention: what the
    # allocator held after forward
    assert predicted["forward_saved_bytes"] == pytest.approx(record["forward_saved_bytes"], rel=0.01)
    # bf16 weights, fp32 master weights and Adam moments between steps (plus token buffers and RoPE tables)
    assert predicted["states_bytes"] == pytest.approx(record["states_bytes"], rel=0.02)
    # the step's peak (max_memory_allocated): at the start of backward, with the loss's fp32 gradient
    # buffers and no parameter gradient yet, as the torchtitan stack holds it (issue 20: within 5%)
    assert predicted["total_bytes"] == pytest.approx(record["peak_bytes"], rel=0.05)
    # eager PyTorch with the efficiency fitted to Megatron runs: within the accuracy target for runs
    assert predicted["step_s"] == pytest.approx(record["step_s"], rel=0.25)


def test_profile_ceilings_match_the_gpu():
    device = load_device("h200")
    best_bf16 = max(2 * g["m"] * g["n"] * g["k"] / g["bf16_s"] for g in RESULTS["gemm"])
    best_fp8 = max(2 * g["m"] * g["n"] * g["k"] / g["fp8_s"] for g in RESULTS["gemm"])
    assert device.peak_flops("bf16") * device.gemm.peak_fraction == pytest.approx(best_bf16, rel=0.05)
    assert device.peak_flops("fp8") * device.gemm.fp8_peak_fraction == pytest.approx(best_fp8, rel=0.08)
    copy = RESULTS["memory"]
    measured_bandwidth = 2 * copy["copy_bytes"] / copy["copy_s"]
    assert device.hbm_bandwidth_gbytes_per_s * 1e9 * device.hbm_bandwidth_fraction == pytest.approx(
        measured_bandwidth, rel=0.05)


def test_hopper_profiles_carry_the_measured_gemm_saturation():
    # benchmarks/calibrate.py takes it from the measurement instead of fitting it; a profile edited by hand
    # without a new measurement fails here
    half = measured_half_work(RESULTS, load_device("h200"))
    assert 1.0 <= half <= 8.0   # measured GEMMs reach 85-90% of MAMF from about 25 GFLOP
    # FP8 (torch._scaled_mm) reaches a smaller share of its ceiling at a given size: its own, larger scale
    fp8_half = measured_half_work(RESULTS, load_device("h200"), "fp8")
    assert fp8_half > half
    for name in ("h100-sxm", "h200", "h800"):
        assert load_device(name).gemm.half_work_gflop == half
        assert load_device(name).gemm.fp8_half_work_gflop == fp8_half
