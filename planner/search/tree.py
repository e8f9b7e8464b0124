"""The search tree over meshes, micro-batches, ZeRO stages and virtual stages, and how its plans rank
(`branch_and_bound.py` walks it best bound first, CP-SAT inside).

The space is a tree: a mesh shape with a schedule (tp, cp, pp, dp, vp, micro-batch) is bounded by its
compute alone; its children add the expert folding and mesh order, bounded by compute plus exposed
per-layer communication; their children add the ZeRO stage, bounded by a balanced pipeline with its
data-parallel and optimizer time, and pruned when their memory floor (model states of a perfectly split
model plus the cheapest activations) exceeds the device. Nodes are expanded cheapest bound first; a
node whose bound cannot beat the K-th best plan so far ends the search, since every node left is at
least as slow. Leaves go to the partition solver.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.layout import MEGATRON_ORDER, Layout, MoeDispatcher, passes_pair_across_micro_batches
from cost_models.layout_codec import text_of
from cost_models.step_time import Estimate
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from ..rules.pins import Pins
from ..rules.stack import a2a_overlap_left_off, a2a_overlap_refusal
from .partition import PartitionResult
from .space import MeshShape, make_layout, mesh_shapes, placement_choices, schedule_choices, with_tp_overlap


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


class SolvedModels:
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


def beyond(bound_s: float, kth_s: float) -> bool:
    """A subtree whose bound is above the K-th plan even at the ranking's 6 significant digits can
    neither beat it nor tie it (ties go to the simpler layout, so they must be seen)."""
    return six_digits(bound_s) > six_digits(kth_s)


def rank_key(scored: Scored) -> tuple:
    """Fastest first; among equal times (6 significant digits) the simpler layout: fewer context, pipeline
    and tensor ranks, lower ZeRO stage, larger micro-batch."""
    lay = scored.estimate.layout
    return (six_digits(scored.estimate.step_time_s), lay.cp, lay.pp * lay.vp, lay.tp, lay.ep, lay.etp, lay.zero,
            lay.moe_a2a_overlap, lay.moe_dispatcher != MoeDispatcher.alltoall, -lay.micro_batch,
            text_of(lay, per_block=False))


@dataclass(frozen=True)
class TreeNode:
    """A subtree of the space: a mesh shape and schedule, then expert folding and order, then ZeRO."""
    shape: MeshShape
    vp: int
    micro_batch: int
    dualpipev: bool = False             # the DualPipeV schedule (vp = 2 as a V)
    placement: tuple | None = None      # (etp, ep, mesh order) from the second level on
    moe_a2a_overlap: bool = False           # combined 1F1B, chosen with the placement where the stack pairs it
    zero: int | None = None             # set on leaves
    # chosen with the placement where experts spread; None on a placement whose dispatcher and combined 1F1B
    # are still open (`is_group`)
    moe_dispatcher: MoeDispatcher | None = MoeDispatcher.alltoall

    @property
    def is_group(self) -> bool:
        """A placement with several (dispatcher, combined 1F1B) children, bounded by the least of them."""
        return self.placement is not None and self.moe_dispatcher is None

    def layout(self, problem: "TreeProblem") -> Layout:
        etp, ep, order = self.placement or (1, 1, MEGATRON_ORDER)
        # TP overlap as the stack would run it where tp > 1, then as its rule chooses (`with_tp_overlap`)
        pinned = problem.pins.tp_overlap
        likely = (problem.stack.tp_comm_overlap if pinned is None else pinned) and self.shape.tp > 1
        made = make_layout(self.shape, problem.global_batch, problem.pins, problem.precision, vp=self.vp,
                           micro_batch=self.micro_batch, etp=etp, ep=ep, order=order, zero=self.zero or 0,
                           moe_a2a_overlap=self.moe_a2a_overlap, dualpipev=self.dualpipev,
                           moe_dispatcher=self.moe_dispatcher, tp_comm_overlap=likely)
        return with_tp_overlap(made, problem.stack, problem.cluster.device, pinned)

    def tie_key(self) -> tuple:
        etp, ep, order = self.placement or (0, 0, ())
        s = self.shape
        return (s.tp, s.pp, s.dp, s.cp, ep, etp, self.vp, self.dualpipev, self.micro_batch, self.moe_a2a_overlap,
                -1 if self.zero is None else self.zero, order, self.moe_dispatcher or "")


@dataclass(frozen=True)
class TreeProblem:
    """What the tree needs to enumerate and build layouts."""
    cluster: Cluster
    global_batch: int
    pins: Pins
    precision: str
    graph: object
    zeros: tuple[int, ...]
    stack: SoftwareStack


class TreeShape:
    """Children and leaf counts of the search tree's nodes."""

    def __init__(self, problem: TreeProblem):
        self.problem = problem
        self.fast = problem.cluster.fast_domain_devices
        self._placements: dict[MeshShape, list] = {}
        self._virtual_stages: dict[MeshShape, set[tuple[int, bool]]] = {}
        self._zeros: dict[tuple[int, int, int], tuple[int, ...]] = {}   # (dp x cp, tp, ep) -> ZeRO stages
        self._dispatchers: dict[int, tuple[MoeDispatcher, ...]] = {}    # ep -> dispatchers
        self._overlaps: dict[tuple, tuple[bool, ...]] = {}   # (pp, vp, DualPipeV, ep, dispatcher, tp) -> switches
        self._leaf_counts: dict[tuple, int] = {}    # (shape, vp, DualPipeV, placement) of a root or group -> leaves

    def roots(self) -> list[TreeNode]:
        p = self.problem
        return [TreeNode(shape, choice.vp, choice.micro_batch, choice.dualpipev)
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

    def children(self, node: TreeNode) -> list[TreeNode]:
        """A root's placements (a group where several dispatchers or combined 1F1B switches are open: the search
        bounds them together before it weighs each), a group's choices, a placed node's ZeRO stages."""
        # built directly, not by dataclasses.replace: a large search makes hundreds of thousands
        if node.placement is None:
            kids = []
            for placement in self.placements(node.shape):
                choices = self.choices(node, placement)
                if not choices:   # (no dispatcher the stack runs on the device kept)
                    continue
                dispatcher, overlap = choices[0] if len(choices) == 1 else (None, False)
                kids.append(TreeNode(node.shape, node.vp, node.micro_batch, node.dualpipev, placement, overlap, None,
                                     dispatcher))
            return kids
        if node.moe_dispatcher is None:
            return [TreeNode(node.shape, node.vp, node.micro_batch, node.dualpipev, node.placement, overlap, None,
                             dispatcher) for dispatcher, overlap in self.choices(node, node.placement)]
        return [TreeNode(node.shape, node.vp, node.micro_batch, node.dualpipev, node.placement, node.moe_a2a_overlap,
                         zero, node.moe_dispatcher) for zero in self.zeros(node)]

    def choices(self, node: TreeNode, placement: tuple) -> list[tuple[MoeDispatcher, bool]]:
        """The (dispatcher, combined 1F1B) pairs a placement of the node's shape and schedule weighs."""
        return [(dispatcher, overlap) for dispatcher in self.dispatchers(placement[1])
                for overlap in self.overlaps(node, placement, dispatcher)]

    def dispatchers(self, ep: int) -> tuple[MoeDispatcher, ...]:
        """The MoE dispatchers of a placement: as pinned; with experts spread, each the stack runs on the device
        (they move different bytes over different links: the search weighs them); else the stack's default."""
        if ep not in self._dispatchers:
            p = self.problem
            if ep == 1:
                self._dispatchers[ep] = (p.pins.dispatcher or MoeDispatcher(p.stack.moe_dispatcher),)
            else:
                runs = (p.pins.dispatcher,) if p.pins.dispatcher is not None else \
                    p.stack.dispatchers_on(p.cluster.device)
                kept = p.pins.measured_dispatchers   # a search kept to the measured region
                self._dispatchers[ep] = tuple(MoeDispatcher(d) for d in runs if not kept or d in kept)
        return self._dispatchers[ep]

    def overlaps(self, node: TreeNode, placement: tuple, dispatcher: MoeDispatcher) -> tuple[bool, ...]:
        """Combined 1F1B off and on where the stack can pair this layout's MoE passes (it hides all-to-alls and
        holds one more forward's activations: the search weighs both), else off; or as pinned."""
        key = (node.shape.pp, node.vp, node.dualpipev, placement[1], dispatcher, node.shape.tp)
        if key not in self._overlaps:
            p = self.problem
            pairs = passes_pair_across_micro_batches(node.shape.pp, node.vp, node.dualpipev)
            # TP overlap pinned on where combined 1F1B rules it out: combined 1F1B stays off
            tp_kept = p.pins.tp_overlap and p.stack.tp_overlap_blocked_by_a2a(node.shape.tp, p.cluster.device)
            if tp_kept and p.pins.a2a_overlap:   # both pinned on: not at this tp
                self._overlaps[key] = ()
            elif not p.stack.pairs_moe_passes(placement[1], pairs, dispatcher) or tp_kept \
                    or a2a_overlap_refusal(node.shape.pp, p.graph) \
                    or (p.pins.a2a_overlap is None and a2a_overlap_left_off(p.stack, p.cluster.device)):
                self._overlaps[key] = (False,)
            else:
                self._overlaps[key] = (p.pins.a2a_overlap,) if p.pins.a2a_overlap is not None else (False, True)
        return self._overlaps[key]

    def zeros(self, node: TreeNode) -> tuple[int, ...]:
        """The ZeRO stages of a placed node's leaves: those the stack runs for its degrees."""
        return self._zeros_for(node.shape.dp * node.shape.cp, node.shape.tp, node.placement[1], node.dualpipev)

    def _zeros_for(self, dp: int, tp: int, ep: int, dualpipev: bool) -> tuple[int, ...]:
        key = (dp, tp, ep, dualpipev)
        if key not in self._zeros:
            runs = self.problem.stack.zero_stages_for(dp, tp, ep, dualpipev)
            most = self.problem.pins.zero3_ranks_max   # inside the measured region: ZeRO-3 over few enough ranks
            self._zeros[key] = tuple(zero for zero in self.problem.zeros
                                     if zero in runs and (zero < 3 or most is None or dp <= most))
        return self._zeros[key]

    def leaf_count(self, node: TreeNode) -> int:
        if node.zero is not None:
            return 1
        if node.placement is not None and not node.is_group:
            return len(self.zeros(node))
        key = (node.shape, node.vp, node.dualpipev, node.placement)   # (a search counts its open leaves often)
        if key not in self._leaf_counts:
            s = node.shape
            placements = (node.placement,) if node.is_group else self.placements(s)
            self._leaf_counts[key] = sum(
                len(self._zeros_for(s.dp * s.cp, s.tp, placement[1], node.dualpipev))
                * sum(len(self.overlaps(node, placement, d)) for d in self.dispatchers(placement[1]))
                for placement in placements)
        return self._leaf_counts[key]

    def leaves(self, node: TreeNode):
        if node.zero is not None:
            yield node
            return
        for child in self.children(node):
            yield from self.leaves(child)
