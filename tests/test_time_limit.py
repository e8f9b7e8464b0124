"""--time-limit bounds the whole command: the best plan found by then, said time-limited, or one paragraph
saying why none was found. Tested with a stand-in clock and a stand-in slow solver, never by timing."""
from __future__ import annotations

import time

import pytest

from hardware_profiles.errors import UserInputError
from planner import api
from planner.search import branch_and_bound


class FakeClock:
    """perf_counter for the search: each reading advances it a little, a solve by what it was allowed."""

    def __init__(self, start: float = 1000.0, tick_s: float = 1e-3):
        self.now, self.tick_s = start, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def slow_search(monkeypatch, leaf_s: float) -> FakeClock:
    """Every CP-SAT leaf takes `leaf_s` of the clock, or the time it is given where that is less, and then
    proves nothing (CP-SAT stops at its max_time_in_seconds): the first plan comes late, as a 1T MoE's does on
    8,192 devices, whose best-first search expands thousands of nodes that do not fit before its first leaf."""
    clock = FakeClock()
    real = branch_and_bound.solve_partition

    def solve(costs, methods, time_limit_s, **kwargs):
        clock.now += min(leaf_s, time_limit_s)
        if time_limit_s < leaf_s:
            return real(costs, methods, time_limit_s=0.0, **kwargs)   # stopped before any answer
        return real(costs, methods, time_limit_s=600, **kwargs)
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(branch_and_bound, "solve_partition", solve)
    return clock


KIMI = dict(device="h800", num_devices=8192, global_batch=8192, seq_len=4096)


# kimi-k2's best-first search reads the stand-in clock about 6,600 times (6.6 s) before its first leaf (since
# its roots are bounded by the tp, cp and hop communication every placement pays): the longer limits leave best
# first time to reach a leaf (before 70% of the limit, where it would dive) and stop it before it completes (at
# about 15.6 s and 23.6 s with these leaves); the shortest one ends in a dive
@pytest.mark.parametrize("limit_s,leaf_s", [(2.0, 0.3), (12.0, 2.0), (16.0, 4.0)])
def test_a_time_limited_search_returns_its_best_plan_within_the_limit(monkeypatch, limit_s, leaf_s):
    clock = slow_search(monkeypatch, leaf_s)
    start = clock.now
    plan = api.plan("kimi-k2", **KIMI, time_limit_s=limit_s)
    assert clock.now - start <= limit_s + 1.0
    assert plan.search.status == "time-limited" and plan.search.unexplored > 0
    assert plan.fits


@pytest.mark.parametrize("limit_s,leaf_s", [(2.0, 5.0), (0.0, 0.3)])
def test_a_limit_too_short_for_any_plan_says_why_in_time(monkeypatch, limit_s, leaf_s):
    """No leaf can be solved in the time left (or none is left after capture): one paragraph naming
    --time-limit, by the limit and a second."""
    clock = slow_search(monkeypatch, leaf_s)
    start = clock.now
    with pytest.raises(UserInputError, match="time") as refused:
        api.plan("kimi-k2", **KIMI, time_limit_s=limit_s)
    assert refused.value.field == "--time-limit"
    assert clock.now - start <= limit_s + 1.0


def test_a_search_cut_before_any_layout_was_sized_says_time_limit_not_that_none_divides():
    """Time left after capture but none to size a candidate (a busy machine, a short --time-limit): every
    candidate unexplored and no memory need known; the paragraph names --time-limit, not the layout (the
    70B on 1,024 H100 has 39,932 candidates that divide)."""
    from hardware_profiles import cluster_from_device
    from hardware_profiles.loader import load_stack
    from planner.graph_capture.model_capture import capture
    from planner.rules.pins import Pins
    graph = capture("llama3-70b", 8192)
    cluster = cluster_from_device("h100-sxm", 1024)
    outcome = branch_and_bound.search(graph.costs_record, cluster, 1024, Pins(), "bf16", 0.0, 1, stack=load_stack(),
                                      graph=graph)
    assert outcome.candidates > 0 and outcome.unexplored == outcome.candidates and not outcome.ranked
    refused = api._infeasible(graph, cluster, 1024, outcome, Pins(), "bf16", load_stack())
    assert refused.field == "--time-limit" and "reached its time limit" in str(refused)
