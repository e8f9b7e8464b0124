"""Branch and bound over meshes, micro-batches, ZeRO stages and virtual stages, CP-SAT inside.

Candidates are ordered by a lower bound on their step time (compute and exposed per-layer
communication of a perfectly balanced pipeline, no recomputation); a candidate whose bound cannot beat
the K-th best plan so far is pruned, as is one whose memory floor (model states of a perfectly split
model plus fully recomputed activations) exceeds the device. The rest go to the partition solver.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.compute import ShardSpec, layer_compute
from cost_models.layer_costs import MeshCosts
from cost_models.layout import Layout, OverlapModel, Recompute
from cost_models.memory import StateSharding, activation_bytes, model_state_bytes, usable_bytes
from cost_models.pipeline import p2p_transfers_on_critical_path
from cost_models.records import ModelCosts
from cost_models.step_time import Estimate, estimate
from hardware_profiles.schema import Cluster

from .solver import PartitionResult, solve_partition
from .space import Pins, candidate_layouts


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


def _balanced_bound(costs: MeshCosts, layout: Layout) -> float:
    """Step time of a perfectly balanced pipeline with no recomputation and no DP exposure."""
    model = costs.model
    total = sum(n * costs.layer(kind).work_s(Recompute.none) for kind, n in model.block_counts)
    edges = (costs.layer(model.embedding), costs.layer(model.head))
    total += sum(c.work_s(Recompute.none) for c in edges)
    # the slowest stage's DP exposure and optimizer step are at least the stages' mean (max >= mean)
    def mean(attribute: str) -> float:
        return (sum(n * getattr(costs.layer(kind), attribute) for kind, n in model.block_counts)
                + sum(getattr(c, attribute) for c in edges)) / layout.pp
    compute = mean("forward_s") + mean("backward_s")
    dp = max(0.0, costs.dp_comm_s(mean("grad_reduce_bytes"), mean("expert_grad_reduce_bytes"))
             - costs.overlap.dp_window_fraction * compute)
    optimizer = costs.optimizer_s(mean("optimizer_params"))
    return (_pipeline_bound(total, layout) + p2p_transfers_on_critical_path(layout.pp, layout.vp) * costs.p2p_s()
            + dp + optimizer)


def _pipeline_bound(total_work_s: float, layout: Layout) -> float:
    """pipeline_seconds with max W_i at its least possible value, the mean."""
    p, v, m = layout.pp, layout.vp, layout.num_micro_batches
    return (m - 1) * total_work_s / p + (total_work_s + (v - 1) * total_work_s / p) / v


class _Bounds:
    """Cheap bounds shared across candidates: compute-only work and the memory floor."""

    def __init__(self, model: ModelCosts, cluster: Cluster, overlap: OverlapModel, allowed: tuple[Recompute, ...]):
        self.model, self.device, self.overlap = model, cluster.device, overlap
        self.cheapest = min(allowed, key=lambda r: {Recompute.none: 2, Recompute.selective: 1, Recompute.full: 0}[r])
        self.work: dict[tuple, float] = {}
        self.activations: dict[tuple, float] = {}

    def compute_work_s(self, layout: Layout) -> float:
        spec = ShardSpec(tp=layout.tp, sp=layout.sp, cp=layout.cp, micro_batch=layout.micro_batch,
                         precision=layout.precision, causal_attention_work=self.overlap.causal_attention_work)
        if spec not in self.work:
            model = self.model
            total = sum(n * layer_compute(kind, self.device, spec).forward_s
                        + n * layer_compute(kind, self.device, spec).backward_s for kind, n in model.block_counts)
            for kind in (model.embedding, model.head):
                compute = layer_compute(kind, self.device, spec)
                total += compute.forward_s + compute.backward_s
            self.work[spec] = total
        return self.work[spec]

    def memory_floor(self, layout: Layout) -> tuple[float, dict]:
        """Least memory any partition needs on its fullest stage: states split evenly, cheapest activations."""
        sharding = StateSharding(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp_cp=layout.dp * layout.cp,
                                 expert_dp=layout.expert_data_parallel, zero=layout.zero)
        states = sum(n * model_state_bytes(kind, sharding).total for kind, n in self.model.block_counts)
        key = (layout.tp, layout.sp, layout.cp, layout.micro_batch)
        if key not in self.activations:
            self.activations[key] = sum(n * activation_bytes(kind, self.cheapest, *key)
                                        for kind, n in self.model.block_counts)
        flight = min(layout.pp, layout.num_micro_batches)
        parts = {"model_states": states / layout.pp, "activations": flight * self.activations[key] / layout.pp}
        return sum(parts.values()), parts


def _rank_key(scored: Scored) -> tuple:
    """Fastest first; among equal times (6 significant digits) the simpler layout: fewer context, pipeline
    and tensor ranks, lower ZeRO stage, larger micro-batch."""
    lay = scored.estimate.layout
    return (float(f"{scored.estimate.step_time_s:.6g}"), lay.cp, lay.pp * lay.vp, lay.tp, lay.ep, lay.etp, lay.zero,
            -lay.micro_batch, lay.short())


def search(model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins = Pins(),
           precision: str = "bf16", time_limit_s: float = 60.0, top_k: int = 3,
           overlap: OverlapModel = OverlapModel(), ep_imbalance: float = 1.0, graph=None,
           progress=None, recompute_choices: tuple[Recompute, ...] | None = None) -> SearchOutcome:
    start = time.perf_counter()
    allowed = recompute_choices or ((pins.recompute,) if pins.recompute else tuple(Recompute))
    layouts = candidate_layouts(graph, cluster.num_devices, global_batch, pins, precision,
                                cluster.fast_domain_devices)
    capacity = usable_bytes(cluster.device)
    bounds = _Bounds(model, cluster, overlap, allowed)
    ordered = sorted(((_pipeline_bound(bounds.compute_work_s(lay), lay), lay.short(), lay) for lay in layouts),
                     key=lambda item: item[:2])
    smallest, smallest_parts = float("inf"), {}
    ranked: list[Scored] = []
    pruned_memory = pruned_bound = solved = unexplored = 0
    compute_cache: dict = {}
    for position, (cheap, _, layout) in enumerate(ordered):
        if progress:
            progress(position + 1, len(ordered))
        kth = ranked[top_k - 1].estimate.step_time_s if len(ranked) >= top_k else float("inf")
        remaining = time_limit_s - (time.perf_counter() - start)
        if cheap >= kth:  # sorted by this bound: nothing later can do better
            pruned_bound += len(ordered) - position
            break
        if remaining <= 0:
            unexplored = len(ordered) - position
            break
        floor, parts = bounds.memory_floor(layout)
        if floor < smallest:
            smallest, smallest_parts = floor, parts
        if floor > capacity:
            pruned_memory += 1
            continue
        costs = MeshCosts(model, cluster, layout, overlap, ep_imbalance, compute_cache)
        if _balanced_bound(costs, layout) >= kth:
            pruned_bound += 1
            continue
        cutoff = kth - p2p_transfers_on_critical_path(layout.pp, layout.vp) * costs.p2p_s()
        # one hard candidate may not eat the budget: it gets a share, and reports its gap if cut short
        result = solve_partition(costs, allowed, time_limit_s=min(remaining, max(1.0, time_limit_s / 30)),
                                 cutoff_s=cutoff)
        solved += 1
        if not result.stage_layers:
            continue
        full = replace(layout, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute)
        scored = Scored(estimate(model, cluster, full, overlap, ep_imbalance, mesh_costs=costs), result)
        if scored.estimate.fits:
            ranked.append(scored)
            ranked.sort(key=_rank_key)
            ranked = ranked[: max(top_k, 1)]
    if not ranked:  # report the least memory any candidate needs
        for _, _, layout in ordered:
            floor, parts = bounds.memory_floor(layout)
            if floor < smallest:
                smallest, smallest_parts = floor, parts
    return SearchOutcome(tuple(ranked), len(layouts), pruned_memory, pruned_bound, solved,
                         time.perf_counter() - start, unexplored, smallest, smallest_parts)
