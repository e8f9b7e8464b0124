"""The runtime inside a user's own training loop (tests/user_loop.py): the same loop on one process and on two
ranks, laid out by `parallelize`, stepped by `Step` with the user's loss (masked positions, a router's
load-balancing loss), AdamW with two parameter groups, a warmup-then-cosine schedule, clipping by the global
norm, data through `rank_loader`: the losses of 4 steps within 1e-6 and every gradient as one process's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_runtime import LOSS_TOLERANCE, assert_gradients_match, launch_script

pytestmark = pytest.mark.heavy
SCRIPT = str(Path(__file__).resolve().parent / "user_loop.py")
MIXTRAL = "tests/models/hf_tiny.py:mixtral_with_aux"
STEPS = 4
# (name, model, layout on two ranks); the single-process reference runs each model with mbs=2 (4 micro-batches)
CASES = [("dp2-zero1", "tiny-llama", "dp=2,mbs=2,zero=1"), ("dp2-zero3", "tiny-llama", "dp=2,mbs=2,zero=3"),
         ("tp2-sp", "tiny-llama", "tp=2,mbs=2,zero=0"), ("pp2-1f1b", "tiny-llama", "pp=2,mbs=2,zero=0"),
         ("ep2-mixtral-aux", MIXTRAL, "dp=2,ep=2,mbs=2,zero=0")]


def run(nproc: int, cases: list[dict], directory: Path) -> dict[str, list[float]]:
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = launch_script(SCRIPT, nproc, str(spec), str(directory))
    losses: dict[str, list[float]] = {case["name"]: [] for case in cases}
    for line in proc.stdout.splitlines():
        if line.startswith("case "):
            _, name, _, _, _, value, _, _ = line.split()
            losses[name].append(float(value))
    return losses


def steps_of(nproc: int, cases: list[dict], directory: Path) -> dict[str, dict[int, tuple[float, str]]]:
    """Per case, each step's loss and the sample indices of its global batch."""
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = launch_script(SCRIPT, nproc, str(spec), str(directory))
    out: dict[str, dict[int, tuple[float, str]]] = {case["name"]: {} for case in cases}
    for line in proc.stdout.splitlines():
        if line.startswith("case "):
            _, name, _, step, _, value, _, samples = line.split()
            out[name][int(step)] = (float(value), samples)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("user-loop")
    models = sorted({model for _, model, _ in CASES})
    references = run(1, [{"name": f"ref{i}", "model": model, "layout": "mbs=2,zero=0", "steps": STEPS}
                         for i, model in enumerate(models)], work / "reference")
    parallel = run(2, [{"name": name, "model": model, "layout": layout, "steps": STEPS}
                       for name, model, layout in CASES], work / "parallel")
    return work, {model: (references[f"ref{i}"], work / "reference" / f"ref{i}") for i, model in enumerate(models)}, \
        parallel


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_user_loop_matches_one_process(runs, case):
    work, references, parallel = runs
    name, model, _ = case
    expected, ref_dir = references[model]
    got = parallel[name]
    assert len(got) == len(expected) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected)) < LOSS_TOLERANCE, (got, expected)
    assert_gradients_match(work / "parallel" / name, ref_dir, range(1, STEPS + 1))


def test_a_checkpoint_written_mid_epoch_under_tp2_resumes_under_dp2_and_pp2(tmp_path):
    """The model, AdamW's state in two groups, the schedule's position and the data loader's, written at step 3
    of 6 under tp2, resumed under dp2 and under pp2: the same next samples and the losses of the run never
    stopped."""
    directory = str(tmp_path / "checkpoints")   # Checkpointer.maybe_save every 3 steps, restore its latest
    job = {"model": "tiny-llama", "schedule_steps": 6}
    whole = steps_of(2, [{"name": "whole", **job, "layout": "tp=2,mbs=2,zero=0", "steps": 6},
                         {"name": "first", **job, "layout": "tp=2,mbs=2,zero=0", "steps": 3, "save_every": 3,
                          "checkpoint_dir": directory}], tmp_path / "tp2")
    assert (Path(directory) / "latest").read_text() == "step-000003"
    resumed = steps_of(2, [{"name": name, **job, "layout": layout, "steps": 6, "resume_dir": directory}
                           for name, layout in (("dp2", "dp=2,mbs=2,zero=1"), ("pp2", "pp=2,mbs=2,zero=0"))],
                       tmp_path / "resumed")
    assert [whole["first"][step] for step in (1, 2, 3)] == [whole["whole"][step] for step in (1, 2, 3)]
    for name in ("dp2", "pp2"):
        assert sorted(resumed[name]) == [4, 5, 6]
        for step in (4, 5, 6):
            loss, samples = resumed[name][step]
            assert samples == whole["whole"][step][1], (name, step)
            assert abs(loss - whole["whole"][step][0]) < LOSS_TOLERANCE, (name, step, loss, whole["whole"][step])


def test_the_health_check_in_a_user_loop_skips_a_poisoned_batch_on_every_rank(tmp_path):
    """A NaN in one gradient element of rank 1 at step 2, under dp2 (ZeRO-1: replicas compared too), and, in
    another run, one element of a backward matrix product of rank 0 at step 2 doubled (products checked every
    step, `HealthMonitor.watching`): `HealthMonitor.check` names the rank and both ranks skip the optimizer step,
    so steps 3 and 4 are those of the same loop with batch 2 left out by hand, and no replica check finds a
    difference."""
    launch = {"model": "tiny-llama", "layout": "dp=2,mbs=2,zero=1", "steps": 4}
    directory = tmp_path / "health"
    directory.mkdir()
    spec = directory / "cases.json"
    spec.write_text(json.dumps([{"name": "poisoned", **launch, "nan_at": [2, 1]},
                                {"name": "wrong-product", **launch, "wrong_product_at": [2, 0]},
                                {"name": "by-hand", **launch, "skip": [2]}]))
    proc = launch_script(SCRIPT, 2, str(spec), str(directory))
    health = [line for line in proc.stdout.splitlines() if line.startswith("health: step")]
    assert len(health) == 2 and health[0] == "health: step 2: non-finite loss or gradients on rank 1; policy skip" \
        and health[1].startswith("health: step 2: a matrix product computed wrong (silent data corruption in "
                                 "computation) on rank 0: a backward product"), proc.stdout
    steps = {name: {} for name in ("poisoned", "wrong-product", "by-hand")}
    for line in proc.stdout.splitlines():
        if line.startswith("case "):
            _, name, _, step, _, value, _, _ = line.split()
            steps[name][int(step)] = float(value)
    assert sorted(steps["by-hand"]) == [1, 3, 4]
    for step in (1, 3, 4):
        assert abs(steps["poisoned"][step] - steps["by-hand"][step]) < LOSS_TOLERANCE, (step, steps)
        assert abs(steps["wrong-product"][step] - steps["by-hand"][step]) < LOSS_TOLERANCE, (step, steps)
