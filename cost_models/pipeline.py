"""Pipeline schedules: critical path and in-flight micro-batches per stage."""
from __future__ import annotations


def pipeline_seconds(stage_work_s: list[float], num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Critical path of 1F1B / interleaved 1F1B over stages with per-micro-batch work W_i (F + B).

    1F1B (PipeDream-Flush): the first micro-batch fills every stage and the last drains them (sum of
    W_i), the other m-1 are paced by the slowest stage: (m-1) max W + sum W; uniform stages give
    (m + p - 1) W, a bubble of (p-1)/m (Narayanan et al. SC21). Interleaved with v chunks per rank
    shrinks the fill and drain v-fold: uniform stages give (m + (p-1)/v) W (SC21, Llama 3 section 3.3.2).
    """
    slowest = max(stage_work_s)
    total = sum(stage_work_s)
    v = virtual_stages
    return (num_micro_batches - 1) * slowest + (total + (v - 1) * slowest) / v


def in_flight_micro_batches(stage: int, stages: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at its peak.

    1F1B: stage i holds min(p - i, m) (design-notes). Interleaved: the first stage holds
    p (1 + (p-1)/(p v)) (Korthikanti et al. 2022), falling to 1 at the last stage.
    """
    base = stages - stage
    if virtual_stages > 1:
        base += (stages - 1 - stage) / virtual_stages
    return min(float(num_micro_batches), base)


def p2p_transfers_on_critical_path(stages: int, virtual_stages: int) -> int:
    """Sends that fill and drain the pipeline: 2 (p - 1), and v times as many chunk hops interleaved."""
    if stages <= 1:
        return 0
    return 2 * (stages * virtual_stages - 1)
