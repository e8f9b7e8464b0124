"""Bounds of the search tree's subtrees, each at or below the best plan of every layout beneath it.

A mesh shape with a schedule is bounded by its compute alone; with expert folding and mesh order by
compute plus exposed per-layer communication; with a ZeRO stage by a balanced pipeline with its
data-parallel and optimizer time. The memory floor (model states of a perfectly split model plus the
cheapest activations) prunes layouts that cannot fit. Every term comes from the same `MeshCosts` layer
costs the estimate and the partition solver read.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from cost_models.compute import ShardSpec, layer_compute
from cost_models.layer_costs import MeshCosts
from cost_models.layer_records import RECOMPUTE_INDEX
from cost_models.layout import MODULE_INDEX, Layout, Recompute, RecomputeModule, nested_modules
from cost_models.offload import freed_bytes
from hardware_profiles.stack import SoftwareStack
from cost_models.memory import (StateSharding, activation_bytes, gradients_held_at_peak, logits_bytes,
                                 loss_gradient_bytes, model_state_bytes, usable_bytes)
from cost_models.pipeline import (dualpipev_scaled, in_flight_micro_batches, p2p_transfers_on_critical_path,
                                  pipeline_scaled)
from cost_models.stage_terms import LayerTerms, TermContext, terms_sum
from cost_models.records import ModelCosts
from cost_models.step_time import estimate
from hardware_profiles.schema import Cluster

from .partition_model import selective_is_one_switch

MEMORY_RANK = RECOMPUTE_INDEX   # none, selective, full: least memory last


@dataclass(frozen=True)
class WorkFloor:
    """Per-micro-batch work of the whole model (every block at its fastest) and the least work the
    busiest pipeline rank can have."""
    total_s: float
    busiest_rank_floor_s: float


@dataclass(frozen=True)
class PipelineShape:
    """What a pipeline bound reads of a layout (a placed node's bounds are taken without building one)."""
    pp: int
    vp: int
    num_micro_batches: int
    dualpipev: bool = False


@dataclass(frozen=True)
class SortedWork:
    """The per-micro-batch work items of one model on `pp` ranks, largest first, and what of its floor holds
    for every virtual-stage count: a placed node's children share it and differ only in the schedule."""
    total_s: float
    packing_s: float                    # the P||Cmax part of the floor
    edge_work_s: tuple[float, float]
    least_block_s: float
    pp: int

    @classmethod
    def of(cls, block_work_s: tuple[tuple[int, float], ...], edge_work_s: tuple[float, float], pp: int
           ) -> "SortedWork":
        """`block_work_s`: (blocks, seconds each) per block kind."""
        items = list(edge_work_s)
        for n, w in block_work_s:
            items += [w] * n
        items.sort(reverse=True)
        # scheduling bound (P||Cmax): of the k pp + 1 largest items some rank holds k + 1, so its work is at
        # least the k + 1 smallest of them; contiguity and fixed edges only constrain further
        packing = max([sum(items[k * pp - k: k * pp + 1]) for k in range(1, (len(items) - 1) // pp + 1)]) \
            if pp > 1 and len(items) > pp else 0.0
        return cls(sum(items), packing, tuple(edge_work_s), min(w for _, w in block_work_s), pp)

    def floor(self, vp: int, v_shape: bool = False) -> WorkFloor:
        """`v_shape`: DualPipeV's placement."""
        if self.pp == 1:
            return WorkFloor(self.total_s, self.total_s)
        # the ranks with the embedding or the head hold a block in each of their chunks but the one beside it;
        # a V puts the first and the last chunk, so both, on rank 0
        edges = self.edge_work_s
        edge_rank = sum(edges) if v_shape else max(edges) + (vp - 1) * self.least_block_s
        return WorkFloor(self.total_s, max(self.packing_s, edge_rank))


def work_floor(block_work_s: tuple[tuple[int, float], ...], edge_work_s: tuple[float, float], pp: int, vp: int,
               v_shape: bool = False) -> WorkFloor:
    """`block_work_s`: (blocks, seconds each) per block kind; `v_shape`: DualPipeV's placement."""
    return SortedWork.of(block_work_s, edge_work_s, pp).floor(vp, v_shape)


def work_before_zero(costs: MeshCosts, fastest: Recompute, all_to_alls: bool = True
                     ) -> tuple[tuple, tuple[float, float]]:
    """Each block kind's and the embedding's and head's work before ZeRO-2/3 traffic, which every ZeRO
    stage pays at least; without `all_to_alls`, less the MoE all-to-alls, which every schedule and overlap
    pays at least."""
    model = costs.model

    def seconds(kind, method: Recompute) -> float:
        return costs.work_before_zero_s(kind, method) if all_to_alls else \
            costs.work(kind, all_to_alls=False).work_before_zero_s(method)
    blocks = tuple((n, seconds(kind, fastest)) for kind, n in model.block_counts)
    return blocks, tuple(seconds(edge, Recompute.none) for edge in (model.embedding, model.head))


class PairedWork:
    """`work_before_zero` of a placed node whose MoE all-to-alls combined 1F1B pairs, at each vp of it: the
    share of passes paired and the layers per chunk read vp; the rest of each layer's work and its passes do
    not, so they are taken once from the costs of the placement's first layout."""

    def __init__(self, costs: MeshCosts, fastest: Recompute):
        model, self.costs = costs.model, costs
        kinds = [(kind, fastest) for kind, _ in model.block_counts] + \
            [(edge, Recompute.none) for edge in (model.embedding, model.head)]
        self.counts = tuple(n for _, n in model.block_counts)
        self.rest_s = [costs.work(kind, all_to_alls=False).work_before_zero_s(method) for kind, method in kinds]
        # (a kind without experts spread has no all-to-alls to pair: None)
        self.passes = [costs.paired_passes(kind, costs.compute_of(kind)) if kind.num_experts else None
                       for kind, _ in kinds]
        self.by_layers: dict[tuple[int, int], float] = {}

    def at(self, vp: int) -> tuple[tuple, tuple[float, float]]:
        """Per block kind at this vp."""
        costs, layers = self.costs, self.costs.layers_per_chunk(vp)
        paired = costs.paired_share(vp)
        seconds = [rest if passes is None or not passes.per_pass_s else
                   rest + passes.exposed_s(paired, self._paired_pass_s(i, passes, layers))
                   for i, (rest, passes) in enumerate(zip(self.rest_s, self.passes))]
        return tuple(zip(self.counts, seconds)), (seconds[-2], seconds[-1])

    def _paired_pass_s(self, index: int, passes, layers: int) -> float:
        if (index, layers) not in self.by_layers:
            self.by_layers[index, layers] = self.costs.paired_pass_s(passes, layers)
        return self.by_layers[index, layers]


def communication_bound(work: WorkFloor, p2p_s: float, layout: Layout | PipelineShape) -> float:
    """Pipeline of compute and exposed per-layer communication as balanced as integers allow."""
    return (pipeline_bound(work.total_s, layout, work.busiest_rank_floor_s)
            + p2p_transfers_on_critical_path(layout.pp, layout.vp, layout.dualpipev) * p2p_s)


def balanced_bound(costs: MeshCosts, layout: Layout, fastest: Recompute = Recompute.none,
                   forced_recompute_s: float = 0.0) -> float:
    """Step time of a perfectly balanced pipeline at the fastest recomputation allowed, plus the least
    recomputation work per micro-batch that memory forces (`Bounds.forced_recompute_s`): the stage terms
    (`LayerTerms`) of the whole model at their least, over the ranks."""
    model, context = costs.model, TermContext.of(costs)
    blocks = [(n, LayerTerms.of(costs.layer(kind), fastest, context)) for kind, n in model.block_counts]
    edges = [LayerTerms.of(costs.layer(edge), Recompute.none, context) for edge in (model.embedding, model.head)]
    # the slowest stage's DP exposure, optimizer step and DualPipeV bubble term are at least the stages' mean
    # (max >= mean); dp_exposed_s is convex (a max of affine terms), so its value at the mean is below its mean
    mean = terms_sum([(terms, n) for n, terms in blocks] + [(edge, 1) for edge in edges]) * (1 / layout.pp)
    work = work_floor(tuple((n, terms.work_s) for n, terms in blocks), tuple(c.work_s for c in edges),
                      layout.pp, layout.vp, layout.dualpipev)
    work = WorkFloor(work.total_s + forced_recompute_s, work.busiest_rank_floor_s)
    bubble = max(0.0, mean.bubble_s) if layout.dualpipev else 0.0
    return (pipeline_bound(work.total_s, layout, work.busiest_rank_floor_s, bubble)
            + p2p_transfers_on_critical_path(layout.pp, layout.vp, layout.dualpipev) * costs.p2p_s()
            + step_terms_s(costs, mean))


def step_terms_s(costs: MeshCosts, mean: LayerTerms) -> float:
    """What a step adds once beside its micro-batches, at the stages' mean: the data-parallel reduction the
    last micro-batch does not hide, and the optimizer step."""
    return costs.dp_exposed_s(mean.dp_reduce_s, mean.compute_s) + mean.optimizer_s


@dataclass(frozen=True)
class ZeroExtras:
    """What one ZeRO stage adds to a placed node's work before ZeRO, whatever its vp and combined 1F1B: its
    ZeRO-2/3 traffic per micro-batch, summed over the model's layers, and `step_terms_s`."""
    zero_traffic_s: float
    step_s: float

    @classmethod
    def of(cls, costs: MeshCosts) -> "ZeroExtras":
        """From each layer's `MeshCosts.step_parts`: the same terms `balanced_bound` sums, the exposed traffic at
        its least (under full recomputation, which repeats the whole forward and so hides the most)."""
        model = costs.model
        counted = list(model.block_counts) + [(model.embedding, 1), (model.head, 1)]
        total = terms_sum((LayerTerms.of_step(costs.step_parts(kind), costs.compute_of(kind).forward_s), n)
                          for kind, n in counted)
        return cls(total.zero_s, step_terms_s(costs, total * (1 / costs.layout.pp)))

    def bound_s(self, work: WorkFloor, shape: PipelineShape, hops_s: float) -> float:
        """At or below `balanced_bound` of the leaf: its work is the node's plus this traffic (its busiest rank
        at least the node's), and its DualPipeV bubble term at least 0."""
        return pipeline_bound(work.total_s + self.zero_traffic_s, shape, work.busiest_rank_floor_s) + hops_s \
            + self.step_s


def pipeline_bound(total_work_s: float, layout: Layout | PipelineShape, busiest_floor_s: float = 0.0,
                   dualpipev_bubble_s: float = 0.0) -> float:
    """The pipeline's critical path with max W_i at its least possible value: the mean, or the floor if higher.
    Under DualPipeV each rank's pairs take X with F + B >= X, so X and A at that value, and the bubble term at
    `dualpipev_bubble_s`, a floor of the slowest rank's A + B - kW (`cost_models.pipeline.dualpipev_seconds`)."""
    p, v, m = layout.pp, layout.vp, layout.num_micro_batches
    slowest = max(total_work_s / p, busiest_floor_s)
    if layout.dualpipev:
        return dualpipev_scaled(slowest, slowest, dualpipev_bubble_s, p, m) / 2
    return pipeline_scaled(total_work_s, slowest, m, v) / v


@dataclass(frozen=True)
class _Floor:
    bytes: float
    parts: dict
    heaviest_weight: float      # max_i w_i f_i: what one byte of activations weighs at most


class Bounds:
    """Cheap bounds shared across candidates: compute-only work and the memory floor."""

    def __init__(self, model: ModelCosts, cluster: Cluster, stack: SoftwareStack, allowed: tuple[Recompute, ...],
                 module_choices: tuple[RecomputeModule, ...] = ()):
        self.model, self.cluster, self.stack = model, cluster, stack
        self.allowed = allowed
        self.module_choices = module_choices   # where the solver chooses them, every set's bound must hold
        self.cheapest = max(allowed, key=MEMORY_RANK.get)   # least activation memory
        self.fastest = min(allowed, key=MEMORY_RANK.get)    # least work
        self.work: dict[tuple, float] = {}
        self.activations: dict[tuple, float] = {}
        self.largest_ep = max([k.num_experts or 1 for k in model.kinds])
        # the index sets of selective offers a plan may combine (`forced_recompute_s`): with module choices, any
        # set but one naming a module beside the one holding it (moe_act or shared_experts with moe: the
        # solver's rule; their freed bytes would count twice); without, the layout's set as one offer
        offers = len(module_choices) or 1
        self.module_sets = tuple(subset for size in range(1, offers + 1)
                                 for subset in itertools.combinations(range(offers), size)
                                 if not module_choices or not nested_modules({module_choices[u] for u in subset}))

    def compute_work_s(self, layout: Layout) -> float:
        """Compute-only work, valid for every ep and etp: GEMM efficiency only grows with size and weight
        reads only shrink with ep x etp, so every expert on its own rank, split tp ways, bounds it from below."""
        spec = ShardSpec.of(layout, self.stack, ep=self.largest_ep, etp=layout.tp)
        if spec not in self.work:
            model = self.model
            counted = list(model.block_counts) + [(model.embedding, 1), (model.head, 1)]
            self.work[spec] = sum(n * (compute.forward_s + compute.backward_s) for kind, n in counted
                                  for compute in [layer_compute(kind, self.cluster.device, spec)])
        return self.work[spec]

    def layer_communication_floor_s(self, costs: MeshCosts) -> float:
        """One micro-batch's per-layer collectives over the whole model that every expert folding of `costs`'s
        mesh order pays at least: tp's and cp's, whose groups the attention mesh places (ep and etp fold
        only the experts' ranks), tp's at its first chunk where the stack overlaps it with compute."""
        model = self.model
        counted = list(model.block_counts) + [(model.embedding, 1), (model.head, 1)]
        return sum(n * (costs.tp_comm_floor_s(kind) + costs.work(kind).cp_comm_s) for kind, n in counted)

    def memory_floor(self, layout: Layout) -> tuple[float, dict]:
        """Least memory any partition needs on its fullest stage, with the cheapest activations."""
        floor = self._floor(layout, self.cheapest)
        return floor.bytes, floor.parts

    def _floor(self, layout: Layout, recompute: Recompute) -> "_Floor":
        """Stage i holding layers of kind k needs s_k + f_i a_k each (states, and activations of its f_i
        micro-batches in flight). For weights w_i >= 0 summing to 1, the fullest stage holds at least the
        weighted mean of the stages, and that is at least sum_k n_k min_i w_i (s_k + f_i a_k) whatever the
        split (LP duality). w_i proportional to 1 / (S + f_i A) (S, A: the model's totals) makes it exact
        for a model of one layer kind, where the best split equalises the stages."""
        sharding = StateSharding.of(layout, self.stack)
        held = gradients_held_at_peak(self.stack.gradient_buffer_in(layout), layout.num_micro_batches)

        def states_at_peak(kind) -> float:  # max(a + g_held, g) >= a + g_held: still a floor
            states = model_state_bytes(kind, sharding)
            return states.total if held else states.total - states.gradients

        kinds = [(n, states_at_peak(kind), act)
                 for (kind, n), act in zip(self.model.block_counts, self._activations(layout, recompute))]
        paired = self.stack.hides_moe_a2a(layout)   # every leaf below: full recomputation is then not chosen
        flights = [in_flight_micro_batches(i, layout.pp, layout.num_micro_batches, layout.vp, paired, layout.dualpipev)
                   for i in range(layout.pp)]
        total_states = sum(n * state for n, state, _ in kinds)
        total_activations = sum(n * act for n, _, act in kinds)
        inverse = [1.0 / (total_states + f * total_activations) for f in flights]
        norm = sum(inverse)
        weights = [x / norm for x in inverse]
        states = activations = 0.0
        for n, state, act in kinds:
            stage = min(range(layout.pp), key=lambda i: weights[i] * (state + flights[i] * act))
            states += n * weights[stage] * state
            activations += n * weights[stage] * flights[stage] * act
        # the first stage holds the embedding, the last chunk's rank the output layer and its fp32 logits
        model = self.model
        head = weights[layout.chunk_rank(layout.pp * layout.vp - 1)]
        states += weights[0] * states_at_peak(model.embedding) + head * states_at_peak(model.head)
        logits = head * (logits_bytes(model.head, layout.tp, layout.cp, layout.micro_batch, self.stack.loss_gradient)
                                + loss_gradient_bytes(model.head, layout.tp, layout.cp, layout.micro_batch,
                                                      self.stack.loss_gradient))
        return _Floor(states + activations + logits,
                      {"model_states": states, "activations": activations, "logits": logits},
                      max(w * f for w, f in zip(weights, flights)))

    def offload_floor(self, layout: Layout, count: int | None = None) -> tuple[float, dict]:
        """At pp = 1 without recomputation: the memory floor less what offloading the first `count` blocks' activations
        frees (the largest of them in flight: `cost_models.offload`; None: every block but the last), with its parts."""
        floor = self._floor(layout, Recompute.none)
        per_kind = {kind.name: act for (kind, _), act in zip(self.model.block_counts,
                                                              self._activations(layout, Recompute.none))}
        freed = freed_bytes([per_kind[name] for name in self.model.blocks[:-1][:count]])
        return floor.bytes - freed, dict(floor.parts, activations=floor.parts["activations"] - freed)

    def no_recompute_floor(self, layout: Layout) -> float:
        """The memory floor with no block recomputing."""
        return self._floor(layout, Recompute.none).bytes

    def _activations(self, layout: Layout, recompute: Recompute) -> tuple[float, ...]:
        key = (recompute, layout.tp, layout.sp, layout.cp, layout.micro_batch,
               self.stack.saved_input_precision(layout.precision),
               self._least_memory_modules(layout))
        if key not in self.activations:
            probs = self.stack.moe_probs_in_expert_activation
            self.activations[key] = tuple(activation_bytes(kind, recompute, *key[1:], probs_in_expert_activation=probs)
                                          for kind, _ in self.model.block_counts)
        return self.activations[key]

    def _least_memory_modules(self, layout: Layout) -> tuple[RecomputeModule, ...]:
        """The selective set that frees the most: all the solver may choose (freed bytes only add up)."""
        return self.module_choices or layout.recompute_modules

    def _selective_prices(self, cost) -> list[tuple[float, float]]:
        """(seconds, bytes freed) of each unit a selective layer can buy: each module the solver may
        choose (a set costs and frees their sums), or the layout's set as one."""
        if not self.module_choices:
            return [(cost.recompute_s[1], cost.activation_bytes[0] - cost.activation_bytes[1])]
        return [(cost.module_recompute_s[MODULE_INDEX[m]], cost.module_freed_bytes[MODULE_INDEX[m]])
                for m in self.module_choices]

    def forced_recompute_s(self, layout: Layout, costs: MeshCosts) -> float:
        """Least recomputation work per micro-batch, summed over the ranks, that fitting the memory forces.

        With the weights of `_floor` at the fastest recomputation, the stages' weighted memory
        sum_l w_i(l) (s_l + f_i(l) a_l) must come down to the usable bytes C, so the layers recomputed
        save sum_l w_i(l) f_i(l) da_l >= D = floor - C, hence sum_l da_l >= D / max_i w_i f_i; no
        layer buys a byte for less than the cheapest seconds-per-byte of any kind and method (an LP
        bound), and at least one layer recomputes. Where selective recomputation is one switch for the
        model, the cheaper of two routes: without it, or with it in every layer. Infinite when no allowed
        method saves memory and the floor does not fit."""
        floor = self._floor(layout, self.fastest)
        deficit = floor.bytes - usable_bytes(self.cluster.device)
        if deficit <= 0:
            return 0.0
        if not self._selective_everywhere():
            return self._least_priced_s(costs, floor, deficit, self.allowed)
        # a stack whose selective recomputation is one switch (Megatron): either no layer recomputes
        # selectively, or every layer does with one set of modules, whose time and freed bytes are its
        # modules' sums over all layers; that set must free the deficit at the heaviest stage weight
        others = tuple(m for m in self.allowed if m is not Recompute.selective)
        offers = [(n, self._selective_prices(costs.layer(kind))) for kind, n in self.model.block_counts]
        units = [(sum(n * o[unit][0] for n, o in offers), sum(n * o[unit][1] for n, o in offers))
                 for unit in range(len(offers[0][1]))]
        needed = deficit / floor.heaviest_weight
        selective = min((sum(units[u][0] for u in subset) for subset in self.module_sets
                         if sum(units[u][1] for u in subset) >= needed), default=float("inf"))
        return min(self._least_priced_s(costs, floor, deficit, others), selective)

    def _selective_everywhere(self) -> bool:
        """The partition's rule (`solve_partition`): every layer selective or none, where the stack says so."""
        return selective_is_one_switch(self.stack, self.allowed) and self.fastest is Recompute.none

    def _least_priced_s(self, costs: MeshCosts, floor: "_Floor", deficit: float,
                        methods: tuple[Recompute, ...]) -> float:
        """The LP bound over `methods`: the deficit at the cheapest seconds per byte, and at least one
        layer's recomputation; infinite where none of them saves memory."""
        prices, single = [], []
        for kind, _ in self.model.block_counts:
            cost = costs.layer(kind)
            for method in methods:
                if method is Recompute.selective and self.fastest is Recompute.none:
                    offers = self._selective_prices(cost)
                else:
                    offers = [(cost.work_s(method) - cost.work_s(self.fastest),
                               cost.activation_bytes[RECOMPUTE_INDEX[self.fastest]]
                               - cost.activation_bytes[RECOMPUTE_INDEX[method]])]
                for seconds, saved in offers:
                    if saved > 0:
                        prices.append(seconds / saved)
                        single.append(seconds)
        if not prices:
            return float("inf")
        # and at least one whole layer recomputes, whatever the LP's fraction
        return max(deficit / floor.heaviest_weight * min(prices), min(single))

    def least_need(self, layout: Layout, costs: MeshCosts, methods: tuple[Recompute, ...]) -> tuple[float, dict]:
        """Peak memory of the layout with every block at the least-memory recomputation of `methods` (those
        its leaf may use: no full recomputation beside combined 1F1B), evenly staged: a need some real plan
        has, where the floor only bounds it from below."""
        least = replace(layout, recompute=max(methods, key=MEMORY_RANK.get), layer_recompute=None, stage_layers=None,
                        recompute_modules=self._least_memory_modules(layout))
        same = least.recompute_modules == layout.recompute_modules
        fullest = max(estimate(self.model, self.cluster, least, self.stack, mesh_costs=costs if same else None
                               ).stage_memory, key=lambda stage: stage.total)
        return fullest.total, fullest.parts()
