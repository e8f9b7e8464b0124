"""The per-layer cost terms of a pipeline stage: one table that the step-time estimate sums in seconds and
bytes (`step_time.stage_totals`), the CP-SAT partition sums as integer expressions over its layer counts
(`planner/search/partition.py`), and the search bounds take means and minima of (`planner/search/bounds.py`).

Each term is one layer's share for one micro-batch (or, for `dp_reduce_s` and `optimizer_s`, for one step)
under one recomputation method; a stage's value is the sum over its layers, the embedding and the head.
The stage-level parts that are not sums (activations times the micro-batches in flight, the peak of a
recomputed layer's working set, the logits) are the memory model's (`memory.StageMemory`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

from .layer_costs import MeshCosts
from .layer_records import RECOMPUTE_INDEX, LayerCost, StepParts
from .layout import Recompute
from .pipeline import dualpipev_split_recompute_factor, dualpipev_weight_factor


class Unit(Enum):
    """How a term is counted: seconds per micro-batch, seconds per step (small: a layer's share of one
    reduction), or bytes. The solver scales each to its own integer unit."""
    seconds = "seconds"
    step_seconds = "step_seconds"
    bytes = "bytes"


def _term(unit: Unit):
    return field(metadata={"unit": unit})


@dataclass(frozen=True)
class TermContext:
    """What the terms read besides the layer: the schedule's factors on DualPipeV's bubble term."""
    weight_factor: int = 3         # W's coefficient (`pipeline.dualpipev_weight_factor`)
    split_factor: float = 0.0      # split weight passes' recomputation (`pipeline.dualpipev_split_recompute_factor`)

    @classmethod
    def of(cls, costs: MeshCosts) -> "TermContext":
        lay, stack = costs.layout, costs.stack
        split = dualpipev_split_recompute_factor(lay.pp, stack.dualpipev_weight_pass_recompute) \
            if lay.dualpipev else 0.0
        return cls(dualpipev_weight_factor(stack.dualpipev_weight_split_in_cooldown), split)


@dataclass(frozen=True)
class LayerTerms:
    """The table: one layer's terms under one recomputation method (`of`), or their sums over a stage's layers."""
    work_s: float = _term(Unit.seconds)          # W: forward, backward, recomputation and exposed communication
    compute_s: float = _term(Unit.seconds)       # forward and backward compute alone
    recompute_s: float = _term(Unit.seconds)     # what the method repeats
    tp_s: float = _term(Unit.seconds)            # exposed tensor-parallel collectives
    cp_s: float = _term(Unit.seconds)            # exposed context-parallel collectives
    ep_s: float = _term(Unit.seconds)            # exposed expert all-to-alls, as the steady state pays them
    zero_s: float = _term(Unit.seconds)          # exposed ZeRO-2/3 per-micro-batch traffic
    host_s: float = _term(Unit.seconds)          # the host issuing kernels beyond the device's time
    alone_s: float = _term(Unit.seconds)         # DualPipeV's A: forward and backward run alone
    bubble_s: float = _term(Unit.seconds)        # DualPipeV's bubble term A + B - kW
    dp_reduce_s: float = _term(Unit.step_seconds)   # share of the per-step data-parallel reduction
    optimizer_s: float = _term(Unit.step_seconds)   # optimizer step on this rank
    activation_bytes: float = _term(Unit.bytes)  # saved for backward, per micro-batch in flight
    state_bytes: float = _term(Unit.bytes)       # weights, gradients and optimizer states
    gradient_bytes: float = _term(Unit.bytes)    # of which gradients

    @classmethod
    def of(cls, c: LayerCost, method: Recompute, context: TermContext) -> "LayerTerms":
        """Each term's formula, once (the layer's parts are `layer_records.LayerCost`'s)."""
        index = RECOMPUTE_INDEX[method]
        return cls(work_s=c.work_s(method), compute_s=c.forward_s + c.backward_s, recompute_s=c.recompute_s[index],
                   tp_s=c.tp_comm_s, cp_s=c.cp_comm_s, ep_s=c.ep_comm_s, zero_s=c.zero_exposed_s[index],
                   host_s=c.host_excess_s, alone_s=c.work_s(method) + c.unpaired_extra_s,
                   bubble_s=c.dualpipev_bubble_s(method, context.weight_factor, context.split_factor),
                   dp_reduce_s=c.dp_reduce_s, optimizer_s=c.optimizer_step_s,
                   activation_bytes=c.activation_bytes[index], state_bytes=c.states.total,
                   gradient_bytes=c.states.gradients)

    @classmethod
    def of_step(cls, step: StepParts, most_recompute_s: float) -> "LayerTerms":
        """The terms a layer's ZeRO stage sets, and its compute (which hides the reduction), the rest 0: what the
        search's bound on a placement's ZeRO stages reads without the layer's memory (`ZeroExtras`). The exposed
        traffic at its least: under the recomputation that hides the most (`most_recompute_s`)."""
        return cls(work_s=0.0, compute_s=step.compute_s, recompute_s=0.0, tp_s=0.0, cp_s=0.0, ep_s=0.0,
                   zero_s=step.zero_exposed_s(most_recompute_s), host_s=0.0, alone_s=0.0, bubble_s=0.0,
                   dp_reduce_s=step.dp_reduce_s, optimizer_s=step.optimizer_step_s, activation_bytes=0.0,
                   state_bytes=0.0, gradient_bytes=0.0)

    def __add__(self, other: "LayerTerms") -> "LayerTerms":
        # positional, in field order (vars keeps it): the search's bounds sum these for every leaf
        return LayerTerms(*[a + b for a, b in zip(vars(self).values(), vars(other).values())])

    def __mul__(self, count: float) -> "LayerTerms":
        return LayerTerms(*[a * count for a in vars(self).values()])

    __rmul__ = __mul__

    def peak_state_bytes(self, gradients_held: bool) -> float:
        """States at the activation peak: gradients that backward allocates are not held there
        (`memory.gradients_held_at_peak`)."""
        return self.state_bytes if gradients_held else self.state_bytes - self.gradient_bytes


TERM_NAMES = tuple(f.name for f in fields(LayerTerms))
TERM_UNITS = {f.name: f.metadata["unit"] for f in fields(LayerTerms)}


def terms_sum(items) -> LayerTerms:
    """The sum of (terms, count) pairs (each term summed in the order given)."""
    columns = [0.0] * len(TERM_NAMES)
    for terms, count in items:
        columns = [total + value * count for total, value in zip(columns, vars(terms).values())]
    return LayerTerms(*columns)
