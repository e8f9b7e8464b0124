"""CP-SAT solve of one leaf: contiguous layer-to-stage partition and per-layer recomputation for one mesh.

Minimises the pipeline critical path of `cost_models.pipeline` plus the exposed data-parallel reduction and
the optimizer step, under a memory cap per stage. Layers of one kind are interchangeable inside a chunk, so
the decisions are counts: blocks of each kind per chunk and how many of them recompute selectively or
fully. The model (`partition_model.PartitionModel`) sums the stage terms the step-time estimate sums
(`cost_models.stage_terms`), so the solver's optimum is the estimate's optimum.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from cost_models.layer_costs import MeshCosts
from cost_models.layer_records import RECOMPUTE_ORDER
from cost_models.memory import usable_bytes
from cost_models.layout import Recompute, RecomputeModule, first_blocks_of_each_chunk, nested_modules
from cost_models.pipeline import least_blocks, p2p_transfers_on_critical_path

from .bounds import Bounds, balanced_bound
from .memory_fit import fits_some_split
from .partition_model import TIME_UNIT_S, PartitionModel, selective_is_one_switch


@dataclass(frozen=True)
class PartitionResult:
    stage_layers: tuple[int, ...]
    layer_recompute: tuple[Recompute, ...]
    objective_s: float
    status: str
    gap: float
    wall_s: float
    recompute_modules: tuple[RecomputeModule, ...] = ()   # chosen by the solver where it was given a choice
    work: float = 0.0   # CP-SAT's deterministic time spent


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


# CP-SAT's deterministic time (its work count, in roughly seconds of one core) that one leaf may take: a
# limit in work rather than wall seconds gives the same answer however loaded the machine is
LEAF_WORK_LIMIT = 4.0


PROOFS = ("OPTIMAL", "INFEASIBLE")


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
    others = tuple(r for r in allowed if r is not Recompute.selective)
    sets = ModuleSets(costs, module_choices)
    if cutoff_s < float("inf") and _without_bound_s(costs, others) <= sets.least_s:
        # no recomputation may be the cheaper model (its bound is the least): solved first, its answer bars the
        # module sets, most of which then need no solve. Not without a cutoff: its per-layer choice then has no
        # bar to prove against, while a module set's model, which has none, solves in milliseconds and gives one
        # (DeepSeek-V3 on 2,048 H800, the best leaf inside the measured region: 1.9 CPU s -> 0.1)
        without = _solve(costs, others, time_limit_s, cutoff_s, work_limit, ())
        bar = min(cutoff_s, without.objective_s) if without.stage_layers else cutoff_s
        everywhere = _selective_everywhere(costs, max(0.0, time_limit_s - (time.perf_counter() - start)), bar,
                                           work_limit, module_choices, sets)
    else:
        # the selective model first: it has no per-layer choice, and its answer bounds the other
        everywhere = _selective_everywhere(costs, time_limit_s, cutoff_s, work_limit, module_choices, sets)
        bar = min(cutoff_s, everywhere.objective_s) if everywhere.stage_layers else cutoff_s
        without = _solve(costs, others, max(0.0, time_limit_s - (time.perf_counter() - start)), bar, work_limit, ())
    best = without if without.stage_layers and (
        not everywhere.stage_layers or without.objective_s <= everywhere.objective_s) else everywhere
    proven = without.status in PROOFS and everywhere.status in PROOFS
    status = ("OPTIMAL" if best.stage_layers else "INFEASIBLE") if proven else (
        "FEASIBLE" if best.stage_layers else "UNKNOWN")
    return replace(best, status=status, gap=best.gap if not proven else 0.0, wall_s=time.perf_counter() - start)


def _selective_everywhere(costs: MeshCosts, time_limit_s: float, cutoff_s: float, work_limit: float,
                          module_choices: tuple[RecomputeModule, ...], sets: "ModuleSets") -> PartitionResult:
    """Every block recomputing selectively one module set. Where the solver chooses the set, each valid set is
    solved in turn as a model of its own, least balanced bound first and below the best so far, until the
    next set's bound reaches that best: a model that chooses the set multiplies a choice by a count, which
    CP-SAT's relaxation ties loosely (DeepSeek-V3's leaves took 0.8 s each that way, 0.1-0.3 s so). `sets`:
    `ModuleSets`."""
    selective = (Recompute.selective,)
    if not module_choices:
        if sets.least_s > cutoff_s * (1 + BOUND_TOLERANCE):
            return PartitionResult((), (), float("inf"), "INFEASIBLE", float("inf"), 0.0)
        return _solve(costs, selective, time_limit_s, cutoff_s, work_limit, ())
    start = time.perf_counter()
    best, bar, proven, work_left = None, cutoff_s, True, work_limit
    floors = Bounds(costs.model, costs.cluster, costs.stack, selective)   # each set's floor, one cache
    for bound, set_costs in sets:
        if bound > bar * (1 + BOUND_TOLERANCE):   # nor can any set after it
            break
        if _beyond_memory(floors, set_costs) or not fits_some_split(set_costs, Recompute.selective):
            continue   # no partition recomputing it fits: the memory floor, or the integer split, proves it
        if work_left <= 0:
            proven = False   # the leaf's work is spent with sets left that might beat the best
            break
        result = _solve(set_costs, selective, max(0.0, time_limit_s - (time.perf_counter() - start)), bar,
                        work_left, ())
        work_left -= result.work
        proven &= result.status in PROOFS
        if result.stage_layers and (best is None or result.objective_s < best.objective_s):
            best = replace(result, recompute_modules=set_costs.layout.recompute_modules)
            bar = min(bar, result.objective_s)
    wall = time.perf_counter() - start
    if best is None:
        return PartitionResult((), (), float("inf"), "INFEASIBLE" if proven else "UNKNOWN", float("inf"), wall,
                               work=work_limit - work_left)
    return replace(best, status="OPTIMAL" if proven else "FEASIBLE", gap=0.0 if proven else best.gap, wall_s=wall,
                   work=work_limit - work_left)


def _beyond_memory(floors: Bounds, set_costs: MeshCosts) -> bool:
    """Whether the memory floor of every block recomputing the set (`Bounds.memory_floor` with selective
    recomputation only, the set read from the layout: at or below the fullest stage of any partition) exceeds
    the device: then no partition of the set's model fits, and CP-SAT need not prove it (on DeepSeek-V3's
    leaves two in three sets' solves ended so)."""
    return floors.memory_floor(set_costs.layout)[0] > usable_bytes(set_costs.cluster.device)


# the balanced bound is in exact seconds, the model's objective in 0.1 us units: a set whose bound lies within
# the rounding of the best is still solved
BOUND_TOLERANCE = 1e-6


def _hops_s(costs: MeshCosts) -> float:
    """The pipeline's hops, which the leaf model's objective leaves to the search."""
    lay = costs.layout
    return p2p_transfers_on_critical_path(lay.pp, lay.vp, lay.dualpipev) * costs.p2p_s()


def _without_bound_s(costs: MeshCosts, methods: tuple[Recompute, ...]) -> float:
    """At or below the leaf model's optimum with `methods` (no selective recomputation): its balanced-pipeline
    bound at the fastest of them, less the hops."""
    if not methods:
        return float("inf")
    fastest = min(methods, key=lambda method: RECOMPUTE_ORDER.index(method))
    return balanced_bound(costs, costs.layout, fastest) - _hops_s(costs)


class ModuleSets:
    """(bound, costs) of each valid module set (none nested in another of it), least bound first (ties: fewer
    modules, then in the choices' order): the balanced-pipeline bound of the layout recomputing it in every
    block, less the pipeline's hops, which the leaf model's objective leaves to the search. Without a choice of
    modules, the layout's own set. Walked once.

    Taken lazily, best first over the lattice of subsets: a set's bound is at or above each of its subsets'
    (selective recomputation repeats the forward of each module it names, `LayerCompute.selective_forward_s`,
    and the bound rises with the work), so a set is weighed only once the subset without its last module is
    reached. A leaf whose first sets already reach the best so far weighs a handful of its sets, not all of
    them (DeepSeek-V3's 7 modules: 79 sets)."""

    def __init__(self, costs: MeshCosts, module_choices: tuple[RecomputeModule, ...]):
        self.costs, self.choices, self.hops_s = costs, module_choices, _hops_s(costs)
        if not module_choices:
            self.heap = [(balanced_bound(costs, costs.layout, Recompute.selective) - self.hops_s, (), (), costs)]
        else:
            self.heap = [self._entry((module,)) for module in module_choices]
            heapq.heapify(self.heap)
        self.least_s = self.heap[0][0]   # every set's bound is at or above its single modules'

    def __iter__(self):
        while self.heap:
            bound, _, subset, set_costs = heapq.heappop(self.heap)
            yield bound, set_costs
            if not subset:
                continue
            for module in self.choices[self.choices.index(subset[-1]) + 1:]:
                if not nested_modules(subset + (module,)):
                    heapq.heappush(self.heap, self._entry(subset + (module,)))

    def _entry(self, subset: tuple[RecomputeModule, ...]) -> tuple:
        set_costs = self.costs.with_recompute_modules(subset)
        bound = balanced_bound(set_costs, set_costs.layout, Recompute.selective) - self.hops_s
        return bound, (len(subset), tuple(self.choices.index(module) for module in subset)), subset, set_costs


def _solve(costs: MeshCosts, allowed: tuple[Recompute, ...], time_limit_s: float, cutoff_s: float,
           work_limit: float, module_choices: tuple[RecomputeModule, ...]) -> PartitionResult:
    start_time = time.perf_counter()
    built = PartitionModel(costs, allowed, cutoff_s, module_choices)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s          # a safety net; the work limit decides
    solver.parameters.max_deterministic_time = work_limit
    solver.parameters.num_workers = 1  # deterministic: same inputs, same plan
    # the full LP relaxation: with it the bound meets the optimum at the root on the models whose module choice
    # and stage sums left CP-SAT's default branching for seconds unproven (DeepSeek-V3, pp2 x vp8, 10 -> 0.04
    # units of work; benchmarks/search_speed.py)
    solver.parameters.linearization_level = 2
    solver.parameters.catch_sigint_signal = False  # Ctrl-C reaches Python and ends the search (exit 130)
    status = solver.Solve(built.cp)
    wall = time.perf_counter() - start_time
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PartitionResult((), (), float("inf"), name, float("inf"), wall, work=solver.deterministic_time)
    return replace(_decode(solver, built, name, wall), work=solver.deterministic_time)


def _decode(solver: cp_model.CpSolver, built: PartitionModel, status: str, wall: float) -> PartitionResult:
    """The solution as blocks per chunk, each block's method and the modules chosen, with the proven gap."""
    lay = built.lay
    sizes = tuple(solver.Value(s) for s in built.size)
    recompute = _decode_recompute(solver, built.runs, sizes, built.redo, built.extra, built.count, built.stage_of) \
        if built.per_chunk is None else first_blocks_of_each_chunk(sizes, built.per_chunk)
    if built.single_kind:
        sizes, recompute = _split_ranks_into_chunks(sizes, recompute, built.chunks, lay.chunk_rank)
    objective = solver.ObjectiveValue() * TIME_UNIT_S / built.scale
    bound = solver.BestObjectiveBound() * TIME_UNIT_S / built.scale
    gap = (objective - bound) / objective if objective else 0.0
    modules = tuple(mod for mod, on in built.chosen.items() if solver.Value(on)) \
        if Recompute.selective in recompute else ()
    return PartitionResult(sizes, recompute, objective, status, max(0.0, gap), wall, modules)


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
