"""A quick re-check of prediction accuracy on published runs (the full table: benchmarks/accuracy.py),
the memory model against the layouts that ran, and the search against the layouts those teams published.
Every prediction goes through the public API with the run's software stack named (`stack=`)."""
import pytest

from benchmarks.calibrate import split_runs
from benchmarks.published import DEFAULT_RUNS, check_published, load_runs, predict, run_stack
from cost_models.layout_codec import parse_text
from planner.api import plan
from planner.job import capture_for
from planner.rules.layout import layout_problems

pytestmark = pytest.mark.skipif(not DEFAULT_RUNS.exists(), reason="shared/validation not present")

# runs from calibrate's held-out half (checked below), one per stack family where the half has one
QUICK = ["narayanan21-18b", "korthikanti22-22b-full", "nemo2407-gpt3-5b-64gpu", "nemo2407-nemotron-8b-64gpu"]
# MoE on Blackwell, held out too: GB200 NVL72 as NVIDIA's launcher placed it (64 GPUs in each rack: Slurm
# --segment), B200 with the saturation scales (BF16's and FP8's) fitted on both devices' runs
QUICK_MOE = ["mbridge-25p11-gb200-deepseekv3-mxfp8-256gpu-wo-mtp", "mbridge-25p11-gb200-qwen3-235b-a22b-bf16-256gpu",
             "mbridge-25p11-b200-qwen3-235b-a22b-mxfp8-64gpu"]
# published layouts that ran with every degree and the micro-batch given
PUBLISHED_LAYOUTS = ["korthikanti22-22b-selective", "korthikanti22-175b-selective", "korthikanti22-1t-full",
                     "bloom-176b-384gpu", "nemo2407-gpt3-5b-64gpu", "nemo2407-gpt3-20b-64gpu",
                     "nemo2407-gpt3-175b-512gpu", "nemo2407-llama2-70b-64gpu", "nemo2407-nemotron-8b-64gpu",
                     "nemo2407-nemotron-340b-128gpu", "nemo2407-llama3-8b-8gpu",
                     # their Megatron-Bridge configurations state the whole layout (RECIPE_SETTINGS)
                     "mbridge-25p11-h100-qwen3-235b-a22b-fp8-256gpu",
                     "mbridge-25p11-b200-deepseekv3-mxfp8-256gpu-w-mtp",
                     # its launcher states the whole layout (benchmarks/published.py RECIPE_SETTINGS); it fits once
                     # the nemo-2 stack keeps no experts' output for the probabilities, as its Megatron-Core commit
                     # (7094270c) runs (80.7 GB against 78.4 GB usable before)
                     "dgxc-250504-dsv3-bf16-h100-512gpu"]


@pytest.fixture(scope="module")
def runs():
    found, _ = load_runs()
    return {run.id: run for run in found}


def test_quick_runs_are_held_out(runs):
    held = {run.id for _, half in split_runs(runs.values()).values() for run in half}
    assert set(QUICK) | set(QUICK_MOE) <= held


@pytest.mark.parametrize("run_id", QUICK + QUICK_MOE)
def test_published_step_time_within_25_percent(runs, run_id):
    run = runs[run_id]
    result = predict(run)
    assert result.stack == run_stack(run_id).name
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


@pytest.mark.parametrize("run_id", PUBLISHED_LAYOUTS)
def test_published_layouts_fit_the_memory_model(runs, run_id):
    """A layout that ran fits: as published where the source states recomputation and ZeRO, else with one
    of the choices the source leaves open (the accuracy report names which)."""
    check = check_published(runs[run_id])
    assert check is not None
    if check.stated:
        assert check.predicted.fits
    else:
        assert check.predicted.fits or check.fits_with is not None


@pytest.mark.parametrize("run_id", ["korthikanti22-22b-selective", "nemo2407-llama2-7b-8gpu", "nemo2407-gpt3-5b-64gpu",
                                    "nemo2407-gpt3-175b-128gpu", "nemo2407-llama2-70b-64gpu"])
def test_search_is_never_slower_than_the_published_layout(runs, run_id):
    run = runs[run_id]
    stack = run_stack(run_id)
    check = check_published(run)
    graph = capture_for(run.model, run.seq_len, (), stack)
    assert layout_problems(check.predicted.to_layout(), graph, run.cluster.num_devices) == []  # inside the space
    assert check.predicted.fits
    searched = plan(run.model, run.cluster, global_batch=run.global_batch, seq_len=run.seq_len,
                    precision=run.precision, time_limit_s=60, top_k=1, stack=stack)
    assert searched.step_time_s <= check.predicted.step_time_s * (1 + 1e-9)


def test_expert_layouts_published_outside_the_runs_file_are_predicted_within_15_percent():
    """Llama 3 405B on 16,384 H100 (400 TFLOP/s per GPU, Dubey et al. Table 4) and DeepSeek-V3 on 2,048 H800
    (180K GPU hours per trillion tokens, DeepSeek-V3 report) through the public API with what a user states:
    model, devices, layout, batch, precision and the stack's flags (DeepEP dispatch for DeepSeek-V3)."""
    from benchmarks.accuracy import EXPERT_LAYOUTS, expert_layout_rows
    rows = expert_layout_rows()
    assert len(rows) == len(EXPERT_LAYOUTS)
    for name, _, _, _, _, published, predicted, _ in rows:
        assert abs(predicted / published - 1) <= 0.15, (name, published, predicted)


def test_ascend_rows_that_map_to_a_profile_are_predicted_and_the_others_say_why():
    """Issue 15: the runs file's Ascend rows mapped to a 910B/910C profile are predicted (through
    planner.evaluate, with the recipe the row names for what it leaves open), within 25% of the row's
    tokens/s per device and fitting the memory model; the rest say why they are not."""
    from benchmarks.ascend_runs import READINGS, ascend_rows
    rows = {row.run_id: row for row in ascend_rows()}
    assert {reading.run_id for reading in READINGS} < set(rows)
    for reading in READINGS:
        row = rows[reading.run_id]
        assert row.predicted_tokens_per_device_s == pytest.approx(row.measured_tokens_per_device_s, rel=0.25)
        assert row.peak_gb <= row.usable_gb
    assert all(row.why_not for row in rows.values() if row.predicted_tokens_per_device_s is None)


def test_rows_whose_precision_is_not_stated_are_predicted_apart():
    """On a device with an FP8 peak an unstated precision is an assumption the prediction would make: such
    rows are left out of the figures and the fit (and predicted both ways in the report); an A100 row's null
    precision means 16-bit, the only way it trains, and stays in."""
    from benchmarks.published import UNSTATED_PRECISION
    found, skipped = load_runs()
    unstated = {rid for rid, why in skipped if why == UNSTATED_PRECISION}
    assert unstated == {"mbridge-25p09-gb200-llama3-70b-prec-na-64gpu",
                        "mbridge-25p09-gb200-llama3p1-405b-prec-na-128gpu",
                        "mbridge-25p09-h100-deepseekv3-prec-na-1024gpu"}
    assert "narayanan21-1t" in {run.id for run in found}
    fp8, _ = load_runs(unstated_precision="fp8")
    assert {run.id for run in fp8} == unstated and {run.precision for run in fp8} == {"fp8"}


def test_deepseek_v3_on_1024_h100_is_predicted_as_its_launcher_line_states_it():
    """Megatron-Bridge @6476ea0f (the 25.09 line) runs it with combined 1F1B, DeepEP, recompute_modules
    ["mla_up_proj", "mlp"] and the pipeline layout "Et|(tt|)*30mL": one decoder layer beside the embedding,
    30 chunks of two, the MTP module with the loss. It ran, so it fits: it did once the stack stopped billing the
    experts' output that Megatron-Core 0.13 and later do not keep (`moe_probs_in_expert_activation`)."""
    run = next(r for r in load_runs(unstated_precision="bf16")[0]
               if r.id == "mbridge-25p09-h100-deepseekv3-prec-na-1024gpu")
    assert run.model.mtp_layers == 1
    result = predict(run)
    assert [len(stage.layers) for stage in result.stages] == [1] + [2] * 30 + [1]
    assert result.layout.recompute == "selective" and result.layout.recompute_modules == "mlp+mla_up_proj"
    assert result.layout.moe_a2a_overlap and result.layout.zero == 1 and result.fits
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


def test_deepseek_v3_on_512_h100_is_predicted_as_its_launcher_ran_it(runs):
    """dgxc-benchmarking v25.05.04 ran NeMo 2's DeepSeek-V3 script (NeMo 7a8f1cc7): the nemo-2 stack, one MTP
    module, 7 and 6 decoder layers in the edge stages, mla_up_proj recomputed, no TP overlap; its 25.03 Grok
    runs used NeMo 24.12's YAML launcher (the nemo stack)."""
    run = runs["dgxc-250504-dsv3-bf16-h100-512gpu"]
    assert run_stack(run.id).name == "nemo-2" and run_stack("dgxc-2503-grok-bf16-h100-512gpu").name == "nemo"
    assert run.model.mtp_layers == 1
    result = predict(run)
    assert result.stack == "nemo-2" and not result.layout.tp_comm_overlap
    assert [len(stage.layers) for stage in result.stages] == [7, 8, 8, 8, 8, 8, 8, 7]   # the last: MTP too
    assert result.layout.recompute == "selective" and result.layout.recompute_modules == "mla_up_proj"
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


def test_qwen3_235b_on_256_h100_is_predicted_with_its_megatron_bridge_recipe(runs):
    """Megatron-Bridge v0.2.0-v0.2.2's QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG has the row's degrees and batch
    with combined 1F1B; its script turns TP overlap off and recomputation off, and its recipe counts the
    embedding and the loss as a layer each in the pipeline split (96 over pp 8 x vp 4 chunks)."""
    run = runs["mbridge-25p11-h100-qwen3-235b-a22b-fp8-256gpu"]
    result = predict(run)
    assert [len(stage.layers) for stage in result.stages] == [2] + [3] * 30 + [2]
    assert result.layout.moe_a2a_overlap and not result.layout.tp_comm_overlap
    assert result.layout.recompute == "none" and result.layout.zero == 1 and result.fits
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


def test_deepseek_v3_on_256_b200_is_predicted_with_its_megatron_bridge_recipe(runs):
    """Megatron-Bridge v0.2.1's DEEPSEEK_V3_B200_BASE_CONFIG has the row's degrees and batch; its recipe's
    pipeline layout for pp 16 puts the embedding and 4 decoder layers first, 4 in each middle stage, and one
    decoder layer with the MTP module and the loss last (61 + 1 MTP = 62 blocks)."""
    run = runs["mbridge-25p11-b200-deepseekv3-mxfp8-256gpu-w-mtp"]
    assert run.model.mtp_layers == 1
    result = predict(run)
    assert [len(stage.layers) for stage in result.stages] == [4] * 15 + [2]
    assert result.layout.zero == 1 and result.layout.etp == 1 and result.layout.fp8_recipe == "mxfp8"
    assert result.layout.recompute == "selective" and result.layout.recompute_modules == "mla_up_proj"
    assert result.step_time_s == pytest.approx(run.measured_step_s, rel=0.25)


def test_gpt_oss_rows_are_completed_with_the_model_transformers_builds():
    """The GPT-OSS 120B rows leave the architecture out; accuracy.py completes them from Megatron-Bridge's
    provider. The completed model has the parameters of transformers' GptOssForCausalLM built from GptOssConfig's
    defaults (the 120B, on the meta device) within 0.1% (its attention sinks and router biases are the rest),
    and its windows on the layers that config's layer_types make sliding."""
    import torch
    import transformers
    from benchmarks.accuracy_sources import GPT_OSS_120B
    from planner.graph_capture.model_capture import capture
    run_id = "mbridge-25p11-h100-gpt-oss-120b-bf16-64gpu"
    model = load_runs(model_fills={run_id: GPT_OSS_120B})[0][0].model
    config = transformers.GptOssConfig()
    with torch.device("meta"):
        reference = sum(p.numel() for p in transformers.GptOssForCausalLM(config).parameters())
    assert capture(model, 1024).total_params == pytest.approx(reference, rel=1e-3)
    assert [model.window_of(i) for i in range(model.num_layers)] == [
        config.sliding_window if kind == "sliding_attention" else 0 for kind in config.layer_types]


GB200_MOE_PLAIN = ["mbridge-25p11-gb200-deepseekv3-bf16-256gpu-wo-mtp",
                   pytest.param("mbridge-25p11-gb200-qwen3-235b-a22b-bf16-256gpu", marks=pytest.mark.xfail(
                       strict=True, reason="+18.6% (as run +22.1%) since GB200 carries the committed fit's BF16 GEMM "
                       "scale, 64 GFLOP (an older fit's 32 gave +4.0%): Blackwell's BF16 saturation rests on two "
                       "fitting runs"))]


@pytest.mark.heavy
@pytest.mark.parametrize("run_id", GB200_MOE_PLAIN)
def test_gb200_moe_through_the_plain_path_is_placed_by_the_search_within_15_percent(runs, run_id):
    """No segments given (the plain path): the search places the experts in rack segments as NVIDIA's launcher did.
    It leaves combined 1F1B off, as these recipes did (on GB200 it pays only beside CUDA graphs of whole layers,
    which Megatron-Bridge's stack does not run by default) and says why; the plan (HybridEP, where the recipes ran
    NCCL's all-to-all) and the run as its recipe configured it are each predicted within 15%."""
    from benchmarks.plain_path import plain
    run = runs[run_id]
    result = plain(run, 60, whole_row=True)
    assert result.segment_devices and any(r.startswith("placement chosen by the search") for r in result.reasons)
    assert not result.layout.moe_a2a_overlap and any(r.startswith("combined 1F1B left off") for r in result.reasons)
    assert abs(result.step_time_s / run.measured_step_s - 1) < 0.15
    as_run = plain(run, 60, whole_row=True, settings={"a2a_overlap": False, "dispatcher": "alltoall"})
    assert abs(as_run.step_time_s / run.measured_step_s - 1) < 0.15
    assert as_run.segment_devices and any(r.startswith("placement chosen by the search") for r in as_run.reasons)


@pytest.mark.heavy
def test_where_a_run_ran_the_plain_plans_dispatcher_and_combined_1f1b_the_plain_path_is_within_25_percent():
    """Published MoE runs never fitted (benchmarks/plain_choices.py: Megatron-Bridge's HybridEP overlap benchmark
    and MoE hardware card, DeepEP and HybridEP on H100, B200 and GB200): where the run ran the dispatcher family
    and the combined 1F1B switch the plain path chose for it, the plain path predicts it within issue 43's per-row
    bar of 25%, except the gaps the table names (the model zoo's H100 combined-1F1B A/B); at least four rows do
    (the GB200 rows among them, combined 1F1B left off as they ran)."""
    from benchmarks.plain_choices import CHOICES_MEASURED, plain_choice, shared_runs
    runs_by_id = shared_runs()
    matched = 0
    for entry in (entry for entry in CHOICES_MEASURED if "not stated" not in entry.source):
        plan, run = plain_choice(entry, runs_by_id, 30)
        ran = dict(item.split("=") for item in entry.ran_settings.split(","))
        ran_overlap = ran["a2a_overlap"] == "true"
        if plan.layout.moe_dispatcher != ran["dispatcher"] or plan.layout.moe_a2a_overlap != ran_overlap:
            continue
        matched += 1
        assert_within_25_percent_or_known_gap(entry, plan.step_time_s / entry.measured_s(run) - 1)
    assert matched >= 4


@pytest.mark.parametrize("run_id,tp,tflops,tokens_per_s", [
    # Megatron-Bridge's 25.11 table (docs/performance-summary.md @5776a6d90): model TFLOP/s and tokens/s per GPU
    ("mbridge-25p11-h100-qwen3-235b-a22b-fp8-256gpu", 2, 233, 1575),
    ("mbridge-25p11-gb200-qwen3-235b-a22b-bf16-256gpu", 1, 728, 4916),
    ("mbridge-25p11-b200-qwen3-235b-a22b-mxfp8-64gpu", 1, 484, 3269)])
def test_megatron_model_flops_are_what_the_published_tables_divide_by(runs, run_id, tp, tflops, tokens_per_s):
    """The long-context rows' steps come from the MoE model zoo's model TFLOP/s through Megatron-LM's FLOP count
    (`megatron_flops_per_sequence`); Megatron-Bridge's table prints both a run's TFLOP/s and its tokens/s, whose
    ratio is the FLOPs per token its logs counted: the count agrees within the table's three-digit rounding."""
    from benchmarks.plain_choices import megatron_flops_per_sequence
    run = runs[run_id]
    per_token = megatron_flops_per_sequence(run.model, run.seq_len, tp) / run.seq_len
    assert per_token == pytest.approx(tflops * 1e12 / tokens_per_s, rel=0.003)


def assert_within_25_percent_or_known_gap(entry, error: float) -> None:
    """Issue 43's per-row bar, except where the table names a gap the model does not bill (benchmarks/plain_choices.py
    `known_gap`, docs/accuracy-plain.md), which must still be one: beyond 20%."""
    if entry.known_gap:
        assert abs(error) > 0.20, f"{entry.source}: {error:+.1%}, within 20%: the known gap is gone"
    else:
        assert abs(error) < 0.25, f"{entry.source}: {error:+.1%}"


@pytest.mark.heavy
def test_what_the_moe_runs_of_the_plain_paths_choices_ran_is_predicted_within_25_percent():
    """Every stated-precision run of those choices (the MoE hardware card's DeepEP and HybridEP rows on H100, B200
    and GB200 among them, the MoE model zoo's H100 rows), predicted with the settings it states pinned (dispatcher,
    combined 1F1B, FP8 recipe, recomputation where stated): within issue 43's per-row bar of 25%, except the gaps
    the table names; never fitted."""
    from benchmarks.plain_choices import CHOICES_MEASURED, plain_choice, shared_runs
    runs_by_id = shared_runs()
    stated = [entry for entry in CHOICES_MEASURED if "not stated" not in entry.source]
    assert len(stated) >= 10 and all(entry.ran_settings for entry in stated)
    for entry in stated:
        plan, run = plain_choice(entry, runs_by_id, 30, as_ran=True)
        assert plan.layout.moe_dispatcher == parse_text(entry.ran_settings)["dispatcher"], entry.source
        error = plan.step_time_s / entry.measured_s(run) - 1
        if entry.known_gap and abs(error) < 0.25:
            continue   # a gap through the plain path's choices (asserted above), not in what ran
        assert_within_25_percent_or_known_gap(entry, error)


def test_the_band_covers_a_next_run_as_split_conformal_prediction_promises():
    """`error_bands.band` on n exchangeable residuals: a next one lies inside with probability (hi - lo) / (n + 1)
    for continuous residuals (rank symmetry), which split conformal prediction puts at 90% or more; counted here
    by simulation (Gaussian and a skewed law, 20 and 24 residuals as the classes have), not from the code's ranks.
    The interpolated 5th and 95th percentiles it replaced cover about 82% there (shown beside, so the
    simulation can tell the two apart)."""
    import random
    import statistics

    from benchmarks.error_bands import band
    rng, trials = random.Random(7), 20000
    for n in (20, 24):
        for draw in (lambda: rng.gauss(0.0, 0.1), lambda: rng.lognormvariate(0.0, 0.5) - 1.0):
            inside = percentile_inside = 0
            for _ in range(trials):
                fitted, next_run = [draw() for _ in range(n)], draw()
                low, high = band(fitted)
                inside += low <= next_run <= high
                cuts = statistics.quantiles(fitted, n=20, method="inclusive")
                percentile_inside += cuts[0] <= next_run <= cuts[-1]
            assert inside / trials >= 0.895, (n, inside / trials)
            assert percentile_inside / trials < 0.85


@pytest.mark.heavy
def test_the_shipped_band_covers_most_held_out_measurements(runs):
    """planner/error_bands.yaml was fitted on calibrate's fitting half; on the held-out half, through the plain
    path (a MoE run's recipe's dispatcher and combined 1F1B pinned: the configuration it ran), at least 80% of
    measured step times lie inside each plan's band (issue 43's bar)."""
    from benchmarks.accuracy_sources import NOT_USABLE
    from benchmarks.plain_path import plain, recipe_choices
    usable = [run for run in runs.values() if run.id not in NOT_USABLE]
    held = [run for _, half in split_runs(usable).values() for run in half]
    inside = 0
    for run in held:
        result = plain(run, 20, whole_row=True, settings=recipe_choices(run) if run.model.moe else None)
        low, high = result.step_time_band_s
        inside += low <= run.measured_step_s <= high
    assert inside >= 0.8 * len(held), f"{inside} of {len(held)}"



@pytest.mark.heavy
def test_the_device_gemm_figures_are_what_the_committed_fit_gives(runs):
    """Each device profile's sustained fraction and GEMM saturation scales are benchmarks/calibrate.py's fit on
    shared/validation as committed (a same-silicon profile without runs of its own carrying its silicon's), not
    figures left behind by an older model: B200 and GB200 carried an older fit's BF16 scale (32 GFLOP where the
    committed procedure gives 64) until 2026-12-07, unseen because nothing compared them."""
    from benchmarks.calibrate import fit_devices, profiles_of
    from hardware_profiles.loader import load_device
    fits = profiles_of(fit_devices(list(runs.values()), 10.0))
    assert {"a100-80g", "h100-sxm", "b200", "gb200"} <= set(fits)
    for name, fitted in fits.items():
        gemm = load_device(name).gemm
        assert (gemm.sustained_fraction, gemm.half_work_gflop) == (fitted.sustained, fitted.scales.bf16), name
        if fitted.scales.fp8 is not None:
            assert gemm.fp8_half_work_gflop == fitted.scales.fp8, name


@pytest.mark.heavy
def test_the_clusters_all_to_all_share_is_what_the_committed_fit_gives(runs):
    """`inter_node.all_to_all_fraction` in the built-in clusters is benchmarks/calibrate_all_to_all.py's fit on
    shared/validation as committed (the runs whose prediction moves with it: MoE runs), not a figure left behind
    by an older model; the clusters on the same fabric carry it."""
    from benchmarks import calibrate_all_to_all as all_to_all
    from hardware_profiles.loader import load_cluster
    from benchmarks.calibrate import fixed_layouts
    fitted = all_to_all.calibrate(fixed_layouts([run for run in runs.values() if run.model.moe is not None], 10.0),
                                  write=False)
    assert fitted, "no run depends on the figure"
    for cluster, fraction in fitted.items():
        assert load_cluster(cluster).inter_node.all_to_all_fraction == fraction, cluster
