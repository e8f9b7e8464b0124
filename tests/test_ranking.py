"""The ranking measure (benchmarks/ranking.py): the planner orders a job's layouts as published sweeps measured."""
import pytest
import yaml

from benchmarks.ranking import SWEEPS, Sweep, Variant, published_sweeps, step_s


def test_agreement_and_regret_count_as_defined():
    """Three variants measured 1 < 2 < 3 s and predicted in the order b, a, c: of the three pairs only (a, b) is
    reversed; the variant predicted fastest (b) ran 2 s against the fastest's 1 s: regret +100%. A predicted
    tie agrees with neither order."""
    sweep = Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 1.0), Variant("c", 3.0, 3.0)))
    assert sweep.agreeing() == 2 and len(sweep.pairs) == 3
    assert sweep.top1_regret() == pytest.approx(1.0)
    assert Sweep("s", "t", (Variant("a", 1.0, 2.0), Variant("b", 2.0, 2.0))).agreeing() == 0


# sweeps the model orders wrong (docs/ranking.md), strict, so that a model that gets them right says so. The GB200
# Megatron-FSDP ones are ordered since the search chooses activation offloading. Misordered: the model zoo's three
# layouts with expert groups inside a node, reversed: DeepEP with Megatron FSDP ran 17.6 s, NCCL's all-to-all at
# TP2 EP8 PP32 VP3 24.2 s and DeepEP at TP4 EP8 PP8 VP4 29.0 s, which the model predicts 23.0, 19.4 and 17.5 s: the
# FSDP layout's expert traffic (EDP 32 across nodes) is billed beyond what its step allows, and nothing it bills
# makes the TP4 layout 40% slower than it predicts (memory 60 of 78 GB, host 46% of the device's time)
# Narayanan et al. 2021's Table 2: DeepSpeed's ZeRO-3 without model parallelism ran slower than PTD-P (Megatron-LM)
# on the same GPUs and batch at every size. The model bills ZeRO-3 as DeepSpeed v0.3.15 ran it (the
# megatron-lm-2021-zero stack: a collective per parameter tensor, between compute, gathering again under
# recomputation what its reuse distance releases) and orders four of the five jobs; on 384 A100s it predicts ZeRO-3
# 0.5% faster than PTD-P, which ran 6% faster. The ZeRO-3 arm is still predicted 7-44% fast (at 768 and 1536 A100s
# the 175B model's step took the same 66.7 s, which the model's 50 and 44 s do not have); a candidate, unpriced:
# v0.3.15's list collectives copy one tensor per rank for each parameter (benchmarks/sweeps.yaml's note). A plan
# that shards over more ranks than any fitted run says so (planner/region.py zero3_note)
ZERO3 = {f"{model}, {n} A100, PTD-P against ZeRO-3" for model, n in (
    ("GPT-3 175B", 384), ("GPT-3 175B", 768), ("GPT-3 175B", 1536), ("Megatron 530B", 1120), ("Megatron 530B", 2240))}
ZERO3_REVERSED = {"GPT-3 175B, 384 A100, PTD-P against ZeRO-3"}
# Megatron-Bridge 25.09's token-dropping Qwen3 rows where 32x32 MX blocks ran 1-4% faster than per-tensor current
# scaling (on 8 GB200 and 64 B200), which the model, its MXFP8 GEMMs at 0.951 of per-tensor FP8 and each current-
# scaling cast one read more, predicts 0.8% and 2.4% slower
MXFP8_FASTER = {"Qwen3-30B-A3B, 8 GB200, Megatron-Bridge 25.09, FP8 scaling",
                "Qwen3-235B-A22B, 64 B200, Megatron-Bridge 25.09, FP8 scaling"}
# Megatron-Bridge's Llama 3 70B SFT on 32 H100 at TP 8 ran 24% slower than at PP 8, which the model, crediting TP
# overlap with hiding all but 0.15 s of the TP 8 collectives, predicts 1.3% faster (the sweep's note)
TP8_OVERLAP = {"Llama 3 70B SFT, 32 H100, Megatron-Bridge, memory layouts"}
# Megatron-Bridge's Moonlight recomputation study: recomputing the norms beside the experts' activation ran the
# slowest of six choices (+10.8% of a 0.46 s step), which the model, billing a norm's recomputation at its memory
# traffic, predicts among the cheapest; the step itself is predicted 70% fast (the sweep's note)
MOONLIGHT = "Moonlight-16B-A3B, 8 H100, Megatron-Bridge, selective recomputation"
MISORDERED: set[str] = ({"Qwen3-235B-A22B, 256 H100, Megatron-Core main 1e057005, expert groups inside a node"}
                        | ZERO3_REVERSED | MXFP8_FASTER | TP8_OVERLAP | {MOONLIGHT})
SWEEP_NAMES = [entry["name"] for entry in yaml.safe_load(SWEEPS.read_text())]


def test_narayanan_teraflops_give_the_step_times_of_their_own_days_column():
    """Narayanan et al. 2021's Table 2 gives each run in teraFLOP/s per GPU (its eq. 3) and in days for 300B tokens:
    the step seconds read from the first reproduce the second to within its rounding (a day)."""
    days = {"GPT-3 175B, 384": (90, 84), "GPT-3 175B, 768": (74, 43), "GPT-3 175B, 1536": (74, 23),
            "Megatron 530B, 1120": (137, 80), "Megatron 530B, 2240": (140, 42)}
    entries = [e for e in yaml.safe_load(SWEEPS.read_text()) if e["unit"].startswith("TFLOP/s per GPU")]
    assert len(entries) == len(days)
    for entry in entries:
        tokens_per_step = entry["global_batch"] * entry["seq_len"]
        for variant, published in zip(entry["variants"], days[entry["name"].split(" A100")[0]]):
            seconds = step_s(variant["measured"], entry["unit"], entry)
            assert seconds * 300e9 / tokens_per_step / 86400 == pytest.approx(published, abs=1.0)


def test_megatron_flops_count_gives_the_flops_megatron_bridge_logged():
    """The count that turns a sweep's model TFLOP/s into step seconds, against Megatron-Bridge's own pair of figures
    for one run (shared/validation: Llama 3 70B, 64 H100, sequence 8192, TP 4: 719 model TFLOP/s and 1,602 tokens/s
    per GPU, both rounded): FLOPs per token within what the rounding allows."""
    from benchmarks.published import DEFAULT_RUNS
    run_id = "mbridge-25p11-h100-llama3-70b-fp8-64gpu"
    run = next(r for r in yaml.safe_load(DEFAULT_RUNS.read_text()) if r["id"] == run_id)
    measured = run["measured"]
    entry = {"model": "llama3-70b", "num_devices": 1, "global_batch": 1, "seq_len": run["model"]["seq_length"]}
    seconds = step_s(measured["tflops_per_device"], "model TFLOP/s per GPU, Megatron-LM's count", entry, "tp=4")
    logged = entry["seq_len"] / measured["tokens_per_s_per_device"]   # one sequence's seconds at the logged rate
    rounding = 0.5 / measured["tflops_per_device"] + 0.5 / measured["tokens_per_s_per_device"]
    assert seconds == pytest.approx(logged, rel=rounding)


@pytest.fixture(scope="module")
def predicted_sweeps():
    return {sweep.name: sweep for sweep in published_sweeps()}


@pytest.mark.heavy
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="misordered"))
                                  if name in MISORDERED else name for name in SWEEP_NAMES])
def test_published_sweeps_are_ordered_as_measured(predicted_sweeps, name):
    """Never-fitted sweeps (benchmarks/sweeps.yaml: torchtitan's pipeline schedules, async TP and Float8 tables;
    Megatron-Bridge's FP8 recipes and layouts on GB200 and B200; Megatron-Core's MoE model zoo on H100; Narayanan et
    al. 2021's PTD-P against ZeRO-3 on A100): each pair
    of variants is predicted in the order its source measured."""
    sweep = predicted_sweeps[name]
    assert sweep.agreeing() == len(sweep.pairs), sweep


@pytest.mark.heavy
def test_narayanans_ptd_p_runs_are_predicted_within_five_percent(predicted_sweeps):
    """Narayanan et al. 2021's Table 2 PTD-P arm (TP 8, PP 12 or 35, micro-batch 1, 384 to 2,240 A100s), predicted
    with the paper's own Megatron-LM (the megatron-lm-2021 stack) and never fitted: each step within 5% of the step
    its teraFLOP/s give. What reverses those sweeps is the ZeRO-3 arm alone."""
    for name in ZERO3:
        (ptd_p,) = [v for v in predicted_sweeps[name].variants if v.label.startswith("PTD-P")]
        assert ptd_p.predicted_s == pytest.approx(ptd_p.measured_s, rel=0.05), name


@pytest.mark.heavy
def test_the_memory_moonlights_recomputation_runs_had(predicted_sweeps):
    """Megatron-Bridge's Moonlight-16B-A3B study measured each selective-recomputation choice's peak allocated memory
    on 8 H100 (35.9 to 36.6 GB; never fitted). The plan's fullest stage, with the recipe's optimizer (BF16 moments),
    comes within 20% of each. Today it gives these runs 16-18% less than they held, a gap whose cause no source
    decomposes (docs/ranking.md); a change that widens it past 20% fails here."""
    sweep = predicted_sweeps[MOONLIGHT]
    for variant in sweep.variants:
        assert variant.predicted_peak_gb == pytest.approx(variant.measured_peak_gb, rel=0.20), variant
