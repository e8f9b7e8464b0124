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

from cost_models.compute import ShardSpec, layer_compute
from cost_models.layer_costs import MeshCosts, SharedCosts
from cost_models.layout import MEGATRON_ORDER, Layout, OverlapModel, Recompute
from cost_models.memory import StateSharding, activation_bytes, model_state_bytes, usable_bytes
from cost_models.pipeline import p2p_transfers_on_critical_path
from cost_models.records import ModelCosts
from cost_models.step_time import Estimate, estimate
from hardware_profiles.schema import Cluster

from .solver import PartitionResult, model_key, solve_partition
from .space import (MeshShape, Pins, make_layout, mesh_shapes, placement_choices, schedule_choices,
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


@dataclass(frozen=True)
class _Work:
    """Per-micro-batch work of the whole model (every block at its fastest) and the least work the
    busiest pipeline rank can have."""
    total_s: float
    busiest_rank_floor_s: float


def _work(block_work_s: tuple[tuple[int, float], ...], edge_work_s: tuple[float, float], pp: int, vp: int) -> _Work:
    """`block_work_s`: (blocks, seconds each) per block kind."""
    items = sorted([w for n, w in block_work_s for _ in range(n)] + list(edge_work_s), reverse=True)
    total = sum(items)
    if pp == 1:
        return _Work(total, total)
    # scheduling bound (P||Cmax): of the k pp + 1 largest items some rank holds k + 1, so its work is at
    # least the k + 1 smallest of them; contiguity and fixed edges only constrain further
    packing = max(sum(items[k * pp - k: k * pp + 1]) for k in range(1, (len(items) - 1) // pp + 1)) \
        if len(items) > pp else 0.0
    # the ranks with the embedding or the head hold one block per virtual stage besides it
    edge_rank = max(edge_work_s) + vp * min(w for _, w in block_work_s)
    return _Work(total, max(packing, edge_rank))


def _work_before_zero(costs: MeshCosts, fastest: Recompute) -> tuple[tuple, tuple[float, float]]:
    """Each block kind's and the embedding's and head's work before ZeRO-2/3 traffic, which every ZeRO
    stage pays at least (the same for every virtual-stage count that allows the same MoE overlap)."""
    model = costs.model
    blocks = tuple((n, costs.work(kind).work_before_zero_s(fastest)) for kind, n in model.block_counts)
    return blocks, tuple(costs.work(edge).work_before_zero_s(Recompute.none) for edge in (model.embedding, model.head))


def _communication_bound(work: _Work, p2p_s: float, layout: Layout) -> float:
    """Pipeline of compute and exposed per-layer communication as balanced as integers allow."""
    return (_pipeline_bound(work.total_s, layout, work.busiest_rank_floor_s)
            + p2p_transfers_on_critical_path(layout.pp, layout.vp) * p2p_s)


def _balanced_bound(costs: MeshCosts, layout: Layout, fastest: Recompute = Recompute.none) -> float:
    """Step time of a perfectly balanced pipeline at the fastest recomputation allowed."""
    model = costs.model
    edges = (costs.layer(model.embedding), costs.layer(model.head))
    # the slowest stage's DP exposure and optimizer step are at least the stages' mean (max >= mean)
    def mean(attribute: str) -> float:
        return (sum(n * getattr(costs.layer(kind), attribute) for kind, n in model.block_counts)
                + sum(getattr(c, attribute) for c in edges)) / layout.pp
    # dp_exposed_s is convex (a max of affine terms), so its value at the mean is below its mean (Jensen)
    dp = costs.dp_exposed_s(mean("dp_reduce_s"), mean("forward_s") + mean("backward_s"))
    optimizer = mean("optimizer_step_s")
    work = _work(tuple((n, costs.layer(kind).work_s(fastest)) for kind, n in model.block_counts),
                 tuple(c.work_s(Recompute.none) for c in edges), layout.pp, layout.vp)
    return _communication_bound(work, costs.p2p_s(), layout) + dp + optimizer


def _pipeline_bound(total_work_s: float, layout: Layout, busiest_floor_s: float = 0.0) -> float:
    """pipeline_seconds with max W_i at its least possible value: the mean, or the floor if higher."""
    p, v, m = layout.pp, layout.vp, layout.num_micro_batches
    slowest = max(total_work_s / p, busiest_floor_s)
    return (m - 1) * slowest + (total_work_s + (v - 1) * slowest) / v


class _Bounds:
    """Cheap bounds shared across candidates: compute-only work and the memory floor."""

    def __init__(self, model: ModelCosts, cluster: Cluster, overlap: OverlapModel, allowed: tuple[Recompute, ...]):
        self.model, self.cluster, self.overlap = model, cluster, overlap
        rank = {Recompute.none: 0, Recompute.selective: 1, Recompute.full: 2}
        self.cheapest = max(allowed, key=rank.get)   # least activation memory
        self.fastest = min(allowed, key=rank.get)    # least work
        self.work: dict[tuple, float] = {}
        self.activations: dict[tuple, float] = {}
        self.largest_ep = max([k.num_experts or 1 for k in model.kinds])

    def compute_work_s(self, layout: Layout) -> float:
        """Compute-only work, valid for every ep and etp: GEMM efficiency only grows with size and weight
        reads only shrink with ep x etp, so every expert on its own rank, split tp ways, bounds it from below."""
        spec = ShardSpec.of(layout, self.overlap, ep=self.largest_ep, etp=layout.tp)
        if spec not in self.work:
            model = self.model
            counted = list(model.block_counts) + [(model.embedding, 1), (model.head, 1)]
            self.work[spec] = sum(n * (compute.forward_s + compute.backward_s) for kind, n in counted
                                  for compute in [layer_compute(kind, self.cluster.device, spec)])
        return self.work[spec]

    def memory_floor(self, layout: Layout) -> tuple[float, dict]:
        """Least memory any partition needs on its fullest stage: states split evenly, cheapest activations."""
        sharding = StateSharding(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp_cp=layout.dp * layout.cp,
                                 expert_dp=layout.expert_data_parallel, zero=layout.zero,
                                 gradient_bytes=layout.gradient_bytes)
        states = sum(n * model_state_bytes(kind, sharding).total for kind, n in self.model.block_counts)
        key = (layout.tp, layout.sp, layout.cp, layout.micro_batch, layout.precision)
        if key not in self.activations:
            self.activations[key] = sum(n * activation_bytes(kind, self.cheapest, *key)
                                        for kind, n in self.model.block_counts)
        flight = min(layout.pp, layout.num_micro_batches)
        parts = {"model_states": states / layout.pp, "activations": flight * self.activations[key] / layout.pp}
        return sum(parts.values()), parts

    def least_need(self, layout: Layout, costs: MeshCosts) -> tuple[float, dict]:
        """Peak memory of the layout with every block at its least-memory recomputation, evenly staged:
        a need some real plan has, where the floor only bounds it from below."""
        least = replace(layout, recompute=self.cheapest, layer_recompute=None, stage_layers=None)
        fullest = max(estimate(self.model, self.cluster, least, self.overlap, mesh_costs=costs).stage_memory,
                      key=lambda stage: stage.total)
        return fullest.total, fullest.parts()


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
            -lay.micro_batch, lay.short())


@dataclass(frozen=True)
class _Node:
    """A subtree of the space: a mesh shape and schedule, then expert folding and order, then ZeRO."""
    shape: MeshShape
    vp: int
    mbs: int
    placement: tuple | None = None      # (etp, ep, mesh order) from the second level on
    zero: int | None = None             # set on leaves

    def layout(self, problem: "_Problem") -> Layout:
        etp, ep, order = self.placement or (1, 1, MEGATRON_ORDER)
        return make_layout(self.shape, problem.global_batch, problem.pins, problem.precision, vp=self.vp,
                           mbs=self.mbs, etp=etp, ep=ep, order=order, zero=self.zero or 0)

    def tie_key(self) -> tuple:
        etp, ep, order = self.placement or (0, 0, ())
        s = self.shape
        return (s.tp, s.pp, s.dp, s.cp, ep, etp, self.vp, self.mbs, -1 if self.zero is None else self.zero, order)


@dataclass(frozen=True)
class _Problem:
    """What the tree needs to enumerate and build layouts."""
    cluster: Cluster
    global_batch: int
    pins: Pins
    precision: str
    graph: object
    zeros: tuple[int, ...]


class _Tree:
    """Children and leaf counts of the search tree's nodes."""

    def __init__(self, problem: _Problem):
        self.problem = problem
        self.fast = problem.cluster.fast_domain_devices
        self._placements: dict[MeshShape, list] = {}

    def roots(self) -> list[_Node]:
        p = self.problem
        return [_Node(shape, vp, mbs)
                for shape in mesh_shapes(p.graph, p.cluster.num_devices, p.global_batch, p.pins, self.fast)
                for vp, mbs in schedule_choices(p.graph, shape, p.global_batch, p.pins)]

    def placements(self, shape: MeshShape) -> list:
        if shape not in self._placements:
            self._placements[shape] = placement_choices(self.problem.graph, shape, self.problem.pins, self.fast)
        return self._placements[shape]

    def children(self, node: _Node) -> list[_Node]:
        if node.placement is None:
            return [replace(node, placement=placement) for placement in self.placements(node.shape)]
        return [replace(node, zero=zero) for zero in self.problem.zeros]

    def leaf_count(self, node: _Node) -> int:
        if node.zero is not None:
            return 1
        per_placement = len(self.problem.zeros)
        return per_placement if node.placement is not None else per_placement * len(self.placements(node.shape))

    def leaves(self, node: _Node):
        if node.zero is not None:
            yield node
            return
        for child in self.children(node):
            yield from self.leaves(child)


def search(model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins = Pins(),
           precision: str = "bf16", time_limit_s: float = 60.0, top_k: int = 3,
           overlap: OverlapModel = OverlapModel(), ep_imbalance: float = 1.0, graph=None,
           progress=None, recompute_choices: tuple[Recompute, ...] | None = None) -> SearchOutcome:
    start = time.perf_counter()
    allowed = recompute_choices or ((pins.recompute,) if pins.recompute else tuple(Recompute))
    problem = _Problem(cluster, global_batch, pins, precision, graph, zero_choices(pins))
    tree = _Tree(problem)
    capacity = usable_bytes(cluster.device)
    bounds = _Bounds(model, cluster, overlap, allowed)
    shared = SharedCosts()
    heap: list = []
    solved_models = _SolvedModels()
    placement_work: dict[tuple, tuple[tuple, tuple, float]] = {}   # (shape, mbs, placement): any vp

    def communication_bound(node: _Node, layout: Layout) -> float:
        key = (node.shape, node.mbs, node.placement, overlap.hides_moe_a2a(layout))
        if key not in placement_work:  # the last entry: whether MoE all-to-alls overlap (vp-dependent)
            costs = MeshCosts(model, cluster, layout, overlap, ep_imbalance, shared)
            placement_work[key] = (*_work_before_zero(costs, bounds.fastest), costs.p2p_s())
        blocks, edges, p2p = placement_work[key]
        return _communication_bound(_work(blocks, edges, layout.pp, layout.vp), p2p, layout)

    def push(node: _Node, bound: float, costs: MeshCosts | None = None) -> None:
        heapq.heappush(heap, (bound, node.tie_key(), node, costs))

    for root in tree.roots():
        layout = root.layout(problem)
        push(root, _pipeline_bound(bounds.compute_work_s(layout), layout))
    candidates = sum(tree.leaf_count(node) for _, _, node, _ in heap)
    smallest, smallest_parts = float("inf"), {}
    least_need, least_parts = float("inf"), {}   # of layouts evaluated whole (their floor fitted)
    ranked: list[Scored] = []
    pruned_memory = pruned_bound = solved = unexplored = visited = 0
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
                    child_bound = communication_bound(child, layout)
                else:
                    child_costs = MeshCosts(model, cluster, layout, overlap, ep_imbalance, shared)
                    child_bound = _balanced_bound(child_costs, layout, bounds.fastest)
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
        cutoff = kth * (1 + TIE_TOLERANCE) - p2p_transfers_on_critical_path(layout.pp, layout.vp) * costs.p2p_s()
        key = model_key(costs, allowed)
        result = solved_models.answer(key, cutoff)
        if result is None:
            # one hard candidate may not eat the budget: it gets a share, and reports its gap if cut short
            result = solve_partition(costs, allowed, time_limit_s=min(remaining, max(1.0, time_limit_s / 30)),
                                     cutoff_s=cutoff)
            solved_models.record(key, cutoff, result)
            solved += 1
        if not result.stage_layers:
            if not ranked:  # what this layout needs at its least, for the error when nothing fits
                need, parts = bounds.least_need(layout, costs)
                if need < least_need:
                    least_need, least_parts = need, parts
            continue
        full = replace(layout, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute)
        scored = Scored(estimate(model, cluster, full, overlap, ep_imbalance, mesh_costs=costs), result)
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
                         time.perf_counter() - start, unexplored, smallest, smallest_parts)
