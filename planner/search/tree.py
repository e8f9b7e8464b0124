"""Best-first branch and bound over meshes, micro-batches, ZeRO stages and virtual stages, CP-SAT inside.

The space is a tree: a mesh shape with a schedule (tp, cp, pp, dp, vp, micro-batch) is bounded by its
compute alone; its children add the expert folding and mesh order, bounded by compute plus exposed
per-layer communication; their children add the ZeRO stage, bounded by a balanced pipeline with its
data-parallel and optimizer time, and pruned when their memory floor (model states of a perfectly split
model plus the cheapest activations) exceeds the device. Nodes are expanded cheapest bound first; a
node whose bound cannot beat the K-th best plan so far ends the search, since every node left is at
least as slow. Leaves go to the partition solver.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from cost_models.layer_costs import MeshCosts, SharedCosts
from cost_models.layout import MEGATRON_ORDER, Layout, Recompute, RecomputeModule
from hardware_profiles.loader import load_stack
from hardware_profiles.stack import SoftwareStack
from cost_models.layout_codec import text_of
from cost_models.memory import usable_bytes
from cost_models.pipeline import p2p_transfers_on_critical_path
from cost_models.records import ModelCosts
from cost_models.step_time import Estimate, estimate
from hardware_profiles.schema import Cluster

from .bounds import Bounds, balanced_bound, communication_bound, pipeline_bound, work_before_zero, work_floor
from .partition import LEAF_WORK_LIMIT, PartitionResult, model_key, solve_partition
from ..rules.pins import Pins
from ..rules.stack import leaf_recompute_methods
from .space import (MeshShape, make_layout, mesh_shapes, placement_choices, schedule_choices,
                    zero_choices)


@dataclass(frozen=True)
class Scored:
    estimate: Estimate
    partition: PartitionResult


@dataclass(frozen=True)
class SearchOutcome:
    ranked: tuple[Scored, ...]          # best first
    candidates: int
    pruned_memory: int
    pruned_bound: int
    solved: int
    wall_s: float
    unexplored: int                     # candidates left when the time limit ran out (0: search complete)
    smallest_memory_need: float         # over all candidates (for infeasible requests)
    smallest_need_parts: dict
    unproven: int                       # leaves whose partition the solver's work limit left unproven
    cpu_s: float                        # CPU seconds of this process during the search

    @property
    def complete(self) -> bool:
        """Every candidate was bounded away or solved to a proof: the plan is the model's optimum."""
        return self.unexplored == 0 and self.unproven == 0


class _SolvedModels:
    """Proven answers of CP-SAT models already solved, reused for a leaf with the same model."""

    def __init__(self):
        self._answers: dict[tuple, tuple[float, PartitionResult]] = {}

    def record(self, key: tuple, cutoff_s: float, result: PartitionResult) -> None:
        if result.status in ("OPTIMAL", "INFEASIBLE"):
            self._answers[key] = (cutoff_s, result)

    def answer(self, key: tuple, cutoff_s: float) -> PartitionResult | None:
        """The optimum if it beats `cutoff_s`, an empty result if it provably cannot, None if unknown."""
        if key not in self._answers:
            return None
        solved_cutoff, result = self._answers[key]
        if result.stage_layers:  # the model's optimum (it was below the cutoff it was solved with)
            return result if result.objective_s <= cutoff_s else replace(result, stage_layers=(), layer_recompute=(),
                                                                          status="INFEASIBLE")
        return result if cutoff_s <= solved_cutoff else None


TIE_TOLERANCE = 1e-5   # wider than half a 6-significant-digit step: plans this close may tie in the ranking


def six_digits(seconds: float) -> float:
    """The precision at which step times tie (ranking, pruning and the explanations agree on it)."""
    return float(f"{seconds:.6g}")


def _beyond(bound_s: float, kth_s: float) -> bool:
    """A subtree whose bound is above the K-th plan even at the ranking's 6 significant digits can
    neither beat it nor tie it (ties go to the simpler layout, so they must be seen)."""
    return six_digits(bound_s) > six_digits(kth_s)


def _rank_key(scored: Scored) -> tuple:
    """Fastest first; among equal times (6 significant digits) the simpler layout: fewer context, pipeline
    and tensor ranks, lower ZeRO stage, larger micro-batch."""
    lay = scored.estimate.layout
    return (six_digits(scored.estimate.step_time_s), lay.cp, lay.pp * lay.vp, lay.tp, lay.ep, lay.etp, lay.zero,
            lay.moe_a2a_overlap, -lay.micro_batch, text_of(lay))


@dataclass(frozen=True)
class _Node:
    """A subtree of the space: a mesh shape and schedule, then expert folding and order, then ZeRO."""
    shape: MeshShape
    vp: int
    mbs: int
    dualpipev: bool = False             # the DualPipeV schedule (vp = 2 as a V)
    placement: tuple | None = None      # (etp, ep, mesh order) from the second level on
    a2a_overlap: bool = False           # combined 1F1B, chosen with the placement where the stack pairs it
    zero: int | None = None             # set on leaves

    def layout(self, problem: "_Problem") -> Layout:
        etp, ep, order = self.placement or (1, 1, MEGATRON_ORDER)
        return make_layout(self.shape, problem.global_batch, problem.pins, problem.precision, vp=self.vp,
                           mbs=self.mbs, etp=etp, ep=ep, order=order, zero=self.zero or 0,
                           a2a_overlap=self.a2a_overlap, dualpipev=self.dualpipev)

    def tie_key(self) -> tuple:
        etp, ep, order = self.placement or (0, 0, ())
        s = self.shape
        return (s.tp, s.pp, s.dp, s.cp, ep, etp, self.vp, self.dualpipev, self.mbs, self.a2a_overlap,
                -1 if self.zero is None else self.zero, order)


@dataclass(frozen=True)
class _Problem:
    """What the tree needs to enumerate and build layouts."""
    cluster: Cluster
    global_batch: int
    pins: Pins
    precision: str
    graph: object
    zeros: tuple[int, ...]
    stack: SoftwareStack


class _Tree:
    """Children and leaf counts of the search tree's nodes."""

    def __init__(self, problem: _Problem):
        self.problem = problem
        self.fast = problem.cluster.fast_domain_devices
        self._placements: dict[MeshShape, list] = {}
        self._virtual_stages: dict[MeshShape, set[tuple[int, bool]]] = {}
        self._zeros: dict[tuple[int, int, int], tuple[int, ...]] = {}   # (dp x cp, tp, ep) -> ZeRO stages

    def roots(self) -> list[_Node]:
        p = self.problem
        return [_Node(shape, choice.vp, choice.mbs, choice.dualpipev)
                for shape in mesh_shapes(p.graph, p.cluster.num_devices, p.global_batch, p.pins, self.fast)
                for choice in schedule_choices(p.graph, shape, p.global_batch, p.pins)]

    def virtual_stage_choices(self, shape: MeshShape) -> set[tuple[int, bool]]:
        """(vp, DualPipeV) pairs of the shape's schedules: which pipeline hops leave a domain depends on them."""
        if shape not in self._virtual_stages:
            p = self.problem
            self._virtual_stages[shape] = {(c.vp, c.dualpipev)
                                           for c in schedule_choices(p.graph, shape, p.global_batch, p.pins)}
        return self._virtual_stages[shape]

    def placements(self, shape: MeshShape) -> list:
        if shape not in self._placements:
            self._placements[shape] = placement_choices(self.problem.graph, shape, self.problem.pins, self.fast)
        return self._placements[shape]

    def children(self, node: _Node) -> list[_Node]:
        if node.placement is None:
            return [replace(node, placement=placement, a2a_overlap=overlap)
                    for placement in self.placements(node.shape) for overlap in self.overlaps(node, placement)]
        return [replace(node, zero=zero) for zero in self.zeros(node)]

    def overlaps(self, node: _Node, placement: tuple) -> tuple[bool, ...]:
        """Combined 1F1B off and on where the stack can pair this layout's MoE passes (it hides all-to-alls and
        holds one more forward's activations: the search weighs both), else off; or as pinned."""
        p = self.problem
        if not p.stack.moe_a2a_overlap or placement[1] == 1:   # the common case, without building a layout
            return (False,)
        if not p.stack.pairs_moe_a2a(replace(node, placement=placement).layout(p)):
            return (False,)
        return (p.pins.a2a_overlap,) if p.pins.a2a_overlap is not None else (False, True)

    def zeros(self, node: _Node) -> tuple[int, ...]:
        """The ZeRO stages of a placed node's leaves: those the stack runs for its degrees."""
        return self._zeros_for(node.shape.dp * node.shape.cp, node.shape.tp, node.placement[1], node.dualpipev)

    def _zeros_for(self, dp: int, tp: int, ep: int, dualpipev: bool) -> tuple[int, ...]:
        key = (dp, tp, ep, dualpipev)
        if key not in self._zeros:
            runs = self.problem.stack.zero_stages_for(dp, tp, ep, dualpipev)
            self._zeros[key] = tuple(zero for zero in self.problem.zeros if zero in runs)
        return self._zeros[key]

    def leaf_count(self, node: _Node) -> int:
        if node.zero is not None:
            return 1
        if node.placement is not None:
            return len(self.zeros(node))
        s = node.shape
        return sum(len(self._zeros_for(s.dp * s.cp, s.tp, placement[1], node.dualpipev))
                   * len(self.overlaps(node, placement))
                   for placement in self.placements(s))

    def leaves(self, node: _Node):
        if node.zero is not None:
            yield node
            return
        for child in self.children(node):
            yield from self.leaves(child)


def search(model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins = Pins(),
           precision: str = "bf16", time_limit_s: float = 60.0, top_k: int = 3, *,
           stack: SoftwareStack | None = None, ep_imbalance: float = 1.0, graph=None,
           progress=None, recompute_choices: tuple[Recompute, ...] | None = None,
           leaf_work_limit: float = LEAF_WORK_LIMIT,
           module_choices: tuple[RecomputeModule, ...] = ()) -> SearchOutcome:
    """`module_choices`: the modules selective recomputation may repeat, chosen with each leaf's partition
    (empty: the pinned layout's, Megatron-Core's core_attn by default)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    stack = stack or load_stack()   # Megatron-Core's defaults (the API always names its stack)
    allowed = recompute_choices or ((pins.recompute,) if pins.recompute else tuple(Recompute))
    problem = _Problem(cluster, global_batch, pins, precision, graph, zero_choices(pins), stack)
    tree = _Tree(problem)
    capacity = usable_bytes(cluster.device)
    bounds = Bounds(model, cluster, stack, allowed, module_choices)
    shared = SharedCosts()
    heap: list = []
    solved_models = _SolvedModels()
    # (shape, mbs, placement, MoE overlaps): the work before ZeRO, any vp; and a pipeline hop's seconds at
    # each (vp, DualPipeV) (which hops leave a domain depends on them), from the placement's first layout
    placement_work: dict[tuple, tuple[tuple, tuple, dict[tuple[int, bool], float]]] = {}

    def node_communication_bound(node: _Node, layout: Layout) -> float:
        key = (node.shape, node.mbs, node.placement, stack.hides_moe_a2a(layout), stack.dualpipev_hides(layout))
        if key not in placement_work:  # the last entries: whether MoE all-to-alls overlap (schedule-dependent)
            costs = MeshCosts(model, cluster, layout, stack, ep_imbalance, shared)
            hops = {(vp, v_shape): costs.p2p_s(vp, v_shape) for vp, v_shape in tree.virtual_stage_choices(node.shape)}
            placement_work[key] = (*work_before_zero(costs, bounds.fastest), hops)
        blocks, edges, hops = placement_work[key]
        return communication_bound(work_floor(blocks, edges, layout.pp, layout.vp, layout.dualpipev),
                                   hops[layout.vp, layout.dualpipev], layout)

    def push(node: _Node, bound: float, costs: MeshCosts | None = None) -> None:
        heapq.heappush(heap, (bound, node.tie_key(), node, costs))

    for root in tree.roots():
        layout = root.layout(problem)
        push(root, pipeline_bound(bounds.compute_work_s(layout), layout))
    candidates = sum(tree.leaf_count(node) for _, _, node, _ in heap)
    smallest, smallest_parts = float("inf"), {}
    least_need, least_parts = float("inf"), {}   # of layouts evaluated whole (their floor fitted)
    ranked: list[Scored] = []
    pruned_memory = pruned_bound = solved = unexplored = unproven = visited = 0
    while heap:
        kth = ranked[top_k - 1].estimate.step_time_s if len(ranked) >= top_k else float("inf")
        remaining = time_limit_s - (time.perf_counter() - start)
        if _beyond(heap[0][0], kth):  # the cheapest bound left cannot beat or tie the K-th plan: nor can the rest
            pruned_bound += sum(tree.leaf_count(node) for _, _, node, _ in heap)
            break
        if remaining <= 0:
            unexplored = sum(tree.leaf_count(node) for _, _, node, _ in heap)
            break
        bound, _, node, costs = heapq.heappop(heap)
        if node.zero is None:
            for child in tree.children(node):
                layout = child.layout(problem)
                if child.zero is not None:
                    floor, parts = bounds.memory_floor(layout)
                    if floor < smallest:
                        smallest, smallest_parts = floor, parts
                    if floor > capacity:
                        pruned_memory += 1
                        continue
                child_costs = None
                if child.zero is None:
                    child_bound = node_communication_bound(child, layout)
                else:
                    child_costs = MeshCosts(model, cluster, layout, stack, ep_imbalance, shared)
                    forced = bounds.forced_recompute_s(layout, child_costs)
                    if forced == float("inf"):
                        pruned_memory += 1
                        continue
                    child_bound = balanced_bound(child_costs, layout, bounds.fastest, forced)
                if _beyond(child_bound, kth):
                    pruned_bound += tree.leaf_count(child)
                    continue
                push(child, max(bound, child_bound), child_costs)
            continue
        visited += 1
        if progress:
            progress(visited + pruned_memory + pruned_bound, candidates)
        layout = node.layout(problem)
        # a partition that ties the K-th plan at 6 significant digits is still of use (simpler layout)
        cutoff = kth * (1 + TIE_TOLERANCE) - p2p_transfers_on_critical_path(
            layout.pp, layout.vp, layout.dualpipev) * costs.p2p_s()
        methods = leaf_recompute_methods(stack, layout, allowed)
        if not methods:
            continue
        key = model_key(costs, methods, module_choices)
        result = solved_models.answer(key, cutoff)
        if result is None:
            # the leaf's work limit (not the wall clock) decides when it stops unproven, so that a complete
            # search gives the same plan on a busy machine; the wall limit only guards the whole search
            result = solve_partition(costs, methods, time_limit_s=remaining, cutoff_s=cutoff,
                                     work_limit=leaf_work_limit, module_choices=module_choices)
            solved_models.record(key, cutoff, result)
            solved += 1
            unproven += result.status not in ("OPTIMAL", "INFEASIBLE")
        if not result.stage_layers:
            if not ranked:  # what this layout needs at its least, for the error when nothing fits
                need, parts = bounds.least_need(layout, costs, methods)
                if need < least_need:
                    least_need, least_parts = need, parts
            continue
        full = replace(layout, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute,
                       recompute_modules=result.recompute_modules or layout.recompute_modules)
        if full.recompute_modules != layout.recompute_modules:   # the solver chose them: their costs
            costs = MeshCosts(model, cluster, full, stack, ep_imbalance, shared)
        scored = Scored(estimate(model, cluster, full, stack, ep_imbalance, mesh_costs=costs), result)
        if scored.estimate.fits:
            ranked.append(scored)
            ranked.sort(key=_rank_key)
            ranked = ranked[: max(top_k, 1)]
    if not ranked:  # report the least memory any candidate needs
        for _, _, node, _ in heap:
            for leaf in tree.leaves(node):
                floor, parts = bounds.memory_floor(leaf.layout(problem))
                if floor < smallest:
                    smallest, smallest_parts = floor, parts
    if least_need < float("inf"):  # a layout evaluated whole says more than any floor
        smallest, smallest_parts = least_need, least_parts
    return SearchOutcome(tuple(ranked), candidates, pruned_memory, pruned_bound, solved,
                         time.perf_counter() - start, unexplored, smallest, smallest_parts, unproven,
                         time.process_time() - cpu_start)
