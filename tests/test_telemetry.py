"""Telemetry closes the loop (runtime/telemetry.py, planner/calibration.py): a job writes its measured step
parts beside its plan's prediction; `planner calibrate --telemetry` refits the device profile from them, and
the refitted profile predicts a run it never saw (twice the batch) closer to what that run measures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hardware_profiles.errors import UserInputError
from planner import api
from planner.calibration import calibrate
from test_runtime import ROOT, TRAIN, launch

PLANNER = str(Path(sys.executable).with_name("planner"))
LAYOUT = "tp=1,pp=1,dp=2,cp=1,mbs=4,zero=0,recompute=none"
CPU_PAIR = dict(num_devices=2, devices_per_node=2, stack="parallel-planner")


def forward_backward(plan) -> float:
    return plan.step_time_s - plan.breakdown["optimizer_s"]


def test_a_refitted_profile_predicts_a_held_out_run_better(tmp_path):
    runs = {}
    for batch in (8, 16):
        plan = api.evaluate("tiny-llama", device="cpu", global_batch=batch, layout=LAYOUT, **CPU_PAIR)
        plan.save(tmp_path / f"plan{batch}.yaml")
        launch(2, "--plan", str(tmp_path / f"plan{batch}.yaml"), "--steps", "8", *TRAIN, "--precision", "fp32",
               "--telemetry", str(tmp_path / f"tel{batch}"))
        runs[batch] = plan
    lines = (tmp_path / "tel8" / "rank-1.jsonl").read_text().splitlines()
    header, records = json.loads(lines[0])["header"], [json.loads(line) for line in lines[1:]]
    assert header["predicted"]["compute_s"] == pytest.approx(runs[8].breakdown["compute_s"])
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:   # the parts add up to the step
        assert r["step_s"] == pytest.approx(r["forward_backward_s"] + r["checks_s"] + r["optimizer_s"]
                                            + r["checkpoint_blocking_s"], rel=1e-9)
    fitted = tmp_path / "cpu-fitted.yaml"
    shown = subprocess.run([PLANNER, "calibrate", "--telemetry", str(tmp_path / "tel8"), "--out", str(fitted)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, check=True).stdout
    assert "forward_backward_s" in shown and "refit cpu" in shown
    held_out = calibrate(str(tmp_path / "tel16"))
    measured = next(p.measured_s for p in held_out.parts if p.name == "forward_backward_s")
    refitted = api.evaluate("tiny-llama", device=str(fitted), global_batch=16, layout=LAYOUT, **CPU_PAIR)
    before, after = abs(forward_backward(runs[16]) - measured), abs(forward_backward(refitted) - measured)
    assert after < 0.7 * before, (forward_backward(runs[16]), forward_backward(refitted), measured)


@pytest.mark.parametrize("line,named", [
    ("not json", "not JSON"),
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
