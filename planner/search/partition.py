"""CP-SAT model: contiguous layer-to-stage partition and per-layer recomputation for one mesh.

Minimises the pipeline critical path of `cost_models.pipeline.pipeline_seconds` plus the exposed
data-parallel reduction and the optimizer step, under a memory cap per stage. Layers of one kind are
interchangeable inside a chunk, so the decisions are counts: blocks of each kind per chunk and how many
of them recompute selectively or fully. Coefficients come from `MeshCosts`, the same numbers the
step-time estimate uses, so the solver's optimum is the estimate's optimum.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from cost_models.layer_costs import RECOMPUTE_INDEX, RECOMPUTE_ORDER, MeshCosts
from cost_models.layout import MODULE_INDEX, Recompute, RecomputeModule, first_blocks_of_each_chunk, nested_modules
from cost_models.memory import gradients_held_at_peak, logits_bytes, loss_gradient_bytes, usable_bytes
from cost_models.pipeline import (dualpipev_split_recompute_factor, dualpipev_weight_factor, in_flight_micro_batches,
                                  least_blocks)

TIME_UNIT_S = 1e-7          # integer scaling: solver times are multiples of 0.1 us
MEMORY_UNIT_BYTES = 1024    # and memory multiples of 1 KiB


FINE_PER_UNIT = 1000        # per-step dp and optimizer terms in 1 ns steps: a layer's share can be < 1 us


def _t(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S))


def _t_extra(seconds: float) -> int:
    """Time a choice adds (recomputation), at least one unit where it adds any: a choice that costs time
    never ties with one that costs none (a norm's recomputation in a small model rounds to 0)."""
    return max(_t(seconds), 1) if seconds > 0 else 0


def _fine(seconds: float) -> int:
    return int(round(seconds / TIME_UNIT_S * FINE_PER_UNIT))


def _m(nbytes: float) -> int:
    return int(round(nbytes / MEMORY_UNIT_BYTES))


@dataclass(frozen=True)
class PartitionResult:
    stage_layers: tuple[int, ...]
    layer_recompute: tuple[Recompute, ...]
    objective_s: float
    status: str
    gap: float
    wall_s: float
    recompute_modules: tuple[RecomputeModule, ...] = ()   # chosen by the solver where it was given a choice


def model_key(costs: MeshCosts, allowed: tuple[Recompute, ...], module_choices: tuple[RecomputeModule, ...] = ()
              ) -> tuple:
    """Everything `solve_partition` reads besides the cutoff: layouts with equal keys (e.g. mesh orders
    that move no collective off its links) give the same CP-SAT model and the same answer."""
    lay, model = costs.layout, costs.model
    return (lay.pp, lay.vp, lay.num_micro_batches, lay.tp, lay.cp, lay.micro_batch, allowed, module_choices, model.blocks,
            tuple(costs.layer(kind) for kind in model.kinds), costs.comm_buffer_bytes, costs.dp_latency_s,
            costs.stack.dp_window_fraction, costs.cluster.device.name, costs.stack.hides_moe_a2a(lay),
            costs.stack.selective_every_layer, lay.dualpipev, costs.stack.dualpipev_hides(lay),
            costs.stack.dualpipev_weight_split_in_cooldown, costs.stack.dualpipev_even_split, lay.recompute_layers)


def block_runs(blocks: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs of consecutive blocks of one kind: (kind, start, end)."""
    runs: list[tuple[str, int, int]] = []
    for index, kind in enumerate(blocks):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], index + 1)
        else:
            runs.append((kind, index, index + 1))
    return runs


# CP-SAT's deterministic time (its work count, in roughly seconds of one core) that one leaf may take: a
# limit in work rather than wall seconds gives the same answer however loaded the machine is
LEAF_WORK_LIMIT = 4.0


PROOFS = ("OPTIMAL", "INFEASIBLE")


def selective_is_one_switch(stack, allowed: tuple[Recompute, ...]) -> bool:
    """Whether a plan must recompute selectively every block or none (and then none fully): the stack's
    selective recomputation is one switch for the model and the leaf may choose among methods."""
    return stack.selective_every_layer and Recompute.selective in allowed and len(allowed) > 1


def solve_partition(costs: MeshCosts, allowed: tuple[Recompute, ...], time_limit_s: float = 600.0,
                    cutoff_s: float = float("inf"), work_limit: float = LEAF_WORK_LIMIT,
                    module_choices: tuple[RecomputeModule, ...] = ()) -> PartitionResult:
    """Best partition and recomputation; with `cutoff_s`, only one that beats it (else INFEASIBLE).
    With `module_choices`, also the modules selective recomputation repeats (one set for every layer, as
    Megatron-Core's --recompute-modules), in place of the layout's. OPTIMAL and INFEASIBLE are proofs;
    FEASIBLE (a partition, not proven best) and UNKNOWN mean the work limit stopped the solver first.

    Where the stack's selective recomputation is one switch for the model (Megatron-Core's
    --recompute-granularity takes one value), a plan recomputes selectively every block or none, and then
    none fully: two models, each simpler than their disjunction, the better answer kept."""
    if not selective_is_one_switch(costs.stack, allowed):
        return _solve(costs, allowed, time_limit_s, cutoff_s, work_limit, module_choices)
    start = time.perf_counter()
    # the selective model first: it has no per-layer choice, and its answer bounds the other
    everywhere = _solve(costs, (Recompute.selective,), time_limit_s, cutoff_s, work_limit, module_choices)
    bar = min(cutoff_s, everywhere.objective_s) if everywhere.stage_layers else cutoff_s
    without = _solve(costs, tuple(r for r in allowed if r is not Recompute.selective),
                     max(0.0, time_limit_s - (time.perf_counter() - start)), bar, work_limit, ())
    best = without if without.stage_layers else everywhere
    proven = without.status in PROOFS and everywhere.status in PROOFS
    status = ("OPTIMAL" if best.stage_layers else "INFEASIBLE") if proven else (
        "FEASIBLE" if best.stage_layers else "UNKNOWN")
    return replace(best, status=status, gap=best.gap if not proven else 0.0, wall_s=time.perf_counter() - start)


def _solve(costs: MeshCosts, allowed: tuple[Recompute, ...], time_limit_s: float, cutoff_s: float,
           work_limit: float, module_choices: tuple[RecomputeModule, ...]) -> PartitionResult:
    start_time = time.perf_counter()
    lay, model = costs.layout, costs.model
    num_blocks, chunks, pp, v = len(model.blocks), lay.pp * lay.vp, lay.pp, lay.vp
    m = lay.num_micro_batches
    runs = block_runs(model.blocks)
    layer = {kind: costs.layer(model.kind(kind)) for kind, _, _ in runs}
    emb, head = costs.layer(model.embedding), costs.layer(model.head)
    extra = [r for r in RECOMPUTE_ORDER[1:] if r in allowed]
    cp = cp_model.CpModel()

    # one kind of block: only blocks per pipeline rank matter (any split of them into vp chunks is
    # contiguous), so the units are ranks; several kinds: the units are the pp * vp chunks in order, chunk j
    # on rank `Layout.chunk_rank(j)` (round robin, or DualPipeV's V)
    # Megatron's block method recomputes the first N blocks of each chunk: chunks are then the units
    per_chunk = lay.recompute_layers
    single_kind = len(runs) == 1 and per_chunk is None
    units = pp if single_kind else chunks
    stage_of = (lambda u: u) if single_kind else lay.chunk_rank
    # a chunk holds a layer, or the embedding (first chunk) or the loss (last) alone (cost_models.pipeline)
    chunk_min = [least_blocks(j, chunks) for j in range(chunks)]
    unit_min = [sum(chunk_min[j] for j in range(chunks) if lay.chunk_rank(j) == i) for i in range(pp)] \
        if single_kind else chunk_min

    # variables: blocks per unit and blocks of each run in each unit
    size = [cp.NewIntVar(unit_min[u], num_blocks, f"size{u}") for u in range(units)]
    if lay.dualpipev and costs.stack.dualpipev_even_split:
        # constraint: the stack splits the layers evenly over the chunks (MindSpeed's DualPipeV)
        for u in range(units):
            cp.Add(size[u] == num_blocks * (chunks // units) // chunks)
    count = [[size[j]] if single_kind else
             [cp.NewIntVar(0, r1 - r0, f"n{j}_{r}") for r, (_, r0, r1) in enumerate(runs)]
             for j in range(units)]
    if not single_kind:
        # constraint: run labels never decrease along the chunks, so each chunk is a contiguous slice:
        # a chunk using run r lies between first[r] and last[r], and last[r] <= first[r + 1]
        first = [cp.NewIntVar(0, units - 1, f"first{r}") for r in range(len(runs))]
        last = [cp.NewIntVar(0, units - 1, f"last{r}") for r in range(len(runs))]
        for r, (_, r0, r1) in enumerate(runs):
            cp.Add(sum(count[j][r] for j in range(units)) == r1 - r0)
            if r + 1 < len(runs):
                cp.Add(last[r] <= first[r + 1])
            for j in range(units):
                used = cp.NewBoolVar(f"uses{j}_{r}")
                cp.Add(count[j][r] >= 1).OnlyEnforceIf(used)
                cp.Add(count[j][r] == 0).OnlyEnforceIf(used.Not())
                cp.Add(first[r] <= j).OnlyEnforceIf(used)
                cp.Add(last[r] >= j).OnlyEnforceIf(used)
        for j in range(units):
            cp.Add(sum(count[j]) == size[j])
    # variables: recomputed blocks per pipeline rank, run and method (a rank's time and memory do not
    # depend on which of its chunks holds them, so counting per rank removes symmetric solutions)
    redo = {(i, r, k): cp.NewIntVar(0, runs[r][2] - runs[r][1], f"rc{i}_{r}_{k.value}")
            for i in range(pp) for r in range(len(runs)) for k in extra}
    owned_by = [[u for u in range(units) if stage_of(u) == i] for i in range(pp)]
    # variables: the modules selective recomputation repeats, where the solver chooses them; a module's time
    # and freed bytes add up over the chosen set (each saved tensor has one maker; a module nested in another,
    # moe_act or shared_experts in moe, is never chosen beside it), so a layer's selective
    # cost is linear in `part`: its run's selective blocks on a rank that recompute that module
    choose = bool(module_choices) and Recompute.selective in extra
    chosen = {mod: cp.NewBoolVar(f"module_{mod.value}") for mod in module_choices} if choose else {}
    part = {}
    if choose:
        cp.Add(sum(chosen.values()) >= 1)   # selective recomputation repeats something
        # moe_act and shared_experts lie inside moe: with it they would free their tensors twice in the sums
        # (and are refused as pins)
        for mod in nested_modules(chosen):
            cp.AddBoolOr([chosen[mod].Not(), chosen[mod.container].Not()])
        for (i, r, k), var in redo.items():
            if k is not Recompute.selective:
                continue
            for mod, on in chosen.items():
                part[i, r, mod] = cp.NewIntVar(0, runs[r][2] - runs[r][1], f"part{i}_{r}_{mod.value}")
                cp.Add(part[i, r, mod] == var).OnlyEnforceIf(on)
                cp.Add(part[i, r, mod] == 0).OnlyEnforceIf(on.Not())

    if per_chunk is not None:
        _recompute_first_blocks(cp, size, runs, redo, owned_by, per_chunk)

    # constraints: units tile the blocks
    cp.Add(sum(size) == num_blocks)
    # constraints: a block recomputes at most one way
    for i in range(pp):
        for r in range(len(runs)):
            held = sum(count[j][r] for j in owned_by[i])
            if extra and Recompute.none in allowed:
                cp.Add(sum(redo[i, r, k] for k in extra) <= held)
            elif extra:  # recomputation pinned: every block takes one of the allowed methods
                cp.Add(sum(redo[i, r, k] for k in extra) == held)

    capacity = usable_bytes(costs.cluster.device)
    # gradients that backward allocates (one micro-batch per step) are not held at the activation peak:
    # the stage then fits when both peaks fit (`StageMemory.total`)
    held = gradients_held_at_peak(costs.stack.gradient_buffer_in(lay), m)
    paired = costs.stack.hides_moe_a2a(lay)   # combined 1F1B holds one more forward's activations
    weight_factor = dualpipev_weight_factor(costs.stack.dualpipev_weight_split_in_cooldown)
    split = dualpipev_split_recompute_factor(pp, costs.stack.dualpipev_weight_pass_recompute) if lay.dualpipev else 0.0

    def peak_states(c) -> float:
        return c.states.total if held else c.states.total - c.states.gradients

    def alone_s(c) -> float:   # DualPipeV: the layer's forward and backward run alone (A)
        return c.work_s(Recompute.none) + c.unpaired_extra_s

    def bubble_s(c) -> float:  # ... and its part of the bubble term (A + B - kW)
        return c.dualpipev_bubble_s(Recompute.none, weight_factor)

    work, compute, reduce, optimizer_steps, alone, bubble = [], [], [], [], [], []
    for i in range(pp):
        owned = owned_by[i]
        first, last = i == 0, i == lay.chunk_rank(chunks - 1)
        flight = in_flight_micro_batches(i, pp, m, v, paired, lay.dualpipev)
        w_terms, c_terms, mem_terms, g_terms, o_terms, grad_terms = [], [], [], [], [], []
        r_terms, a_terms, b_terms = [], [], []   # recomputation's time; DualPipeV's A and bubble term
        # DualPipeV: full recomputation split weight passes repeat per parameter group, in the bubble term (where
        # they do, the stack refuses selective recomputation: `leaf_recompute_methods`)
        s_terms = []
        for j in owned:
            for r, (kind, _, _) in enumerate(runs):
                c = layer[kind]
                n = count[j][r]
                w_terms.append(_t(c.work_s(Recompute.none)) * n)
                a_terms.append(_t(alone_s(c)) * n)
                b_terms.append(_t(bubble_s(c)) * n)
                c_terms.append(_t(c.forward_s + c.backward_s) * n)
                mem_terms.append(_m(peak_states(c) + flight * c.activation_bytes[0]) * n)
                grad_terms.append(_m(c.states.total) * n)
                g_terms.append(_fine(c.dp_reduce_s) * n)
                o_terms.append(_fine(c.optimizer_step_s) * n)
        for r, (kind, _, _) in enumerate(runs):
            c = layer[kind]
            for k in extra:
                if choose and k is Recompute.selective:
                    for mod in chosen:
                        r_terms.append(_t_extra(c.module_recompute_s[MODULE_INDEX[mod]]) * part[i, r, mod])
                        mem_terms.append(-_m(flight * c.module_freed_bytes[MODULE_INDEX[mod]]) * part[i, r, mod])
                    continue
                r_terms.append(_t_extra(c.work_s(k) - c.work_s(Recompute.none)) * redo[i, r, k])
                s_terms.append(_t_extra(split * c.dualpipev_split_recompute_s(k)) * redo[i, r, k])
                mem_terms.append(_m(flight * (c.activation_bytes[RECOMPUTE_INDEX[k]] - c.activation_bytes[0])) * redo[i, r, k])
        fixed = [c for c, on in ((emb, first), (head, last)) if on]
        fixed_work = sum(_t(c.work_s(Recompute.none)) for c in fixed)
        # DualPipeV: the rank alone (A) and its bubble term (A + B - kW); recomputation lengthens A and B
        alone.append(sum(a_terms) + sum(r_terms) + sum(_t(alone_s(c)) for c in fixed))
        bubble.append(sum(b_terms) + 2 * sum(r_terms) + sum(s_terms) + sum(_t(bubble_s(c)) for c in fixed))
        w_terms += r_terms
        fixed_mem = sum(peak_states(c) + flight * c.activation_bytes[0] for c in fixed)
        loss = costs.stack.loss_gradient
        fixed_mem += logits_bytes(model.head, lay.tp, lay.cp, lay.micro_batch, loss) + loss_gradient_bytes(
            model.head, lay.tp, lay.cp, lay.micro_batch, loss) if last else 0.0
        fixed_mem += costs.comm_buffer_bytes
        # working set: a recomputed layer's full activations while its backward runs
        working = cp.NewIntVar(0, _m(max(c.working_bytes for c in layer.values())), f"working{i}")
        for r, (kind, r0, r1) in enumerate(runs):
            if extra:
                has = cp.NewBoolVar(f"has_rc{i}_{r}")
                cp.Add(sum(redo[i, r, k] for k in extra) <= (r1 - r0) * has)
                cp.Add(working >= _m(layer[kind].working_bytes) * has)
        # constraint: memory of each stage within the usable HBM
        cp.Add(sum(mem_terms) + _m(fixed_mem) + working <= _m(capacity))
        if not held:  # and at the end of backward, every gradient beside the states
            cp.Add(sum(grad_terms) + _m(sum(c.states.total for c in fixed) + costs.comm_buffer_bytes) <= _m(capacity))
        work.append(sum(w_terms) + fixed_work)
        compute.append(sum(c_terms) + sum(_t(c.forward_s + c.backward_s) for c in fixed))
        reduce.append(sum(g_terms) + sum(_fine(c.dp_reduce_s) for c in fixed))
        optimizer_steps.append(sum(o_terms) + sum(_fine(c.optimizer_step_s) for c in fixed))

    horizon = _t(1e4)
    slowest = cp.NewIntVar(0, horizon, "slowest")
    dp_exposed = cp.NewIntVar(0, horizon, "dp_exposed")
    optimizer = cp.NewIntVar(0, horizon, "optimizer")
    window = int(round(costs.stack.dp_window_fraction * FINE_PER_UNIT))
    for i in range(pp):
        # constraint: the slowest stage paces the steady state
        cp.Add(slowest >= work[i])
        # constraint: the slowest optimizer step of any stage
        cp.Add(optimizer * FINE_PER_UNIT >= optimizer_steps[i])
        # constraint: dp_exposed >= MeshCosts.dp_exposed_s of each stage (>= 0 by its domain): the latency
        # plus the layers' dp_reduce_s, less the window of the stage's last micro-batch
        cp.Add(dp_exposed * FINE_PER_UNIT >= _fine(costs.dp_latency_s) + reduce[i] - window * compute[i])

    if lay.dualpipev:
        # constraints: DualPipeV's slowest rank alone and largest bubble term (at least 0)
        slowest_alone = cp.NewIntVar(0, horizon, "slowest_alone")
        largest_bubble = cp.NewIntVar(0, horizon, "largest_bubble")
        for i in range(pp):
            cp.Add(slowest_alone >= alone[i])
            cp.Add(largest_bubble >= bubble[i])
        # objective: 2 step = (2m - p - 2) max X + (p + 2) max A + (p - 1) max(A + B - 3W) + 2 (dp + optimizer)
        scale = 2
        objective = ((2 * m - pp - 2) * slowest + (pp + 2) * slowest_alone + (pp - 1) * largest_bubble
                     + scale * (dp_exposed + optimizer))
    else:
        # objective: v * step = v (m - 1) max W + sum W + (v - 1) max W + v (dp + optimizer)
        scale = v
        objective = v * (m - 1) * slowest + sum(work) + (v - 1) * slowest + v * (dp_exposed + optimizer)
    if cutoff_s < float("inf"):  # branch and bound: a plan no better than the incumbent is of no use
        cp.Add(objective <= _t(cutoff_s * scale))
    cp.Minimize(objective)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s          # a safety net; the work limit decides
    solver.parameters.max_deterministic_time = work_limit
    solver.parameters.num_workers = 1  # deterministic: same inputs, same plan
    solver.parameters.catch_sigint_signal = False  # Ctrl-C reaches Python and ends the search (exit 130)
    status = solver.Solve(cp)
    wall = time.perf_counter() - start_time
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PartitionResult((), (), float("inf"), name, float("inf"), wall)
    sizes = tuple(solver.Value(s) for s in size)
    recompute = _decode_recompute(solver, runs, sizes, redo, extra, count, stage_of) if per_chunk is None \
        else first_blocks_of_each_chunk(sizes, per_chunk)
    if single_kind:
        sizes, recompute = _split_ranks_into_chunks(sizes, recompute, chunks, lay.chunk_rank)
    objective = solver.ObjectiveValue() * TIME_UNIT_S / scale
    bound = solver.BestObjectiveBound() * TIME_UNIT_S / scale
    gap = (objective - bound) / objective if objective else 0.0
    modules = tuple(mod for mod, on in chosen.items() if solver.Value(on)) \
        if Recompute.selective in recompute else ()
    return PartitionResult(sizes, recompute, objective, name, max(0.0, gap), wall, modules)


def _recompute_first_blocks(cp: cp_model.CpModel, size, runs, redo, owned_by, per_chunk: int) -> None:
    """Constraints of Megatron's block method: each chunk recomputes fully its first min(N, size) blocks,
    whose kinds are the runs that the span [start, start + head) of the chunk's blocks overlaps (start: the
    sizes of the chunks before it), and nothing else."""
    num_blocks = runs[-1][2]
    overlap = []
    for j in range(len(size)):
        start = cp.NewIntVar(0, num_blocks, f"start{j}")
        cp.Add(start == sum(size[:j]))
        head = cp.NewIntVar(0, per_chunk, f"head{j}")
        cp.AddMinEquality(head, [size[j], per_chunk])
        row = []
        for r, (_, r0, r1) in enumerate(runs):
            low, high = cp.NewIntVar(0, num_blocks, f"lo{j}_{r}"), cp.NewIntVar(0, num_blocks, f"hi{j}_{r}")
            cp.AddMaxEquality(low, [start, r0])
            cp.AddMinEquality(high, [start + head, r1])
            span = cp.NewIntVar(0, r1 - r0, f"ov{j}_{r}")
            cp.AddMaxEquality(span, [high - low, 0])
            row.append(span)
        overlap.append(row)
    for i, units in enumerate(owned_by):
        for r in range(len(runs)):
            for k in (Recompute.full, Recompute.selective):
                if (i, r, k) in redo:
                    cp.Add(redo[i, r, k] == (sum(overlap[j][r] for j in units) if k is Recompute.full else 0))


def _split_ranks_into_chunks(per_rank: tuple[int, ...], recompute: tuple[Recompute, ...], chunks: int,
                             chunk_rank) -> tuple[tuple[int, ...], tuple[Recompute, ...]]:
    """Blocks per rank -> blocks per chunk (chunk j on rank `chunk_rank(j)`), recomputation kept per rank;
    the chunks that may hold no layer (the first, beside the embedding, and the last) take their share last."""
    owned = [[j for j in range(chunks) if chunk_rank(j) == i] for i in range(len(per_rank))]
    share = [0] * chunks
    for i, n in enumerate(per_rank):
        order = sorted(owned[i], key=lambda j: (least_blocks(j, chunks) == 0, j))
        for rank_in_order, j in enumerate(order):
            share[j] = n // len(order) + (1 if rank_in_order < n % len(order) else 0)
    by_rank, start = [], 0
    for n in per_rank:
        by_rank.append(list(recompute[start:start + n]))
        start += n
    layers = []
    for j in range(chunks):
        i = chunk_rank(j)
        layers += by_rank[i][:share[j]]
        by_rank[i] = by_rank[i][share[j]:]
    return tuple(share), tuple(layers)


def _decode_recompute(solver, runs, sizes, redo, extra, count, stage_of) -> tuple[Recompute, ...]:
    """Each rank's recomputed blocks of a run go to its first such blocks: full, then selective."""
    left = {(i, r, k): solver.Value(var) for (i, r, k), var in redo.items()}
    layers: list[Recompute] = []
    for j in range(len(sizes)):
        for r in range(len(runs)):
            n = solver.Value(count[j][r])
            for k in (Recompute.full, Recompute.selective):
                take = min(n, left.get((stage_of(j), r, k), 0))
                if take:
                    left[stage_of(j), r, k] -= take
                    layers += [k] * take
                    n -= take
            layers += [Recompute.none] * n
    return tuple(layers)
