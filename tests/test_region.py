"""A plan says where it lies outside the per-rank shapes published runs measured (planner/region.py; the ranges
in planner/measured_region.yaml come from shared/validation's published degrees, benchmarks/measured_region.py)."""
import re

import pytest

import planner
from hypothesis import given, strategies as st

from planner.region import ShapeBound, job_outside_notes, outside_notes, reachable, shapes

pytestmark = pytest.mark.heavy


def test_shapes_are_the_layouts_per_rank_sizes():
    assert shapes(8192, 16384, 0, tp=8, cp=32, ep=1) == {"tokens_per_cp_rank": 256, "hidden_per_tp_rank": 2048}
    assert shapes(4096, 7168, 256, tp=1, cp=1, ep=8)["experts_per_ep_rank"] == 32


@given(total=st.integers(1, 5000), low=st.integers(1, 6000), span=st.integers(0, 3000))
def test_a_bound_is_reachable_where_some_degree_puts_the_shape_inside(total, low, span):
    bound = ShapeBound("cp", total, low, low + span)
    assert reachable(bound) == any(low <= total // degree <= low + span for degree in range(1, total + 1))


def test_a_job_whose_own_sequence_lies_below_every_run_says_so_and_shows_no_plan_inside():
    """1,024 tokens per sequence: tokens per cp rank is at most 1,024 whatever the layout, below the 2,048 the
    published dense runs start at. The plan says the job itself lies outside; it does not search inside (where
    it had reported that no layout divides the model: not why)."""
    plan = planner.plan("llama3-8b", device="h100-sxm", num_devices=8, global_batch=64, seq_len=1024)
    assert plan.outside_measured and plan.inside_measured is None
    said = " ".join(plan.reasons)
    assert "the job itself lies outside the measured region" in said and "at most 1,024 at any cp" in said
    assert "no plan inside the measured region was found" not in said
    assert not job_outside_notes(8192, 4096, 0) and job_outside_notes(1024, 4096, 0)
    report = planner.whatif("llama3-8b", device="h100-sxm", num_devices=8, sweep="seq-len=1024", global_batch=64)
    assert "the job itself lies outside it" in report.rows[0].extrapolates


def test_llama3_405b_on_16384_h100_says_it_extrapolates_in_cp_and_tp():
    """Without TP overlap the search's plan (cp32: 256 tokens of each sequence per rank; tp1: 16,384-wide GEMMs per
    rank) lies outside every dense run measured; Meta's TP8 layout (2,048 per rank, cp1) does not. The plan shows
    the best plan inside the region beside it. With TP overlap, which Megatron-Core runs and the search chooses,
    the plan is TP8 and inside: it says nothing of the region."""
    common = dict(device="h100-sxm", num_devices=16384, global_batch=2048, seq_len=8192, time_limit_s=120)
    chosen = planner.plan("llama3-405b", **common)
    assert chosen.layout.tp_comm_overlap and not chosen.outside_measured and chosen.inside_measured is None
    plan = planner.plan("llama3-405b", **common, tp_overlap=False)
    assert plan.outside_measured
    said = " ".join(plan.outside_measured)
    if plan.layout.cp > 4:
        assert f"{8192 // plan.layout.cp:,} tokens per context-parallel rank" in said
    if plan.layout.tp < 4:
        assert "hidden width per tensor-parallel rank" in said
    assert not outside_notes(8192, 16384, 0, tp=8, cp=1, ep=1)
    # beside it, the best plan inside the measured region: its shapes inside, and no faster than the plan
    inside = plan.inside_measured
    assert inside is not None and inside.step_time_s >= plan.step_time_s * (1 - 1e-9)
    degrees = dict(item.split("=") for item in inside.layout.split(","))
    assert not outside_notes(8192, 16384, 0, tp=int(degrees["tp"]), cp=int(degrees["cp"]), ep=int(degrees["ep"]))


def test_a_whatif_point_says_where_its_plan_extrapolates_and_the_best_plan_inside():
    """Each point of a sweep carries what its plan alone says: the shapes outside the measured region and the best
    plan inside it, with its step time."""
    report = planner.whatif("llama3-70b", device="h100-sxm", sweep="num-devices=64,1024", global_batch=1024)
    for row in report.rows:
        alone = planner.plan("llama3-70b", device="h100-sxm", num_devices=row.num_devices, global_batch=1024)
        assert bool(row.extrapolates) == bool(alone.outside_measured)
        if alone.inside_measured is not None:
            assert f"{alone.inside_measured.step_time_s:.2f} s" in row.extrapolates


def test_a_dispatcher_no_published_moe_run_used_is_said_and_the_best_plan_inside_keeps_theirs():
    """The published MoE runs on H100 all dispatched with NCCL's all-to-all (measured_region.yaml's dispatchers by
    device, from their stacks and launchers; a GB200 row's HybridEP inside its rack measures nothing of DeepEP across
    InfiniBand). Qwen3-30B-A3B's 128 experts over 16 H100 in two nodes: the search prefers DeepEP-style dispatch
    (one copy per remote node), which is outside what was measured; the plan says so, and the best plan inside the
    region dispatches as the runs did, slower by what the deduplication saved."""
    from planner.region import measured_dispatchers
    assert measured_dispatchers(128, "h100-sxm") == ("alltoall",) and measured_dispatchers(0, "h100-sxm") == ()
    assert measured_dispatchers(128, "gb200") == ("alltoall", "deepep")
    assert measured_dispatchers(128, "h200") == ("alltoall",)   # no MoE run on it: what every device's measured
    plan = planner.plan("qwen3-30b-a3b", device="h100-sxm", num_devices=16, global_batch=64, tp=1, pp=1, cp=1, ep=16)
    assert plan.layout.moe_dispatcher == "deepep"
    assert any("the deepep MoE dispatcher" in note for note in plan.outside_measured)
    inside = plan.inside_measured
    assert inside is not None and "dispatcher=" not in inside.layout   # alltoall: the layout text's default
    assert inside.step_time_s > plan.step_time_s
    pinned = planner.plan("qwen3-30b-a3b", device="h100-sxm", num_devices=16, global_batch=64, tp=1, pp=1, cp=1,
                          ep=16, dispatcher="alltoall")
    assert not pinned.outside_measured and pinned.step_time_s == pytest.approx(inside.step_time_s, rel=1e-9)
    assert plan.outside_measured == [note for note in plan.outside_measured if "dispatcher" in note]


def test_combined_1f1b_where_no_published_run_on_the_device_ran_it_is_said_and_the_best_plan_inside_runs_without():
    """Only H100 MoE runs ran combined 1F1B (Megatron-Bridge's Qwen3-235B). An H200 plan (no published MoE run
    there) that chooses it says so, and its best plan inside the measured region runs without it; a GB200 plan
    with it pinned says so too (the search leaves it off there: tests/test_combined_1f1b_graphs.py); an H100 plan
    that chooses it says nothing of it."""
    from planner.region import overlap_measured
    assert overlap_measured(128, "h100-sxm") and not overlap_measured(128, "gb200") and not overlap_measured(0, "h100-sxm")
    assert not overlap_measured(128, "h200")   # no MoE run on it, and not run on every device that has them
    common = dict(num_devices=64, global_batch=512, tp=1, pp=4, cp=1, ep=16, vp=2, time_limit_s=60)
    h200 = planner.plan("qwen3-30b-a3b", device="h200", dispatcher="alltoall", **common)
    assert h200.layout.moe_a2a_overlap   # the search chooses it here: it hides the all-to-alls
    assert any("combined 1F1B" in note for note in h200.outside_measured)
    inside = h200.inside_measured
    assert inside is not None and "a2a_overlap=true" not in inside.layout
    assert inside.step_time_s > h200.step_time_s
    gb200 = planner.plan("qwen3-30b-a3b", device="gb200", dispatcher="alltoall", a2a_overlap=True, **common)
    assert any("combined 1F1B" in note and "gb200" in note for note in gb200.outside_measured)
    h100 = planner.plan("qwen3-30b-a3b", device="h100-sxm", dispatcher="alltoall", a2a_overlap=True, **common)
    assert not any("combined 1F1B" in note for note in h100.outside_measured)


def test_a_plan_running_combined_1f1b_on_h100_says_what_published_ab_runs_measured():
    """The never-fitted A/Bs of combined 1F1B on H100 (benchmarks/sweeps.yaml: Megatron-Bridge's HybridEP benchmark on
    Qwen3-30B, the Megatron-Core MoE model zoo's DeepEP pair on Qwen3-235B) are in measured_region.yaml with the
    saving each measured, read from the sources' step times, and the saving the model credits there as it predicts
    now; a plan running combined 1F1B on H100 says both, and which A/B's source also gave the device's dispatch rate
    beside compute; it calls its credit maybe too large only where every A/B realised less than credited."""
    import yaml
    from benchmarks.measured_region import overlap_abs
    from benchmarks.ranking import SWEEPS
    from planner.region import _region
    shipped = _region()["MoE"]["a2a_overlap_ab"]
    assert shipped == overlap_abs()   # the committed table is the committed script's
    measured = {entry["name"]: [variant["measured"] for variant in entry["variants"]]
                for entry in yaml.safe_load(SWEEPS.read_text())}
    assert {ab["job"]: ab["measured_saving"] for ab in shipped["h100-sxm"]} == {
        "Qwen3-30B-A3B, 16 H100, Megatron-Bridge HybridEP, combined 1F1B": round(1 - 20.992 / 24.714, 4),
        "Qwen3-235B-A22B, 256 H100, Megatron-Core moe_dev f3e6c5, combined 1F1B": round(1 - 17.6 / 19.7, 4)}
    assert all(measured[ab["job"]] in ([24.714, 20.992], [19.7, 17.6]) for ab in shipped["h100-sxm"])
    plan = planner.plan("qwen3-30b-a3b", device="h100-sxm", num_devices=16, global_batch=1024, seq_len=4096,
                        precision="bf16", stack="megatron-bridge", time_limit_s=60)
    assert plan.layout.moe_a2a_overlap
    said = next(r for r in plan.reasons if "published A/Bs on h100-sxm" in r)
    assert "15.1% of the step measured" in said and "10.7% of the step measured" in said
    assert re.search(r"15\.1% of the step measured, [0-9.]+% credited \(its source's Nsight comparison gives "
                     r"h100-sxm's flex_dispatch_rate_beside_compute\)", said)
    realised_less = [ab["measured_saving"] < ab["model_saving"] for ab in shipped["h100-sxm"]]
    assert ("too large" in said) == all(realised_less)
    assert not any("published A/Bs" in r for r in planner.evaluate(
        "qwen3-30b-a3b", layout="tp=1,pp=1,cp=1,ep=8,mbs=1,a2a_overlap=false", device="h100-sxm", num_devices=16,
        global_batch=1024, seq_len=4096, precision="bf16", stack="megatron-bridge").reasons)


def test_zero3_over_more_ranks_than_any_run_sharded_is_said_and_the_plan_inside_shards_less():
    """The dense runs of shared/validation that shard their parameters (Megatron-Bridge's FSDP on 8 H100; the GB200
    rows' precision is unstated, so the region leaves them out) do so over 8 ranks at most: ZeRO-3 over more is
    outside what was measured, where Narayanan et al. 2021's DeepSpeed ZeRO-3 runs (benchmarks/sweeps.yaml) ran
    up to 1.8 times as slow as the model predicts. Llama 3 8B on 128 H100 with torchtitan: the search shards over
    all 128 (FSDP, as torchtitan's own table ran it); the plan says so, and the best plan inside the region keeps
    ZeRO-3 to 8 ranks or shards only the optimizer states and gradients."""
    from planner.region import zero3_ranks_max
    most = zero3_ranks_max(0)
    assert most == 8
    assert outside_notes(8192, 4096, 0, tp=1, cp=1, ep=1, zero=3, sharded_ranks=most) == []
    assert outside_notes(8192, 4096, 0, tp=1, cp=1, ep=1, zero=2, sharded_ranks=1536) == []
    said = outside_notes(8192, 4096, 0, tp=1, cp=1, ep=1, zero=3, sharded_ranks=1536)
    assert len(said) == 1 and "ZeRO-3 parameter sharding over 1,536 ranks" in said[0]
    plan = planner.plan("llama3-8b", device="h100-sxm", num_devices=128, global_batch=256, seq_len=8192,
                        stack="torchtitan")
    assert plan.layout.zero == 3 and plan.layout.dp * plan.layout.cp > most
    assert any("ZeRO-3 parameter sharding" in note for note in plan.outside_measured)
    inside = dict(item.split("=") for item in plan.inside_measured.layout.split(","))
    assert int(inside["zero"]) < 3 or int(inside["dp"]) * int(inside["cp"]) <= most
    assert plan.inside_measured.step_time_s >= plan.step_time_s * (1 - 1e-9)
