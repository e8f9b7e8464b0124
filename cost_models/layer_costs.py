"""Per-layer, per-micro-batch costs of one mesh: compute, recomputation, exposed communication, memory.

The search's solver and the step-time estimate both read these numbers, so a plan's predicted time is
exactly the objective the solver minimised.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from hardware_profiles.schema import Cluster
from hardware_profiles.topology import GroupPlacement, MeshDim, MeshPlacement, place_dims_together, place_mesh

from .communication import ACTIVATION_BYTES, Collective, CollectiveCost, collective_time
from .compute import LayerCompute, ShardSpec, layer_compute
from .data_parallel_comm import DataParallelCommunication
from .expert_comm import ExpertCommunication
from .host_time import host_excess_seconds, layer_host_seconds
from hardware_profiles.stack import SoftwareStack

from .layer_records import RECOMPUTE_ORDER, LayerCost, LayerWork
from .layout import Layout, Recompute, RecomputeModule
from .memory import StateSharding, activation_bytes, model_state_bytes, params_on_rank
from .records import MATMUL_KINDS, LayerKind, ModelCosts

EXPERT_DIMS = frozenset({"ep", "etpep", "edp"})   # the groups the experts' folding places (`_collective`)
@dataclass(frozen=True)
class MeshGroups:
    """Where one layout's groups sit: the attention mesh's dims, the data-parallel x context-parallel gradient
    group, the expert mesh's dims (MoE parallel folding), and the all-gather dispatcher's expert tp x ep group."""
    attention: MeshPlacement
    dp_cp: GroupPlacement
    experts: MeshPlacement
    experts_tp_ep: GroupPlacement


@dataclass
class SharedCosts:
    """Results that many layouts of one search share: layer compute by (kind, shard spec), mesh
    placements by mesh shape, collective times by (op, bytes, group), combined 1F1B's exposure by the passes
    it pairs. One cluster per instance."""
    compute: dict = field(default_factory=dict)
    placements: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    by_placement: dict = field(default_factory=dict)    # the same, by (op, bytes, dim, placement key, options)
    paired_layers: dict = field(default_factory=dict)   # combined 1F1B's exposure by (passes, layers, SM share)
    activations: dict = field(default_factory=dict)     # a layer's activation bytes by (kind, shape, modules, load)
    work_ids: dict = field(default_factory=dict)        # (shard spec, placement, modules) -> id (`_work_key`)
    work: dict = field(default_factory=dict)            # a layer's work but its all-to-alls by (kind, work id)
    dense_specs: dict = field(default_factory=dict)     # a shard spec -> as a layer without experts reads it


class MeshCosts(ExpertCommunication, DataParallelCommunication):
    """Costs of every layer kind for one layout's degrees (partition and recomputation left free)."""

    def __init__(self, model: ModelCosts, cluster: Cluster, layout: Layout, stack: SoftwareStack,
                 ep_imbalance: float = 1.0, shared: SharedCosts | None = None):
        self.model, self.cluster, self.layout, self.stack = model, cluster, layout, stack
        self.ep_imbalance = ep_imbalance
        self.spec = ShardSpec.of(layout, stack, ep_imbalance=ep_imbalance)
        self._state_sharding: StateSharding | None = None   # (`state_sharding`: the search's bounds mostly read none)
        # whether the TP collectives run as chunked rings beside the GEMMs (`SoftwareStack.tp_overlap_in`); read by
        # every layer's work key, so set here rather than behind a cached property's lock
        self.tp_overlap = stack.tp_overlap_in(layout, cluster.device)
        self._cache: dict[str, LayerCost] = {}
        self._work_ids: dict[bool, int] = {}
        # the placement as ints and names (what its groups' placements follow from): the attention mesh's dims,
        # then the experts' folding (set here: a search builds one per layout it weighs, and reads it per layer)
        self._placement_key = (layout.mesh_dims(), layout.etp, layout.ep)
        self._shared = shared if shared is not None else SharedCosts()

    @property
    def state_sharding(self) -> StateSharding:
        """How the layout shards weights, gradients and optimizer states (built when first read: most of the
        costs a search builds are for bounds that read no states)."""
        if self._state_sharding is None:
            self._state_sharding = StateSharding.of(self.layout, self.stack)
        return self._state_sharding

    def with_recompute_modules(self, modules: tuple[RecomputeModule, ...]) -> "MeshCosts":
        """The same layout's costs with selective recomputation repeating `modules` (what it shares kept)."""
        return MeshCosts(self.model, self.cluster, replace(self.layout, recompute_modules=modules), self.stack,
                         self.ep_imbalance, self._shared)

    @cached_property
    def _dense_spec(self) -> ShardSpec:
        """The shard spec as a layer without experts reads it: no expert degrees, dispatcher sorts or load (one
        per spec of a search: its layouts share it)."""
        dense = self._shared.dense_specs.get(self.spec)
        if dense is None:
            dense = replace(self.spec, ep=1, etp=1, sort_copies=0, gathered_ranks=1, expert_load=1.0)
            dense = self._shared.dense_specs[self.spec] = self.spec if dense == self.spec else dense
        return dense

    def spec_of(self, kind: LayerKind) -> ShardSpec:
        """The spec a layer kind's compute reads: the whole one with experts, else `_dense_spec`, so the layouts
        of a search that differ only in their experts' folding and dispatcher share a dense layer's costs."""
        return self.spec if kind.num_experts else self._dense_spec

    def _work_key(self, experts: bool) -> int:
        """What a layer's work but its all-to-alls reads of this layout (its shard spec as `spec_of` gives it; the
        placement, the attention mesh's alone without experts; the recomputed modules; whether TP overlap runs), as
        an id the search's layouts share: hashed once per layout, not per layer."""
        if experts not in self._work_ids:
            placement = self._placement_key if experts else self._placement_key[0]
            key = (self.spec if experts else self._dense_spec, placement, self.layout.recompute_modules,
                   self.tp_overlap)
            self._work_ids[experts] = self._shared.work_ids.setdefault(key, len(self._shared.work_ids))
        return self._work_ids[experts]

    @cached_property
    def placement(self):
        key = self._placement_key
        if key not in self._shared.placements:
            self._shared.placements[key] = self._place()
        return self._shared.placements[key]

    def _place(self):
        lay = self.layout
        dims = tuple(MeshDim(name, size) for name, size in lay.mesh_dims())
        attention = place_mesh(dims, self.cluster)
        # gradients are reduced over dp x cp: those ranks sit where the order puts dp and cp, apart or not
        dp_cp = place_dims_together("dpcp", ("dp", "cp"), dims, self.cluster)
        expert_dims = self._folded_dims({"tp": [("etp", lay.etp)], "pp": [("pp", lay.pp)]},
                                        [("ep", lay.ep), ("edp", lay.expert_data_parallel)])
        experts = place_mesh(expert_dims, self.cluster)
        # the all-gather dispatcher's group: expert tensor-parallel x expert-parallel ranks (Megatron tp_ep)
        experts_tp_ep = place_dims_together("etpep", ("etp", "ep"), expert_dims, self.cluster)
        return MeshGroups(attention, dp_cp, experts, experts_tp_ep)

    def _folded_dims(self, kept: dict, data_dims: list) -> tuple[MeshDim, ...]:
        """The mesh in the layout's order with cp, ep and dp folded into `data_dims` where the first of
        them sits (MoE parallel folding: experts use etp x ep x edp x pp over the same ranks)."""
        dims, folded = [], False
        for name in self.layout.mesh_order:
            if name in kept:
                dims += kept[name]
            elif not folded:
                dims += data_dims
                folded = True
        return tuple(MeshDim(name, size) for name, size in dims)

    def collective(self, op: Collective, size: float, dim: str, **kwargs) -> CollectiveCost:
        # looked up first by the placement's own key (ints and names): hashing the group placements themselves
        # is most of a search's time in this call; a group of the attention mesh (tp, cp, dp, pp, dp x cp) is
        # placed by its dims alone, so the layouts that differ only in their experts' folding share it
        placement = self._placement_key if dim in EXPERT_DIMS else self._placement_key[0]
        fast = (op, size, dim, placement, *kwargs.items())
        cost = self._shared.by_placement.get(fast)
        if cost is None:
            cost = self._shared.by_placement[fast] = self._collective(op, size, dim, **kwargs)
        return cost

    def _collective(self, op: Collective, size: float, dim: str, **kwargs) -> CollectiveCost:
        groups = self.placement
        group = {"dpcp": groups.dp_cp, "ep": groups.experts.of("ep") if self.layout.ep > 1 else None,
                 "etpep": groups.experts_tp_ep, "edp": groups.experts.of("edp")}.get(dim) or groups.attention.of(dim)
        key = (op, size, group, tuple(sorted(kwargs.items())))
        if key not in self._shared.collectives:
            self._shared.collectives[key] = collective_time(op, size, group, self.cluster, **kwargs)
        return self._shared.collectives[key]

    @property
    def activation_message_bytes(self) -> float:
        """One micro-batch's hidden states on one tp group: b * s * h / cp."""
        lay = self.layout
        return lay.micro_batch * self.model.seq_len * self.model.hidden_size * ACTIVATION_BYTES / lay.cp

    def tp_comm_s(self, kind: LayerKind) -> float:
        # Megatron: per pair one all-reduce forward and one backward of b*s*h (an all-gather plus a
        # reduce-scatter with SP, the same bytes)
        if self.layout.tp == 1 or not kind.tp_pair_count:
            return 0.0
        total = self._tp_collectives_s(kind)
        if not self.tp_overlap:
            return total
        # chunked over tp ring steps (Wang et al. ASPLOS'23 decomposition; TE userbuffers): one chunk is
        # exposed, the others overlap the GEMMs of the same layer, forward and backward
        compute = self.compute_of(kind)
        first = total / self.layout.tp
        return first + max(0.0, total - first - compute.forward_s - compute.backward_s)

    def tp_comm_floor_s(self, kind: LayerKind) -> float:
        """The least of `tp_comm_s` whatever compute runs beside it: with the overlap, its first chunk."""
        if self.layout.tp == 1 or not kind.tp_pair_count:
            return 0.0
        total = self._tp_collectives_s(kind)
        return total / self.layout.tp if self.tp_overlap else total

    def _tp_collectives_s(self, kind: LayerKind) -> float:
        size = self.activation_message_bytes
        if self.layout.sp:
            one = (self.collective(Collective.all_gather, size, "tp").seconds
                   + self.collective(Collective.reduce_scatter, size, "tp").seconds)
        else:
            one = self.collective(Collective.all_reduce, size, "tp").seconds
        return 2 * kind.tp_pair_count * one

    def cp_comm_s(self, kind: LayerKind, attention_forward_s: float) -> float:
        # all-gather K and V forward, reduce-scatter their gradients backward (Llama 3 CP)
        if self.layout.cp == 1 or not kind.kv_channels:
            return 0.0
        lay = self.layout
        size = 2 * lay.micro_batch * self.model.seq_len * kind.kv_channels * ACTIVATION_BYTES / lay.tp
        forward = self.collective(Collective.all_gather, size, "cp").seconds
        backward = self.collective(Collective.reduce_scatter, size, "cp").seconds
        hidden_fwd = self.stack.cp_hidden * attention_forward_s
        hidden_bwd = self.stack.cp_hidden * 2 * attention_forward_s
        return max(0.0, forward - hidden_fwd) + max(0.0, backward - hidden_bwd)

    def compute_of(self, kind: LayerKind) -> LayerCompute:
        spec = self.spec_of(kind)
        key = (kind.name, spec)
        if key not in self._shared.compute:
            self._shared.compute[key] = layer_compute(kind, self.cluster.device, spec)
        return self._shared.compute[key]

    def _host(self, kind: LayerKind):
        spec = self.spec_of(kind)
        key = (kind.name, spec, "host")
        if key not in self._shared.compute:
            self._shared.compute[key] = layer_host_seconds(kind, self.cluster.device, self.stack, spec)
        return self._shared.compute[key]

    def work(self, kind: LayerKind, all_to_alls: bool = True) -> LayerWork:
        """The layer's time without its memory parts: what it costs under every ZeRO stage at least
        (the search bounds whole subtrees with it); without `all_to_alls`, less the MoE all-to-alls (the
        search adds them per pipeline schedule: `planner.search.bounds.PairedWork`)."""
        rest = self._work_but_all_to_alls(kind)
        if not (all_to_alls and kind.num_experts):
            return rest
        return replace(rest, ep_comm_s=self.ep_comm_s(kind),
                       ep_comm_alone_s=2 * self.ep_pass_s(kind))

    def work_before_zero_s(self, kind: LayerKind, recompute: Recompute) -> float:
        """`work(kind).work_before_zero_s(recompute)` without building its record (the search asks it of each
        placement it bounds)."""
        rest = self._work_but_all_to_alls(kind).work_but_all_to_alls_s(recompute)
        return rest + self.ep_comm_s(kind) if kind.num_experts else rest

    def _work_but_all_to_alls(self, kind: LayerKind) -> LayerWork:
        """`work` less the all-to-alls: the same under every MoE dispatcher and all-to-all overlap of one
        placement (but the all-to-all dispatcher's sorts, in the shard spec of a layer with experts), so the
        layouts of a search that differ only in those share it."""
        key = (kind.name, self._work_key(bool(kind.num_experts)))
        if key not in self._shared.work:
            self._shared.work[key] = self._work_alone(kind)
        return self._shared.work[key]

    def _work_alone(self, kind: LayerKind) -> LayerWork:
        compute = self.compute_of(kind)
        selective = compute.selective_forward_s(self.layout.recompute_modules)
        host = self._host(kind)
        return LayerWork(forward_s=compute.forward_s, backward_s=compute.backward_s,
                         host_excess_s=host_excess_seconds(host, compute),
                         recompute_s=(0.0, selective, compute.forward_s),
                         tp_comm_s=self.tp_comm_s(kind),
                         cp_comm_s=self.cp_comm_s(kind, compute.attention_core_forward_s),
                         ep_comm_s=0.0, module_recompute_s=compute.module_forward_s,
                         backward_weight_s=compute.backward_weight_s, ep_comm_alone_s=0.0)

    def layer(self, kind: LayerKind) -> LayerCost:
        if kind.name in self._cache:
            return self._cache[kind.name]
        lay = self.layout
        activations, freed = self._activations(kind)
        states = model_state_bytes(kind, self.state_sharding)
        dense_params, expert_params = params_on_rank(kind, self.state_sharding)
        selective_flops = sum(op.forward_flops for op in kind.ops
                              if op.kind in MATMUL_KINDS and op.recomputed_by(lay.recompute_modules))
        step = self.step_parts(kind)
        work = self.work(kind)
        cost = LayerCost(
            **vars(work), activation_bytes=activations, module_freed_bytes=freed,
            working_bytes=activations[0],
            states=states, grad_reduce_bytes=dense_params * lay.gradient_bytes,
            dp_reduce_s=step.dp_reduce_s, optimizer_step_s=step.optimizer_step_s,
            weight_bytes_unsharded=(dense_params + expert_params) * 2,
            weight_pass_recomputes=kind.weight_pass_groups if self.stack.dualpipev_weight_pass_recompute else 0,
            forward_flops_model=sum(op.forward_flops for op in kind.ops if op.kind in MATMUL_KINDS),
            selective_forward_flops=selective_flops, zero_exposed_s=step.zero_exposed_by_method(work.recompute_s))
        self._cache[kind.name] = cost
        return cost

    def _activations(self, kind: LayerKind) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """A layer's activation bytes by RECOMPUTE_ORDER, and what recomputing each module alone frees (the many
        layouts of a search that share the shape of a micro-batch on a rank share them)."""
        lay = self.layout
        shape = (lay.tp, lay.sp, lay.cp, lay.micro_batch, self.stack.saved_input_precision(lay.precision))
        load = self.spec.expert_load
        key = (kind.name, shape, lay.recompute_modules, load)
        if key not in self._shared.activations:
            probs = self.stack.moe_probs_in_expert_activation
            activations = tuple(activation_bytes(kind, r, *shape, lay.recompute_modules, load, probs)
                                for r in RECOMPUTE_ORDER)
            freed = tuple(activations[0] - activation_bytes(kind, Recompute.selective, *shape, (module,), load,
                                                            probs) for module in RecomputeModule)
            self._shared.activations[key] = (activations, freed)
        return self._shared.activations[key]

    @cached_property
    def comm_buffer_bytes(self) -> float:
        """Two activation messages in flight, plus two layers of gathered weights with ZeRO-3 prefetch, plus the
        all-gather dispatcher's gathered tokens (`dispatch_buffer_bytes`)."""
        buffers = 2 * self.activation_message_bytes + self.dispatch_buffer_bytes()
        if self.layout.zero >= 3:
            buffers += 2 * max(self.layer(kind).weight_bytes_unsharded for kind in self.model.kinds)
        return buffers

    def p2p_s(self, vp: int | None = None, v_shape: bool | None = None) -> float:
        """One pipeline hop's exposed seconds, its tier mixed as the chain's hops cross it (at the layout's
        schedule, or at `vp` and `v_shape` for a bound over several)."""
        if self.layout.pp == 1:
            return 0.0
        size = self.activation_message_bytes / (self.layout.tp if self.layout.sp else 1)
        virtual = vp or self.layout.vp
        if self.layout.dualpipev if v_shape is None else v_shape:
            virtual = 1    # a V hops between neighbours only, with no wrap-around
        share = self.placement.attention.of("pp").hop_crossing_share(virtual)
        hidden = self.stack.pp_hidden_interleaved if virtual > 1 else self.stack.pp_hidden
        return self.collective(Collective.send_recv, size, "pp", crossing_share=share).seconds * (1 - hidden)
