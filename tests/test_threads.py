"""The Python API from many threads at once (a notebook's executor, a sweep service): each answer is the one the
same call gives alone. Capture runs one at a time in a process (planner.graph_capture.model_capture's lock);
the searches run side by side."""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import planner
from planner.graph_capture.model_capture import _capture_cached

pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]
JOBS = [dict(model="tiny-llama", device="h100-sxm", num_devices=8, global_batch=16),
        dict(model="tiny-llama", device="h100-sxm", num_devices=16, global_batch=32, tp=2),
        dict(model=f"{ROOT}/tests/models/hf_tiny.py:llama_logits", device="h100-sxm", num_devices=8, global_batch=16,
             seq_len=32),
        dict(model=str(ROOT / "tests/models/tiny-square-heads.yaml"), device="h100-sxm", num_devices=8, global_batch=16)]


def answer(job: dict) -> tuple:
    plan = planner.plan(**job, time_limit_s=60)
    return plan.layout.model_dump_json(), round(plan.step_time_s, 12), tuple(m.model_dump_json() for m in plan.memory)


def test_eight_threads_planning_at_once_give_the_serial_answers():
    work = JOBS * 2
    alone = [answer(job) for job in work]
    _capture_cached.cache_clear()   # the threads capture anew, at once
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(answer, work))
    assert together == alone
