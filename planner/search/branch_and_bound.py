"""The best-first branch and bound over the tree of `tree.py`, its steps as methods: push the roots, take
the node of least bound, expand it (bounding each child, pruning by memory and by the K-th plan) or solve
it as a leaf with CP-SAT, and stop when the least bound left cannot beat or tie the K-th plan (complete)
or the time limit leaves nodes unexplored (time-limited).

The time limit is a deadline. Best first finds its first plan late where most layouts do not fit (a 1T MoE
on 8,192 devices expands thousands of nodes first), so a search that has no plan when `DIVE_SHARE` of its
time is left dives instead: from the open node of least bound down the child of least bound that fits to a
leaf, solved in the time left. Its plan is the best found, said time-limited, never called the optimum.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from cost_models.layer_costs import MeshCosts, SharedCosts
from cost_models.layout import Layout, Recompute, RecomputeModule
from cost_models.memory import usable_bytes
from cost_models.pipeline import p2p_transfers_on_critical_path
from cost_models.records import ModelCosts
from cost_models.step_time import estimate
from hardware_profiles.loader import load_stack
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from ..rules.pins import Pins
from ..rules.stack import leaf_recompute_methods
from .bounds import Bounds, balanced_bound
from .node_bounds import NodeBounds
from .offload_leaf import OffloadRoute, offload_estimate, route_extra_floor_s
from .partition import LEAF_WORK_LIMIT, PartitionResult, model_key, solve_partition
from .space import zero_choices
from .tree import (TIE_TOLERANCE, Scored, SearchOutcome, SolvedModels, TreeNode, TreeProblem, TreeShape, beyond,
                   rank_key, six_digits)


DIVE_SHARE = 0.3          # of the time limit, kept for a dive where best first has found no plan yet
DIVE_LEAST_S = 0.5        # ... and at least this long (a leaf's CP-SAT model takes tenths of a second)
PROGRESS_EVERY_S = 0.25   # between progress reports
ZERO_FLOORED = "zero-floored"   # a placed node's heap mark: its bound already holds its ZeRO stages' floor
GROUP_FLOORED = "group-floored"   # a group's heap mark: bounded by `group_floor_s`, its children not yet weighed


@dataclass(frozen=True)
class Progress:
    """What the search has done so far: every candidate is settled (pruned by memory or bound, or solved) or
    still open below a node on the heap."""
    candidates: int
    pruned_memory: int
    pruned_bound: int
    solved: int
    elapsed_s: float

    @property
    def settled(self) -> int:
        return self.pruned_memory + self.pruned_bound + self.solved

    @property
    def open(self) -> int:
        return self.candidates - self.settled


@dataclass
class _Counts:
    """What the search did with the candidates (a leaf is a candidate)."""
    pruned_memory: int = 0
    pruned_bound: int = 0
    solved: int = 0
    unexplored: int = 0
    unproven: int = 0
    visited: int = 0


@dataclass
class _LeastNeed:
    """The least memory a candidate needs, with its parts (for the error when nothing fits)."""
    bytes: float = float("inf")
    parts: dict | None = None

    def offer(self, need: float, parts: dict) -> None:
        if need < self.bytes:
            self.bytes, self.parts = need, parts


class SearchCaches:
    """What searches of one job on one placement of its devices share: layer costs by shard, collective times
    and the proven answers of leaf models (the search for the best plan inside the measured region re-reads
    most of the plan's own)."""

    def __init__(self):
        self.shared = SharedCosts()
        self.solved_models = SolvedModels()


class BranchAndBound:
    """One search: the tree, its bounds, the heap of open nodes and the K best plans so far."""

    def __init__(self, model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins, precision: str,
                 time_limit_s: float, top_k: int, stack: SoftwareStack, ep_imbalance: float, graph, progress,
                 recompute_choices: tuple[Recompute, ...], leaf_work_limit: float,
                 module_choices: tuple[RecomputeModule, ...], caches: SearchCaches | None = None):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.model, self.cluster, self.stack, self.ep_imbalance = model, cluster, stack, ep_imbalance
        self.deadline = self.start + time_limit_s
        self.dive_reserve_s = max(DIVE_SHARE * time_limit_s, min(DIVE_LEAST_S, time_limit_s))
        self.top_k, self.progress, self.last_report = top_k, progress, 0.0
        self.leaf_work_limit, self.module_choices = leaf_work_limit, module_choices
        self.allowed = recompute_choices
        self.problem = TreeProblem(cluster, global_batch, pins, precision, graph, zero_choices(pins), stack)
        self.tree = TreeShape(self.problem)
        self.capacity = usable_bytes(cluster.device)
        self.bounds = Bounds(model, cluster, stack, self.allowed, module_choices)
        self.offload = OffloadRoute.of(stack, cluster, pins, self.allowed)
        caches = caches or SearchCaches()
        self.shared, self.solved_models = caches.shared, caches.solved_models
        self.heap: list = []
        self.ranked: list[Scored] = []
        self.counts = _Counts()
        self.floor_need = _LeastNeed()      # the least memory floor of any candidate
        self.whole_need = _LeastNeed()      # of layouts evaluated whole (their floor fitted)
        self.nodes = NodeBounds(model, cluster, stack, ep_imbalance, self.shared, self.problem, self.tree, self.bounds)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> SearchOutcome:
        self.push_roots()
        self.candidates = self.open_leaves()
        while self.heap and not self.finished():
            bound, _, node, costs = heapq.heappop(self.heap)
            if costs is GROUP_FLOORED:   # reached: its children weighed, back in line at the least of them
                exact = self.nodes.group_bound(node)
                if six_digits(exact) > six_digits(bound):
                    self.push(node, exact)
                    continue
            if node.zero is None and node.placement is not None and not node.is_group and costs is not ZERO_FLOORED:
                floor = self.nodes.zero_floor_s(node)
                if six_digits(floor) > six_digits(bound):   # back in line at its ZeRO stages' floor
                    self.push(node, floor, ZERO_FLOORED)
                    continue
            if node.zero is None:
                self.expand(node, bound)
            else:
                self.solve_leaf(node, costs)
            self.report()
        if self.counts.unexplored and not self.ranked:
            self.dive()
        return self.outcome()

    def kth_s(self) -> float:
        return self.ranked[self.top_k - 1].estimate.step_time_s if len(self.ranked) >= self.top_k else float("inf")

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def finished(self) -> bool:
        """The cheapest bound left cannot beat or tie the K-th plan, so nor can the rest (complete); or the
        time is up (the nodes left are counted unexplored), or so nearly up that only a dive can still find
        a first plan."""
        if beyond(self.heap[0][0], self.kth_s()):
            self.counts.pruned_bound += self.open_leaves()
            return True
        if self.left_s() <= (0.0 if self.ranked else self.dive_reserve_s):
            self.counts.unexplored = self.open_leaves()
            return True
        return False

    def report(self, force: bool = False) -> None:
        """Progress, at most every PROGRESS_EVERY_S: what is settled and what is open."""
        now = time.perf_counter()
        if self.progress and (force or now - self.last_report >= PROGRESS_EVERY_S):
            c = self.counts
            self.progress(Progress(self.candidates, c.pruned_memory, c.pruned_bound, c.visited, now - self.start))
            self.last_report = now

    def open_leaves(self) -> int:
        return sum(self.tree.leaf_count(node) for _, _, node, _ in self.heap)

    def push(self, node: TreeNode, bound: float, costs: MeshCosts | None = None) -> None:
        heapq.heappush(self.heap, (bound, node.tie_key(), node, costs))

    def push_roots(self) -> None:
        """Each mesh shape with a schedule, bounded by its compute and the communication that every expert
        folding and mesh order of it pays at least: per layer, and the pipeline's hops."""
        for root in self.tree.roots():
            self.push(root, self.nodes.root_bound(root))

    # -- expanding a node ------------------------------------------------------------------------------
    def expand(self, node: TreeNode, bound: float) -> None:
        """Push the node's children that fit and may beat the K-th plan, each at least its parent's bound."""
        for child, child_bound, child_costs in self.bounded_children(node):
            self.push(child, max(bound, child_bound), child_costs)

    def bounded_children(self, node: TreeNode) -> list[tuple[TreeNode, float, MeshCosts | None]]:
        """The node's children with their bounds, those that cannot fit or beat the K-th plan counted out."""
        kth, kept = self.kth_s(), []
        for child in self.tree.children(node):
            if child.is_group:
                child_bound, child_costs = self.nodes.group_floor_s(child), GROUP_FLOORED
            elif child.zero is None:
                child_bound, child_costs = self.nodes.communication_bound(child), None
            else:
                child_bound, child_costs = self.leaf_bound(child.layout(self.problem))
                if child_bound is None:
                    self.counts.pruned_memory += 1
                    continue
            if beyond(child_bound, kth):
                self.counts.pruned_bound += self.tree.leaf_count(child)
                continue
            kept.append((child, child_bound, child_costs))
        return kept

    def dive(self) -> None:
        """A first plan in the time left: from the open nodes in bound order, down the child of least bound
        that fits, to a leaf solved in the time left; another open node where a dive ends in nothing."""
        while self.heap and not self.ranked and self.left_s() > 0:
            bound, _, node, costs = heapq.heappop(self.heap)
            while node.zero is None and self.left_s() > 0:
                children = sorted(self.bounded_children(node), key=lambda item: (item[1], item[0].tie_key()))
                if not children:
                    break
                for child, child_bound, child_costs in children[1:]:   # the others stay open (and unexplored)
                    self.push(child, max(bound, child_bound), child_costs)
                node, bound, costs = children[0]
            if node.zero is not None and self.left_s() > 0:
                self.solve_leaf(node, costs)
            self.report()
        self.counts.unexplored = self.open_leaves()

    def leaf_bound(self, layout: Layout) -> tuple[float | None, MeshCosts | None]:
        """A leaf's balanced-pipeline bound with the recomputation its memory forces; None where its memory
        floor exceeds the device or no allowed recomputation brings it down."""
        floor, parts = self.bounds.memory_floor(layout)
        if self.offload.applies(layout, self.stack):   # the other way to fit: offloading activations
            offload_floor, offload_parts = self.bounds.offload_floor(layout, self.offload.pinned)
            least = offload_floor < floor or self.offload.only(layout, self.stack)
            self.floor_need.offer(*((offload_floor, offload_parts) if least else (floor, parts)))
            offloads = offload_floor <= self.capacity
        else:
            self.floor_need.offer(floor, parts)
            offloads = False
        if floor > self.capacity and not offloads:
            return None, None
        costs = MeshCosts(self.model, self.cluster, layout, self.stack, self.ep_imbalance, self.shared)
        # the least of the two routes to fitting: recomputation (unless offloading is pinned) and offloading
        recomputing = float("inf") if self.offload.only(layout, self.stack) or floor > self.capacity else \
            self.bounds.forced_recompute_s(layout, costs)
        bound = float("inf") if recomputing == float("inf") else \
            balanced_bound(costs, layout, self.bounds.fastest, recomputing)
        if offloads:
            extra = route_extra_floor_s(self.bounds, layout, costs, self.capacity, self.offload.pinned)
            bound = min(bound, balanced_bound(costs, layout, Recompute.none) + extra)
        return (None, None) if bound == float("inf") else (bound, costs)

    # -- solving a leaf --------------------------------------------------------------------------------
    def solve_leaf(self, node: TreeNode, costs: MeshCosts) -> None:
        """The leaf's best split and recomputation below the K-th plan (CP-SAT, or a proven answer of the same
        model), ranked where it fits."""
        self.counts.visited += 1
        layout = node.layout(self.problem)
        # a partition that ties the K-th plan at 6 significant digits is still of use (simpler layout)
        cutoff = self.kth_s() * (1 + TIE_TOLERANCE) - p2p_transfers_on_critical_path(
            layout.pp, layout.vp, layout.dualpipev) * costs.p2p_s()
        offloaded = None
        if self.offload.applies(layout, self.stack):
            offloaded = offload_estimate(self.model, self.cluster, layout, self.stack, self.ep_imbalance, costs,
                                         self.offload.pinned)
        recomputes = not self.offload.only(layout, self.stack) and (
            offloaded is None or self.bounds.memory_floor(layout)[0] <= self.capacity)
        scored = self.recomputed(layout, costs, cutoff) if recomputes else None
        if offloaded is not None and (scored is None or offloaded.step_time_s < scored.estimate.step_time_s):
            blocks = len(self.model.blocks)
            scored = Scored(offloaded, PartitionResult((blocks,), offloaded.layer_recompute, offloaded.step_time_s,
                                                       "OPTIMAL", 0.0, 0.0))
        if scored is not None and scored.estimate.fits:
            self.ranked = sorted(self.ranked + [scored], key=rank_key)[: max(self.top_k, 1)]

    def recomputed(self, layout: Layout, costs: MeshCosts, cutoff: float) -> Scored | None:
        """The leaf's best split and recomputation below `cutoff` (the partition solver's), or None."""
        methods = leaf_recompute_methods(self.stack, layout, self.allowed)
        if not methods:
            return None
        result = self.partition(costs, methods, cutoff)
        if not result.stage_layers:
            if not self.ranked:  # what this layout needs at its least, for the error when nothing fits
                self.whole_need.offer(*self.bounds.least_need(layout, costs, methods))
            return None
        full = replace(layout, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute,
                       recompute_modules=result.recompute_modules or layout.recompute_modules)
        if full.recompute_modules != layout.recompute_modules:   # the solver chose them: their costs
            costs = MeshCosts(self.model, self.cluster, full, self.stack, self.ep_imbalance, self.shared)
        return Scored(estimate(self.model, self.cluster, full, self.stack, self.ep_imbalance, mesh_costs=costs),
                      result)

    def partition(self, costs: MeshCosts, methods: tuple[Recompute, ...], cutoff: float):
        key = model_key(costs, methods, self.module_choices)
        result = self.solved_models.answer(key, cutoff)
        if result is None:
            # the leaf's work limit (not the wall clock) decides when it stops unproven, so that a complete
            # search gives the same plan on a busy machine; the wall limit only guards the whole search
            result = solve_partition(costs, methods, time_limit_s=max(self.left_s(), 0.0), cutoff_s=cutoff,
                                     work_limit=self.leaf_work_limit, module_choices=self.module_choices)
            self.solved_models.record(key, cutoff, result)
            self.counts.solved += 1
            self.counts.unproven += result.status not in ("OPTIMAL", "INFEASIBLE")
        return result

    # -- the answer ------------------------------------------------------------------------------------
    def outcome(self) -> SearchOutcome:
        if not self.ranked and not self.counts.unexplored:  # nothing fits: the least memory any candidate needs
            for _, _, node, _ in self.heap:
                for leaf in self.tree.leaves(node):
                    self.floor_need.offer(*self.bounds.memory_floor(leaf.layout(self.problem)))
        self.report(force=True)
        need = self.whole_need if self.whole_need.parts is not None else self.floor_need
        c = self.counts
        return SearchOutcome(tuple(self.ranked), self.candidates, c.pruned_memory, c.pruned_bound, c.solved,
                             time.perf_counter() - self.start, c.unexplored, need.bytes, need.parts or {},
                             c.unproven, time.process_time() - self.cpu_start)


def search(model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins = Pins(),
           precision: str = "bf16", time_limit_s: float = 60.0, top_k: int = 3, *,
           stack: SoftwareStack | None = None, ep_imbalance: float = 1.0, graph=None,
           progress=None, recompute_choices: tuple[Recompute, ...] | None = None,
           leaf_work_limit: float = LEAF_WORK_LIMIT,
           module_choices: tuple[RecomputeModule, ...] = (), caches: SearchCaches | None = None) -> SearchOutcome:
    """The K fastest layouts that fit, with what the search did. `module_choices`: the modules selective
    recomputation may repeat, chosen with each leaf's partition (empty: the pinned layout's, Megatron-Core's
    core_attn by default)."""
    allowed = recompute_choices or ((pins.recompute,) if pins.recompute else tuple(Recompute))
    return BranchAndBound(model, cluster, global_batch, pins, precision, time_limit_s, top_k,
                          stack or load_stack(),   # Megatron-Core's defaults (the API always names its stack)
                          ep_imbalance, graph, progress, allowed, leaf_work_limit, module_choices, caches).run()
