"""The runtime inside a user's own training loop (tests/user_loop.py): the same loop on one process and on two
ranks, laid out by `parallelize`, stepped by `Step` with the user's loss (masked positions, a router's
load-balancing loss), AdamW with two parameter groups, a warmup-then-cosine schedule, clipping by the global
norm, data through `rank_loader`: the losses of 4 steps within 1e-6 and every gradient as one process's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_runtime import (FIRST_STEP_TOLERANCE, LATER_TOLERANCE, LOSS_TOLERANCE, ROOT, assert_gradients_match,
                          launch_script)

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
            _, name, _, _, _, value = line.split()
            losses[name].append(float(value))
    return losses


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
