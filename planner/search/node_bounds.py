"""The bounds of the search tree's inner nodes (`tree.py`), with what they share: a root's (a mesh shape and
schedule: its compute and the least communication of any of its mesh orders), a group's (a placement whose MoE
dispatcher and combined 1F1B are still open: first its work but the all-to-alls, then that plus the least
all-to-alls of its children), a placed node's (its per-layer work, exposed communication and pipeline hops, as
balanced as integers allow) and the least its ZeRO stages add. Each is at or below every plan beneath the node;
`branch_and_bound.py` walks the tree by them.

A large MoE search bounds tens of thousands of placements, so what their layouts share is computed once: the work
by placement (across vp where nothing pairs the passes), the pipeline hops by mesh order, whether an overlap
hides the all-to-alls, and the ZeRO stages' extras.
"""
from __future__ import annotations

from cost_models.layer_costs import MeshCosts, SharedCosts
from cost_models.layout import Layout, MoeDispatcher
from cost_models.pipeline import p2p_transfers_on_critical_path
from cost_models.records import ModelCosts
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from .bounds import (Bounds, PairedWork, PipelineShape, SortedWork, ZeroExtras, communication_bound, pipeline_bound,
                     work_before_zero)
from .tree import TreeNode, TreeProblem, TreeShape


class NodeBounds:
    """The bounds of one search's roots, groups and placed nodes, and the caches they share."""

    def __init__(self, model: ModelCosts, cluster: Cluster, stack: SoftwareStack, ep_imbalance: float,
                 shared: SharedCosts, problem: TreeProblem, tree: TreeShape, bounds: Bounds):
        self.model, self.cluster, self.stack, self.ep_imbalance = model, cluster, stack, ep_imbalance
        self.shared, self.problem, self.tree, self.bounds = shared, problem, tree, bounds
        # (shape, micro_batch, placement, MoE overlaps, vp where combined 1F1B pairs passes): the work before
        # ZeRO, with the micro-batch count and the hops, from the placement's first layout
        self.placement_work: dict[tuple, tuple[SortedWork, int, dict]] = {}
        # the same key less vp, where combined 1F1B pairs passes: what its layouts of every vp share
        self.paired_work: dict[tuple, tuple[PairedWork, int, dict]] = {}
        # the same key where no pairing hides the all-to-alls: the work per block kind
        self.unpaired_work: dict[tuple, tuple[tuple, int, dict]] = {}
        # (shape, micro_batch, mesh order): a pipeline hop's seconds at each (vp, DualPipeV) (which hops leave a
        # domain depends on them)
        self.pipeline_hops: dict[tuple, dict[tuple[int, bool], float]] = {}
        # (ep, dispatcher, a2a overlap asked, pp, vp, DualPipeV) -> whether the MoE all-to-alls are hidden
        self.overlap_flags: dict[tuple, tuple[bool, bool]] = {}
        # (shape, micro_batch): the least tp and cp communication of any of its mesh orders, and each order's hops
        self.root_communication: dict[tuple, tuple[float, list[dict]]] = {}
        self.last_layout: tuple[TreeNode | None, Layout | None] = (None, None)   # `layout_of`
        # (shape, micro_batch, placement): a group's work but its all-to-alls, micro-batches, hops (`group_rest`)
        self.group_floors: dict[tuple, tuple[SortedWork, int, dict, tuple, tuple[float, float]]] = {}
        # a placed node's `first_key`: its all-to-alls per block kind, or the passes combined 1F1B pairs
        # (`all_to_alls_floor_s`); and the costs of its first layout (`first_costs`)
        self.group_all_to_alls: dict[tuple, tuple] = {}
        self.key_costs: dict[tuple, MeshCosts] = {}
        # (shape, micro_batch, placement, dispatcher, DualPipeV): what each ZeRO stage adds (`zero_floor_s`)
        self.zero_extras: dict[tuple, list[ZeroExtras]] = {}

    def root_bound(self, root: TreeNode) -> float:
        """At or below the best plan of every placement, folding and ZeRO stage beneath the root."""
        layout = root.layout(self.problem)
        layers_s, hop_s = self.least_communication_s(root)
        return pipeline_bound(self.bounds.compute_work_s(layout) + layers_s, layout) \
            + p2p_transfers_on_critical_path(layout.pp, layout.vp, layout.dualpipev) * hop_s

    def least_communication_s(self, root: TreeNode) -> tuple[float, float]:
        """The least over the root's mesh orders of its tp and cp collectives (which no vp reads), and of a
        pipeline hop at its schedule."""
        if (root.shape, root.micro_batch) not in self.root_communication:
            layers, hops = [], []
            for order in {order for _, _, order in self.tree.placements(root.shape)}:
                node = TreeNode(root.shape, root.vp, root.micro_batch, root.dualpipev, (1, 1, order))
                costs = MeshCosts(self.model, self.cluster, node.layout(self.problem), self.stack,
                                  self.ep_imbalance, self.shared)
                layers.append(self.bounds.layer_communication_floor_s(costs))
                hops.append(self.hops(node, costs))
            self.root_communication[root.shape, root.micro_batch] = (min(layers, default=0.0), hops)
        layers_s, hops = self.root_communication[root.shape, root.micro_batch]
        return layers_s, min((hop[root.vp, root.dualpipev] for hop in hops), default=0.0)

    def group_floor_s(self, node: TreeNode) -> float:
        """A group's bound before its children are weighed: its placement's work but the MoE all-to-alls, at the
        least shard spec of any dispatcher (no sorts, no gathered buffers: each only adds work), which its vp
        children share. Over half of a large MoE search's groups are bounded away by it (Kimi-K2 on 8,192 H800:
        17,547 of 31,892), their children never weighed."""
        work, micro_batches, hops, _, _ = self.group_rest(node)
        shape = PipelineShape(node.shape.pp, node.vp, micro_batches, node.dualpipev)
        return communication_bound(work.floor(node.vp, node.dualpipev), hops[node.vp, node.dualpipev], shape)

    def group_rest(self, node: TreeNode) -> tuple[SortedWork, int, dict, tuple, tuple[float, float]]:
        """A group's work but its all-to-alls at the least shard spec (sorted, and per block kind with the
        embedding's and head's), micro-batches and hops: what `group_floor_s` and `group_bound` read."""
        key = (node.shape, node.micro_batch, node.placement)
        if key not in self.group_floors:
            least = TreeNode(node.shape, node.vp, node.micro_batch, node.dualpipev, node.placement, False, None,
                             MoeDispatcher.deepep)
            costs = self.first_costs(least, self.first_key(least)[0])   # (its group's child of the same choices)
            blocks, edges = work_before_zero(costs, self.bounds.fastest, all_to_alls=False)
            self.group_floors[key] = (SortedWork.of(blocks, edges, node.shape.pp), costs.layout.num_micro_batches,
                                      self.hops(least, costs), blocks, edges)
        return self.group_floors[key]

    def group_bound(self, node: TreeNode) -> float:
        """A placement's bound under each MoE dispatcher and combined 1F1B switch it leaves open: per block kind
        its floor's work but the all-to-alls (`group_rest`: each child's is at or above it) plus the least
        all-to-alls of its children, those whose passes combined 1F1B pairs at their floor (no streams run:
        `PairedPasses.exposed_floor_s`); the bound rises with each kind's work, so it is at or below every
        child's. Taken only where the heap reaches the group at its floor (`group_floor_s`); a child's whole work
        is weighed only where its group is expanded."""
        _, micro_batches, hops, blocks, edges = self.group_rest(node)
        least = None
        for child in self.tree.children(node):
            all_to_alls = self.all_to_alls_floor_s(child)
            least = all_to_alls if least is None else tuple(map(min, least, all_to_alls))
        shape = PipelineShape(node.shape.pp, node.vp, micro_batches, node.dualpipev)
        work = SortedWork.of(tuple((n, rest + extra) for (n, rest), extra in zip(blocks, least)), edges,
                             node.shape.pp).floor(node.vp, node.dualpipev)
        return communication_bound(work, hops[node.vp, node.dualpipev], shape)

    def all_to_alls_floor_s(self, node: TreeNode) -> tuple[float, ...]:
        """A placed node's MoE all-to-alls per block kind as its work adds them (`placed_blocks`), those that
        combined 1F1B pairs at their floor; what its layouts of every vp share is kept."""
        key, paired = self.first_key(node)
        costs = self.first_costs(node, key)
        values = self.group_all_to_alls.get(key)
        if values is None:
            kinds = [kind for kind, _ in self.model.block_counts]
            values = self.group_all_to_alls[key] = \
                tuple(costs.paired_passes(kind, costs.compute_of(kind)) if kind.num_experts else None
                      for kind in kinds) if paired else \
                tuple(costs.ep_comm_s(kind) if kind.num_experts else 0.0 for kind in kinds)
        if not paired:
            return values
        share = costs.paired_share(node.vp)
        return tuple(0.0 if passes is None or not passes.per_pass_s else passes.exposed_floor_s(share)
                     for passes in values)

    def communication_bound(self, node: TreeNode) -> float:
        """A placed node's bound: compute and exposed per-layer communication, as balanced as integers allow.
        Its children of every vp share the work (a layout is built only for the first of them), but where
        combined 1F1B hides the all-to-alls: their exposure depends on vp (`PairedWork`)."""
        key = self.work_key(node)
        if key not in self.placement_work:
            blocks, micro_batches, hops = self.placed_blocks(node)
            self.placement_work[key] = SortedWork.of(*blocks, node.shape.pp), micro_batches, hops
        work, micro_batches, hops = self.placement_work[key]
        shape = PipelineShape(node.shape.pp, node.vp, micro_batches, node.dualpipev)
        return communication_bound(work.floor(node.vp, node.dualpipev), hops[node.vp, node.dualpipev], shape)

    def zero_floor_s(self, node: TreeNode) -> float:
        """A placed node's bound with the least any of its ZeRO stages adds (`ZeroExtras`: the reduction, the
        optimizer step, ZeRO-2/3 traffic), taken when the search reaches it, before its leaves are weighed: for a
        large model those are seconds, which the work alone leaves out. Its siblings of every vp and combined
        1F1B switch share them."""
        key = (node.shape, node.micro_batch, node.placement, node.moe_dispatcher, node.dualpipev)  # (its ZeRO stages)
        if key not in self.zero_extras:
            self.zero_extras[key] = [
                ZeroExtras.of(MeshCosts(self.model, self.cluster, leaf.layout(self.problem), self.stack,
                                        self.ep_imbalance, self.shared))
                for leaf in self.tree.children(node)]
        self.communication_bound(node)   # (its work, cached)
        work, micro_batches, hops = self.placement_work[self.work_key(node)]
        shape = PipelineShape(node.shape.pp, node.vp, micro_batches, node.dualpipev)
        hops_s = p2p_transfers_on_critical_path(node.shape.pp, node.vp, node.dualpipev) * hops[node.vp, node.dualpipev]
        floor = work.floor(node.vp, node.dualpipev)
        return min((extras.bound_s(floor, shape, hops_s) for extras in self.zero_extras[key]), default=float("inf"))

    def work_key(self, node: TreeNode) -> tuple:
        """What a placed node's work reads: vp only where an overlap hides the all-to-alls (combined 1F1B's
        paired share, or DualPipeV's pairs)."""
        hides, v_hides = self.hidden_a2a(node)
        return (node.shape, node.micro_batch, node.placement, node.moe_dispatcher, hides, v_hides,
                node.vp if hides else 0)

    def placed_blocks(self, node: TreeNode) -> tuple[tuple, int, dict]:
        """A placed node's work per block kind before ZeRO, micro-batch count and hops: from its own layout's
        costs, or, where combined 1F1B pairs its passes, from `PairedWork` of the placement's first layout at
        the node's vp."""
        key, paired = self.first_key(node)
        cache = self.paired_work if paired else self.unpaired_work
        first = cache.get(key)
        if first is None:
            costs = self.first_costs(node, key)
            source = PairedWork(costs, self.bounds.fastest) if paired else work_before_zero(costs, self.bounds.fastest)
            first = cache[key] = (source, costs.layout.num_micro_batches, self.hops(node, costs))
        source, micro_batches, hops = first
        if paired:
            source = source.at(node.vp)
        return source, micro_batches, hops

    def first_key(self, node: TreeNode) -> tuple[tuple, bool]:
        """The node's `work_key`, less vp where combined 1F1B pairs its passes (DualPipeV's pairs, where they hide
        the all-to-alls, take 1F1B's place), and whether it does: what the layouts that share its work share."""
        key = self.work_key(node)
        paired = key[4] and not key[5]
        return (key[:-1] if paired else key), paired

    def first_costs(self, node: TreeNode, key: tuple) -> MeshCosts:
        """The costs of the first layout of a `first_key`: a group's floor and bound and its children's work read
        one, not a layout and costs each."""
        costs = self.key_costs.get(key)
        if costs is None:
            costs = self.key_costs[key] = MeshCosts(self.model, self.cluster, self.layout_of(node), self.stack,
                                                    self.ep_imbalance, self.shared)
        return costs

    def hops(self, node: TreeNode, costs: MeshCosts) -> dict[tuple[int, bool], float]:
        """A pipeline hop's seconds at each (vp, DualPipeV) of the node's shape: the pipeline group's placement
        is the mesh order's, whatever the experts' folding."""
        key = (node.shape, node.micro_batch, node.placement[2])
        if key not in self.pipeline_hops:
            self.pipeline_hops[key] = {(vp, v_shape): costs.p2p_s(vp, v_shape)
                                       for vp, v_shape in self.tree.virtual_stage_choices(node.shape)}
        return self.pipeline_hops[key]

    def layout_of(self, node: TreeNode) -> Layout:
        """The node's layout, the last one kept: a placed node's flags and work read it one after the other."""
        if self.last_layout[0] is not node:
            self.last_layout = (node, node.layout(self.problem))
        return self.last_layout[1]

    def hidden_a2a(self, node: TreeNode) -> tuple[bool, bool]:
        """Whether the node's MoE all-to-alls hide behind combined 1F1B, and behind DualPipeV's pairs: the
        stack's rules read from the node's first layout of that expert degree, dispatcher and schedule (they read
        no other degree, nor the experts' folding or the mesh order: `SoftwareStack.hides_moe_a2a`; the rest is
        pinned for the whole search)."""
        key = (node.placement[1], node.moe_dispatcher, node.moe_a2a_overlap, node.shape.pp, node.vp, node.dualpipev)
        if key not in self.overlap_flags:
            layout = self.layout_of(node)
            self.overlap_flags[key] = (self.stack.hides_moe_a2a(layout), self.stack.dualpipev_hides(layout))
        return self.overlap_flags[key]
