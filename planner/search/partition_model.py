"""The CP-SAT model of one leaf's stage split and recomputation, built family by family: the variables, the
tiling of the blocks over the units, the recomputation counts, the module choice, each rank's stage terms
and memory, the objective, and a hint from the even split (as OR-Tools' `line_balancing_sat.py` reads).

Every coefficient is a term of `cost_models.stage_terms.LayerTerms`, the table the step-time estimate sums:
here it is summed as integers (0.1 us, 1 ns for per-step terms, 1 KiB) over the layer counts the solver
chooses. The objective is `cost_models.pipeline`'s critical path (`pipeline_scaled`, `dualpipev_scaled`) of
the ranks' sums, plus the exposed data-parallel reduction and the slowest optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from cost_models.layer_costs import MeshCosts
from cost_models.layer_records import RECOMPUTE_ORDER, LayerCost
from cost_models.layout import MODULE_INDEX, Recompute, RecomputeModule, nested_modules
from cost_models.memory import gradients_held_at_peak, usable_bytes
from cost_models.pipeline import dualpipev_scaled, even_partition, least_blocks, pipeline_scaled, schedule_scale
from cost_models.stage_terms import LayerTerms, TermContext

from .memory_fit import block_units, m, rank_fixed_bytes, rank_flight, recompute_units

TIME_UNIT_S = 1e-7          # integer scaling: solver times are multiples of 0.1 us
FINE_PER_UNIT = 1000        # per-step dp and optimizer terms in 1 ns steps: a layer's share can be < 1 us
HORIZON_S = 1e4             # no step is slower


def t(seconds: float) -> int:
    return int(round(_within_horizon(seconds) / TIME_UNIT_S))


def _within_horizon(seconds: float) -> float:
    """A term past the horizon is held at it: its stage is then past any plan, and no integer the solver sums
    overflows (a profile's extreme but finite numbers give terms of 1e20 s)."""
    return min(seconds, HORIZON_S)


def t_extra(seconds: float) -> int:
    """Time a choice adds (recomputation), at least one unit where it adds any: a choice that costs time
    never ties with one that costs none (a norm's recomputation in a small model rounds to 0)."""
    return max(t(seconds), 1) if seconds > 0 else 0


def fine(seconds: float) -> int:
    return int(round(_within_horizon(seconds) / TIME_UNIT_S * FINE_PER_UNIT))


def selective_is_one_switch(stack, allowed: tuple[Recompute, ...]) -> bool:
    """Whether a plan must recompute selectively every block or none (and then none fully): the stack's
    selective recomputation is one switch for the model and the leaf may choose among methods."""
    return stack.selective_every_layer and Recompute.selective in allowed and len(allowed) > 1


def block_runs(blocks: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs of consecutive blocks of one kind: (kind, start, end)."""
    runs: list[tuple[str, int, int]] = []
    for index, kind in enumerate(blocks):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], index + 1)
        else:
            runs.append((kind, index, index + 1))
    return runs


@dataclass(frozen=True)
class RankSums:
    """One pipeline rank's stage terms as integer expressions (per micro-batch; dp and optimizer per step)."""
    work: object        # W, in time units
    compute: object     # forward and backward compute (the dp window's share)
    alone: object       # DualPipeV's A
    bubble: object      # DualPipeV's A + B - kW
    reduce: object      # its layers' dp_reduce_s, in fine units
    optimizer: object   # its optimizer step, in fine units


class PartitionModel:
    """Variables, constraints and objective of one leaf (`solve_partition` builds and solves it)."""

    def __init__(self, costs: MeshCosts, allowed: tuple[Recompute, ...], cutoff_s: float,
                 module_choices: tuple[RecomputeModule, ...]):
        self.costs, self.lay, self.model = costs, costs.layout, costs.model
        self.cp = cp_model.CpModel()
        self.context = TermContext.of(costs)
        self.runs = block_runs(self.model.blocks)
        self.layer = {kind: costs.layer(self.model.kind(kind)) for kind, _, _ in self.runs}
        self.allowed = allowed
        self.extra = [r for r in RECOMPUTE_ORDER[1:] if r in allowed]
        self.pp, self.chunks = self.lay.pp, self.lay.pp * self.lay.vp
        # Megatron's block method recomputes the first N blocks of each chunk: chunks are then the units
        self.per_chunk = self.lay.recompute_layers
        # one kind of block: only blocks per pipeline rank matter (any split of them into vp chunks is
        # contiguous), so the units are ranks; several kinds: the units are the pp * vp chunks in order, chunk j
        # on rank `Layout.chunk_rank(j)` (round robin, or DualPipeV's V)
        self.single_kind = len(self.runs) == 1 and self.per_chunk is None
        self.units = self.pp if self.single_kind else self.chunks
        self.stage_of = (lambda u: u) if self.single_kind else self.lay.chunk_rank
        self.owned_by = [[u for u in range(self.units) if self.stage_of(u) == i] for i in range(self.pp)]
        self.held = gradients_held_at_peak(costs.stack.gradient_buffer_in(self.lay), self.lay.num_micro_batches)
        self.add_unit_variables()
        self.add_tiling()
        self.add_recompute_variables()
        self.add_module_choice(module_choices)
        if self.per_chunk is not None:
            self.add_block_method()
        self.add_recompute_limits()
        ranks = [self.add_rank(i) for i in range(self.pp)]
        self.add_objective(ranks, cutoff_s)
        self.add_hint()

    # -- variables ----------------------------------------------------------------------------------
    def add_unit_variables(self) -> None:
        """Blocks per unit, and blocks of each run in each unit."""
        cp, num_blocks = self.cp, len(self.model.blocks)
        # a chunk holds a layer, or the embedding (first chunk) or the loss (last) alone (cost_models.pipeline)
        chunk_min = [least_blocks(j, self.chunks) for j in range(self.chunks)]
        unit_min = [sum(chunk_min[j] for j in range(self.chunks) if self.lay.chunk_rank(j) == i)
                    for i in range(self.pp)] if self.single_kind else chunk_min
        self.size = [cp.NewIntVar(unit_min[u], num_blocks, f"size{u}") for u in range(self.units)]
        self.count = [[self.size[j]] if self.single_kind else
                      [cp.NewIntVar(0, r1 - r0, f"n{j}_{r}") for r, (_, r0, r1) in enumerate(self.runs)]
                      for j in range(self.units)]

    def add_recompute_variables(self) -> None:
        """Recomputed blocks per pipeline rank, run and method (a rank's time and memory do not depend on which
        of its chunks holds them, so counting per rank removes symmetric solutions)."""
        self.redo = {(i, r, k): self.cp.NewIntVar(0, r1 - r0, f"rc{i}_{r}_{k.value}")
                     for i in range(self.pp) for r, (_, r0, r1) in enumerate(self.runs) for k in self.extra}

    def add_module_choice(self, module_choices: tuple[RecomputeModule, ...]) -> None:
        """The modules selective recomputation repeats, where the solver chooses them: a module's time and freed
        bytes add up over the chosen set (each saved tensor has one maker; a module nested in another, moe_act
        or shared_experts in moe, is never chosen beside it), so a layer's selective cost is linear in `part`:
        its run's selective blocks on a rank that recompute that module."""
        cp = self.cp
        self.choose = bool(module_choices) and Recompute.selective in self.extra
        self.chosen = {mod: cp.NewBoolVar(f"module_{mod.value}") for mod in module_choices} if self.choose else {}
        self.part = {}
        if not self.choose:
            return
        cp.Add(sum(self.chosen.values()) >= 1)   # selective recomputation repeats something
        # moe_act and shared_experts lie inside moe: with it they would free their tensors twice in the sums
        for mod in nested_modules(self.chosen):
            cp.AddBoolOr([self.chosen[mod].Not(), self.chosen[mod.container].Not()])
        for (i, r, k), var in self.redo.items():
            if k is not Recompute.selective:
                continue
            for mod, on in self.chosen.items():
                self.part[i, r, mod] = cp.NewIntVar(0, self.runs[r][2] - self.runs[r][1], f"part{i}_{r}_{mod.value}")
                cp.Add(self.part[i, r, mod] == var).OnlyEnforceIf(on)
                cp.Add(self.part[i, r, mod] == 0).OnlyEnforceIf(on.Not())

    # -- constraints ---------------------------------------------------------------------------------
    def add_tiling(self) -> None:
        """The units tile the blocks, each a contiguous slice in order; an even split where the stack needs it."""
        cp, num_blocks = self.cp, len(self.model.blocks)
        if self.costs.stack.even_pipeline_split or (self.lay.dualpipev and self.costs.stack.dualpipev_even_split):
            # the stack splits the layers evenly over the chunks (Megatron-LM's assert, MindSpeed's DualPipeV)
            for u in range(self.units):
                cp.Add(self.size[u] == num_blocks * (self.chunks // self.units) // self.chunks)
        cp.Add(sum(self.size) == num_blocks)
        if self.single_kind:
            return
        # run labels never decrease along the chunks, so each chunk is a contiguous slice: a chunk using run r
        # lies between first[r] and last[r], and last[r] <= first[r + 1]
        first = [cp.NewIntVar(0, self.units - 1, f"first{r}") for r in range(len(self.runs))]
        last = [cp.NewIntVar(0, self.units - 1, f"last{r}") for r in range(len(self.runs))]
        for r, (_, r0, r1) in enumerate(self.runs):
            cp.Add(sum(self.count[j][r] for j in range(self.units)) == r1 - r0)
            if r + 1 < len(self.runs):
                cp.Add(last[r] <= first[r + 1])
            for j in range(self.units):
                used = cp.NewBoolVar(f"uses{j}_{r}")
                cp.Add(self.count[j][r] >= 1).OnlyEnforceIf(used)
                cp.Add(self.count[j][r] == 0).OnlyEnforceIf(used.Not())
                cp.Add(first[r] <= j).OnlyEnforceIf(used)
                cp.Add(last[r] >= j).OnlyEnforceIf(used)
        for j in range(self.units):
            cp.Add(sum(self.count[j]) == self.size[j])

    def add_recompute_limits(self) -> None:
        """A block recomputes at most one way; every block one of the allowed methods where recomputation is
        pinned (no `none` among them)."""
        if not self.extra:
            return
        for i in range(self.pp):
            for r in range(len(self.runs)):
                held = sum(self.count[j][r] for j in self.owned_by[i])
                recomputed = sum(self.redo[i, r, k] for k in self.extra)
                self.cp.Add(recomputed <= held if Recompute.none in self.allowed else recomputed == held)

    def add_block_method(self) -> None:
        """Megatron's block method: each chunk recomputes fully its first min(N, size) blocks, whose kinds are the
        runs that the span [start, start + head) of the chunk's blocks overlaps (start: the sizes of the chunks
        before it), and nothing else."""
        cp, num_blocks, per_chunk = self.cp, len(self.model.blocks), self.per_chunk
        overlap = []
        for j in range(len(self.size)):
            start = cp.NewIntVar(0, num_blocks, f"start{j}")
            cp.Add(start == sum(self.size[:j]))
            head = cp.NewIntVar(0, per_chunk, f"head{j}")
            cp.AddMinEquality(head, [self.size[j], per_chunk])
            row = []
            for r, (_, r0, r1) in enumerate(self.runs):
                low, high = cp.NewIntVar(0, num_blocks, f"lo{j}_{r}"), cp.NewIntVar(0, num_blocks, f"hi{j}_{r}")
                cp.AddMaxEquality(low, [start, r0])
                cp.AddMinEquality(high, [start + head, r1])
                span = cp.NewIntVar(0, r1 - r0, f"ov{j}_{r}")
                cp.AddMaxEquality(span, [high - low, 0])
                row.append(span)
            overlap.append(row)
        for i, units in enumerate(self.owned_by):
            for r in range(len(self.runs)):
                for k in (Recompute.full, Recompute.selective):
                    if (i, r, k) in self.redo:
                        cp.Add(self.redo[i, r, k] == (sum(overlap[j][r] for j in units) if k is Recompute.full else 0))

    def terms(self, c: LayerCost, method: Recompute = Recompute.none) -> LayerTerms:
        return LayerTerms.of(c, method, self.context)

    def add_rank(self, i: int) -> RankSums:
        """Rank i's stage terms over its blocks, the embedding and the head, and its memory within the usable
        HBM at both peaks of `memory.StageMemory.total`."""
        lay, flight = self.lay, rank_flight(self.costs, i)
        work, compute, alone, bubble, reduce, steps, memory, grads = ([] for _ in range(8))
        for j in self.owned_by[i]:
            for r, (kind, _, _) in enumerate(self.runs):
                base, n = self.terms(self.layer[kind]), self.count[j][r]
                work.append(t(base.work_s) * n)
                alone.append(t(base.alone_s) * n)
                bubble.append(t(base.bubble_s) * n)
                compute.append(t(base.compute_s) * n)
                memory.append(block_units(base, self.held, flight) * n)
                grads.append(m(base.state_bytes) * n)
                reduce.append(fine(base.dp_reduce_s) * n)
                steps.append(fine(base.optimizer_s) * n)
        for r, (kind, _, _) in enumerate(self.runs):
            for k in self.extra:
                extra = self._recompute_extra(i, r, kind, k, flight)
                work += extra.work
                alone += extra.work
                bubble += extra.bubble
                memory += extra.memory
        fixed = [self.terms(c) for c, on in ((self.costs.layer(self.model.embedding), i == 0),
                                             (self.costs.layer(self.model.head), i == lay.chunk_rank(self.chunks - 1)))
                 if on]
        self.add_memory(i, memory, grads, fixed, flight)
        return RankSums(work=sum(work) + sum(t(c.work_s) for c in fixed),
                        compute=sum(compute) + sum(t(c.compute_s) for c in fixed),
                        alone=sum(alone) + sum(t(c.alone_s) for c in fixed),
                        bubble=sum(bubble) + sum(t(c.bubble_s) for c in fixed),
                        reduce=sum(reduce) + sum(fine(c.dp_reduce_s) for c in fixed),
                        optimizer=sum(steps) + sum(fine(c.optimizer_s) for c in fixed))

    def _recompute_extra(self, i: int, r: int, kind: str, method: Recompute, flight: float) -> "_Extra":
        """What rank i's blocks of run r recomputed by `method` add to its terms: each term's difference from
        no recomputation, times the count (per chosen module, where the solver chooses the modules)."""
        c = self.layer[kind]
        if self.choose and method is Recompute.selective:
            out = _Extra([], [], [])
            for mod in self.chosen:
                seconds = c.module_recompute_s[MODULE_INDEX[mod]]
                part = self.part[i, r, mod]
                out.work.append(t_extra(seconds) * part)
                out.bubble.append(2 * t_extra(seconds) * part)   # A and B both repeat it
                out.memory.append(-m(flight * c.module_freed_bytes[MODULE_INDEX[mod]]) * part)
            return out
        base, more, redo = self.terms(c), self.terms(c, method), self.redo[i, r, method]
        return _Extra([t_extra(more.work_s - base.work_s) * redo], [t_extra(more.bubble_s - base.bubble_s) * redo],
                      [recompute_units(base, more, flight) * redo])

    def add_memory(self, i: int, memory: list, grads: list, fixed: list[LayerTerms], flight: float) -> None:
        """Rank i within the usable HBM at the activation peak (states there, activations in flight, logits,
        buffers, the largest recomputed layer's working set) and, where backward allocates the gradients, at its
        end (every state)."""
        cp, costs = self.cp, self.costs
        capacity = m(usable_bytes(costs.cluster.device))
        fixed_bytes = rank_fixed_bytes(costs, i, flight, self.held)
        # a recomputed layer's full activations while its backward runs
        working = cp.NewIntVar(0, m(max(c.working_bytes for c in self.layer.values())), f"working{i}")
        for r, (kind, r0, r1) in enumerate(self.runs):
            if self.extra:
                has = cp.NewBoolVar(f"has_rc{i}_{r}")
                cp.Add(sum(self.redo[i, r, k] for k in self.extra) <= (r1 - r0) * has)
                cp.Add(working >= m(self.layer[kind].working_bytes) * has)
        cp.Add(sum(memory) + m(fixed_bytes) + working <= capacity)
        if not self.held:
            cp.Add(sum(grads) + m(sum(c.state_bytes for c in fixed) + costs.comm_buffer_bytes) <= capacity)

    # -- objective -----------------------------------------------------------------------------------
    def add_objective(self, ranks: list[RankSums], cutoff_s: float) -> None:
        """Minimise the step: the pipeline's critical path of the ranks (`pipeline_scaled`, or
        `dualpipev_scaled`), plus the exposed dp reduction and the slowest optimizer step, in units of
        1 / `schedule_scale` of the step; with `cutoff_s`, only a step below it."""
        cp, lay, horizon = self.cp, self.lay, t(HORIZON_S)
        slowest = cp.NewIntVar(0, horizon, "slowest")
        dp_exposed = cp.NewIntVar(0, horizon, "dp_exposed")
        optimizer = cp.NewIntVar(0, horizon, "optimizer")
        window = int(round(self.costs.stack.dp_window_fraction * FINE_PER_UNIT))
        for rank in ranks:
            cp.Add(slowest >= rank.work)   # the slowest stage paces the steady state
            cp.Add(optimizer * FINE_PER_UNIT >= rank.optimizer)
            # MeshCosts.dp_exposed_s of each stage (>= 0 by its domain): the latency plus the layers'
            # dp_reduce_s, less the window of the stage's last micro-batch
            cp.Add(dp_exposed * FINE_PER_UNIT >= fine(self.costs.dp_latency_s) + rank.reduce - window * rank.compute)
        self.scale = schedule_scale(lay)
        if lay.dualpipev:
            alone = cp.NewIntVar(0, horizon, "slowest_alone")
            bubble = cp.NewIntVar(0, horizon, "largest_bubble")   # at least 0, as dualpipev_seconds takes it
            for rank in ranks:
                cp.Add(alone >= rank.alone)
                cp.Add(bubble >= rank.bubble)
            pipeline = dualpipev_scaled(slowest, alone, bubble, self.pp, lay.num_micro_batches)
        else:
            pipeline = pipeline_scaled(sum(rank.work for rank in ranks), slowest, lay.num_micro_batches, lay.vp)
        self.objective = pipeline + self.scale * (dp_exposed + optimizer)
        if cutoff_s < float("inf"):  # branch and bound: a plan no better than the incumbent is of no use
            cp.Add(self.objective <= t(cutoff_s * self.scale))
        cp.Minimize(self.objective)

    def add_hint(self) -> None:
        """Megatron's even split, no recomputation: a start the solver repairs where it does not fit."""
        even = even_partition(len(self.model.blocks), self.chunks)
        per_unit = [sum(even[j] for j in range(self.chunks) if self.lay.chunk_rank(j) == u) for u in range(self.pp)] \
            if self.single_kind else list(even)
        for var, value in zip(self.size, per_unit):
            self.cp.AddHint(var, value)


@dataclass(frozen=True)
class _Extra:
    work: list       # the same on A (DualPipeV's work alone)
    bubble: list     # A and B both repeat it (and split weight passes, where they recompute)
    memory: list
