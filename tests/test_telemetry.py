"""Telemetry closes the loop (runtime/telemetry.py, planner/calibration.py): a job writes its measured step
parts beside its plan's prediction; `planner calibrate --telemetry` refits the device profile from them, and
the refitted profile predicts a run it never saw (twice the batch) closer to what that run measures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hardware_profiles.errors import UserInputError
from planner import api
from planner.calibration import calibrate
from test_runtime import ROOT, TRAIN, launch

pytestmark = pytest.mark.timed

PLANNER = str(Path(sys.executable).with_name("planner"))
MODEL = "tests/models/matmul-bound.yaml"
LAYOUT = "tp=1,pp=1,dp=1,cp=1,zero=0,recompute=none,mbs=4"
ONE_CPU = dict(num_devices=1, devices_per_node=1, stack="parallel-planner")
SEQ = 256
FITTED_BATCH, HELD_OUT_BATCH = 4, 8   # one micro-batch of 4, then two of the same shape accumulated


def forward_backward(plan) -> float:
    return plan.step_time_s - plan.breakdown["optimizer_s"]


def off_profile(tmp_path) -> Path:
    """The CPU profile four times too slow (GEMM rate and memory bandwidth), as a user's own file: where a
    profile starts is not what the refit depends on (the shipped CPU figures are nominal, and close on some days)."""
    data = yaml.safe_load((ROOT / "hardware_profiles" / "devices" / "cpu.yaml").read_text())
    data["peak_tflops"] = {dtype: value / 4 for dtype, value in data["peak_tflops"].items()}
    data["hbm_bandwidth_gbytes_per_s"] /= 4
    path = tmp_path / "cpu-off.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_refitted_profile_predicts_a_held_out_run(tmp_path):
    """A model whose CPU step is matrix work (a tiny one's is mostly per-op host time, which no FLOP rate
    describes), the held-out run accumulating two micro-batches of the fitted run's shape (a larger micro-batch
    leaves the CPU's caches: its time grows faster than its FLOPs, as no device profile says), both runs in
    one launch, under the same load. One process: with dp=2 the step carried a gloo gradient all-reduce whose
    time the profile's nominal figures cannot know, charged to compute by the refit (it over-predicted the held-out
    run by 8-21%, and failed CI once). The plans are made on a user's profile file, which the refit starts from.

    A second launch is allowed, each held to the same bound: CI shares its cores, and one burst of load during
    one run of the pair moves its median past any fair tolerance (CI stop 34: the fitted run's step 37% slower
    than on this project's machine, the held-out run's 13%, so the refit over-predicted by 21%)."""
    device = str(off_profile(tmp_path))
    for attempt in (1, 2):
        started, refitted, measured = refit_and_hold_out(tmp_path / f"attempt{attempt}", device)
        print(f"attempt {attempt}, held-out forward+backward: started from {started:.4f} s, refitted "
              f"{refitted:.4f} s, measured {measured:.4f} s")
        # within 20% of what the run it never saw measured (2-5% in runs here, also beside a busy core), from
        # a profile that was several times off
        before, after = abs(started - measured), abs(refitted - measured)
        if after < 0.2 * measured and after < before / 3:
            return
    pytest.fail(f"the refitted profile predicted the held-out run {refitted:.4f} s, measured {measured:.4f} s, "
                f"twice beyond 20%")


def refit_and_hold_out(directory: Path, device: str) -> tuple[float, float, float]:
    """One launch of the fitted and the held-out run, the refit from the first, and the held-out run's
    forward+backward as the user's profile predicted it, as the refitted one does, and as measured."""
    directory.mkdir()
    runs, cases = {}, []
    for batch in (FITTED_BATCH, HELD_OUT_BATCH):
        plan = api.evaluate(MODEL, device=device, global_batch=batch, seq_len=SEQ, layout=LAYOUT, **ONE_CPU)
        plan.save(directory / f"plan{batch}.yaml")
        cases.append({"name": f"batch{batch}", "model": MODEL, "plan": str(directory / f"plan{batch}.yaml"),
                      "telemetry": str(directory / f"tel{batch}")})
        runs[batch] = plan
    (directory / "cases.json").write_text(json.dumps(cases))
    launch(1, "--cases", str(directory / "cases.json"), "--steps", "10", *TRAIN, "--precision", "fp32")
    lines = (directory / f"tel{FITTED_BATCH}" / "rank-0.jsonl").read_text().splitlines()
    header, records = json.loads(lines[0])["header"], [json.loads(line) for line in lines[1:]]
    assert header["predicted"]["compute_s"] == pytest.approx(runs[FITTED_BATCH].breakdown["compute_s"])
    assert header["device"] == str(Path(device).resolve())   # the user's file, not the built-in of that name
    assert [r["step"] for r in records] == list(range(1, 11))
    for r in records:   # the parts add up to the step
        assert r["step_s"] == pytest.approx(r["forward_backward_s"] + r["checks_s"] + r["optimizer_s"]
                                            + r["checkpoint_blocking_s"], rel=1e-9)
    fitted = directory / "cpu-fitted.yaml"
    shown = subprocess.run([PLANNER, "calibrate", "--telemetry", str(directory / f"tel{FITTED_BATCH}"),
                            "--out", str(fitted)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
    assert "forward_backward_s" in shown and "refit" in shown
    held_out = calibrate(str(directory / f"tel{HELD_OUT_BATCH}"))
    measured = next(p.measured_s for p in held_out.parts if p.name == "forward_backward_s")
    refitted = api.evaluate(MODEL, device=str(fitted), global_batch=HELD_OUT_BATCH, seq_len=SEQ, layout=LAYOUT,
                            **ONE_CPU)
    return forward_backward(runs[HELD_OUT_BATCH]), forward_backward(refitted), measured


@pytest.mark.parametrize("line,named", [
    ("not json", "not valid JSON"),
    ('{"step": 1, "rank": 0, "step_s": -1, "forward_backward_s": 0, "checks_s": 0, "optimizer_s": 0, '
     '"checkpoint_blocking_s": 0}', "'step_s' missing or not seconds >= 0"),
    ('{"step": "1", "rank": 0}', "'step' missing or not a whole number"),
])
def test_bad_telemetry_names_the_file_and_line(tmp_path, line, named):
    header = {"header": {"model": "m", "cluster": "", "device": "", "num_devices": 1, "layout": "",
                         "predicted_step_s": None, "predicted": {}}}
    (tmp_path / "rank-0.jsonl").write_text(json.dumps(header) + "\n" + line + "\n")
    with pytest.raises(UserInputError, match=named) as caught:
        calibrate(str(tmp_path))
    assert "rank-0.jsonl:2" in str(caught.value)


def test_an_empty_directory_is_refused(tmp_path):
    with pytest.raises(UserInputError, match="no rank-R.jsonl files"):
        calibrate(str(tmp_path))


def test_telemetry_without_its_plan_is_refitted_by_one_ratio_and_says_so(tmp_path):
    """An older header (no plan to predict again): the compute refit is the plain ratio, and a note says so."""
    header = {"header": {"model": "tiny-llama", "cluster": "cpu-x2", "device": "cpu", "num_devices": 2,
                         "layout": "dp=2,zero=1", "predicted_step_s": 0.2, "predicted": {"compute_s": 0.2}}}
    steps = [{"step": s, "rank": 0, "step_s": 0.1, "forward_backward_s": 0.1, "checks_s": 0.0, "optimizer_s": 0.0,
              "checkpoint_blocking_s": 0.0} for s in range(1, 6)]
    (tmp_path / "rank-0.jsonl").write_text("\n".join(json.dumps(line) for line in [header, *steps]) + "\n")
    result = calibrate(str(tmp_path))
    assert any("refitted by one ratio" in note for note in result.notes)
    # twice as fast as predicted: the fraction of 1 cannot double, so the peak does
    assert [(r.field, r.new) for r in result.refits] == [("gemm.sustained_fraction", 1.0), ("peak_tflops x", 2.0)]


# (layout, the slow rank, the rank that waits for it, the part its wait is charged to, micro-batches a step)
DELAYED = [("dp=2,zero=0,mbs=4", 1, 0, "dp_comm_s", 1),
           ("tp=2,dp=1,zero=0,mbs=8", 1, 0, "tp_comm_s", 1),
           ("cp=2,dp=1,zero=0,mbs=8", 1, 0, "cp_comm_s", 1),
           ("pp=2,dp=1,zero=0,mbs=2", 0, 1, "pipeline_bubble_s", 4)]
SLOW_FROM = 3


def _misattributed_waits(directory) -> list[str]:
    """One launch of every DELAYED case: what the telemetry charged wrongly (empty when every wait is where it
    belongs)."""
    from runtime.faults import SLOW_S
    cases = [{"name": part, "layout": layout, "inject": f"slow@{SLOW_FROM}:{slow}", "telemetry_comm_every": 1,
              "telemetry": str(directory / part)} for layout, slow, _, part, _ in DELAYED]
    directory.mkdir()
    (directory / "cases.json").write_text(json.dumps(cases))
    launch(2, "--cases", str(directory / "cases.json"), "--steps", "4", *TRAIN, "--straggler-every", "0")
    wrong = []
    for layout, slow, waiting, part, micro_batches in DELAYED:
        records = {}
        for rank in (0, 1):
            lines = (directory / part / f"rank-{rank}.jsonl").read_text().splitlines()[1:]
            records[rank] = {json.loads(line)["step"]: json.loads(line) for line in lines}
        delay = SLOW_S * micro_batches
        for step in (SLOW_FROM, SLOW_FROM + 1):
            grown = records[waiting][step][part] - records[waiting][SLOW_FROM - 1][part]
            if not grown > 0.75 * delay:
                wrong.append(f"{layout} step {step}: the waiting rank's {part} grew {grown:.3f} s of {delay} s")
            # the slow rank itself did not wait for it, and the waiting rank's other kinds did not take it
            if not records[slow][step][part] < 0.5 * delay:
                wrong.append(f"{layout} step {step}: the slow rank's own {part} {records[slow][step][part]:.3f} s")
            others = {k: v for k, v in records[waiting][step].items()
                      if k.endswith("_comm_s") or k == "pipeline_bubble_s"}
            if not sum(others.values()) - others[part] < 0.5 * delay:
                wrong.append(f"{layout} step {step}: the waiting rank's other kinds took {others}")
    return wrong


def test_exposed_communication_is_charged_to_the_kind_that_waited(tmp_path):
    """Independent truth: from step 3 one rank's compute is 0.2 s slower per micro-batch (`slow@3:R`, a sleep in
    its first module). Its peer waits for it in the collective that follows - the gradient all-reduce under dp,
    the tensor-parallel all-reduce under tp, the K/V gather under cp, the activation receive under pp - and the
    telemetry must charge that wait, and only it, to that kind. Two ranks share two cores: a burst of load on
    the machine can stall the fast rank too (CI once saw the slow rank wait 0.24 s in its own tp all-reduce), so
    a second launch is allowed, held to the same bounds."""
    first = _misattributed_waits(tmp_path / "attempt1")
    if first:
        print("attempt 1:", first)
        second = _misattributed_waits(tmp_path / "attempt2")
        assert not second, (first, second)


def test_calibrate_takes_compute_as_what_the_slowest_rank_did_not_wait_for(tmp_path):
    """By hand: rank 0 waited 0.10 s for its neighbour stage, rank 1 0.02 s, both took 0.30 s of
    forward+backward. The pipeline's waits are the longest (0.10 s, beside the plan's bubble plus hops,
    0.05 + 0.01); compute is 0.30 - (0.30 - max(0.30 - 0.10, 0.30 - 0.02)) = 0.28 s, and the plan's 0.20 s of
    compute makes the GEMM rate 0.20 / 0.28 of what it was (one ratio: this header carries no plan)."""
    predicted = {"compute_s": 0.2, "pipeline_bubble_s": 0.05, "pp_comm_s": 0.01}
    header = {"header": {"model": "tiny-llama", "cluster": "cpu-x2", "device": "cpu", "num_devices": 2,
                         "layout": "pp=2,zero=1", "predicted_step_s": 0.26, "predicted": predicted}}
    zero = {part: 0.0 for part in ("tp_comm_s", "cp_comm_s", "ep_comm_s", "zero_comm_s", "dp_comm_s", "other_comm_s")}
    lines = [header]
    for step in range(1, 6):
        for rank, waited in ((0, 0.10), (1, 0.02)):
            lines.append({"step": step, "rank": rank, "step_s": 0.3, "forward_backward_s": 0.3, "checks_s": 0.0,
                          "optimizer_s": 0.0, "checkpoint_blocking_s": 0.0, "pipeline_bubble_s": waited, **zero})
    for rank in (0, 1):
        (tmp_path / f"rank-{rank}.jsonl").write_text(
            "\n".join(json.dumps(line) for line in lines if "header" in line or line["rank"] == rank) + "\n")
    result = calibrate(str(tmp_path))
    parts = {part.name: part for part in result.parts}
    assert parts["pipeline_bubble_s"].measured_s == pytest.approx(0.10)
    assert parts["pipeline_bubble_s"].predicted_s == pytest.approx(0.06)
    assert parts["compute_s"].measured_s == pytest.approx(0.28)
    assert parts["other_comm_s"].predicted_s is None
    fraction = next(r for r in result.refits if r.field == "gemm.sustained_fraction")
    assert fraction.new == pytest.approx(fraction.old * 0.2 / 0.28)


def test_collectives_are_charged_by_their_groups_ranks():
    """ep over all of dp (one group of ranks for both): the all-to-all is the experts', the rest gradients';
    the pipeline group's sends and receives are waits, its all-reduce (tied embeddings) a gradient reduction."""
    from planner.calibration import EXPOSED_PARTS
    from runtime.comm_telemetry import ExposedComm, GroupKinds
    assert ExposedComm.parts() == EXPOSED_PARTS   # what the runtime writes is what calibrate reads
    kinds = GroupKinds((((0, 1), "dp_comm_s"), ((0, 1), "ep_comm_s"), ((0, 2), "pipeline_bubble_s"),
                        ((0, 4), "tp_comm_s")))
    assert kinds.part((0, 1), "alltoall_base_") == "ep_comm_s"
    assert kinds.part((0, 1), "all_to_all_single") == "ep_comm_s"
    assert kinds.part((0, 1), "allreduce_") == "dp_comm_s"
    assert kinds.part((0, 2), "send") == kinds.part((0, 2), "recv_") == "pipeline_bubble_s"
    assert kinds.part((0, 2), "allreduce_") == "dp_comm_s"
    assert kinds.part((0, 4), "all_gather_into_tensor") == "tp_comm_s"
    assert kinds.part((3, 7), "allreduce_") == kinds.part(None, "barrier") == "other_comm_s"


@pytest.mark.parametrize("value", ["-1"])
def test_a_bad_comm_cadence_is_refused_before_any_process_group(value):
    proc = subprocess.run([sys.executable, "-m", "runtime.train", "--telemetry-comm-every", value],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--telemetry-comm-every" in proc.stderr and "Traceback" not in proc.stderr
