"""Branch and bound over meshes, micro-batches, ZeRO stages and virtual stages, CP-SAT inside.

Candidates are ordered by a lower bound on their step time (compute and exposed per-layer
communication of a perfectly balanced pipeline, no recomputation); a candidate whose bound cannot beat
the K-th best plan so far is pruned, as is one whose memory floor (model states of a perfectly split
model plus fully recomputed activations) exceeds the device. The rest go to the partition solver.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.layer_costs import MeshCosts
from cost_models.layout import Layout, OverlapModel, Recompute
from cost_models.memory import usable_bytes
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
    smallest_memory_need: float         # over all candidates (for infeasible requests)
    smallest_need_parts: dict
    best_effort: Layout | None


def _balanced_bound(costs: MeshCosts, layout: Layout) -> float:
    """Step time of a perfectly balanced pipeline with no recomputation and no DP exposure."""
    model = costs.model
    total = sum(costs.layer(model.kind(name)).work_s(Recompute.none) for name in model.blocks)
    total += costs.layer(model.embedding).work_s(Recompute.none) + costs.layer(model.head).work_s(Recompute.none)
    p, v, m = layout.pp, layout.vp, layout.num_micro_batches
    per_stage = total / p
    return (m - 1) * per_stage + (total + (v - 1) * per_stage) / v + \
        p2p_transfers_on_critical_path(p, v) * costs.p2p_s()


def _memory_floor(costs: MeshCosts, layout: Layout, allowed: tuple[Recompute, ...]) -> tuple[float, dict]:
    """Least memory any partition needs on its fullest stage: states split evenly, cheapest activations."""
    model = costs.model
    kinds = [model.kind(name) for name in model.blocks]
    states = sum(costs.layer(k).states.total for k in kinds) / layout.pp
    cheapest = min(allowed, key=lambda r: {Recompute.none: 2, Recompute.selective: 1, Recompute.full: 0}[r])
    index = {Recompute.none: 0, Recompute.selective: 1, Recompute.full: 2}[cheapest]
    flight = min(layout.pp, layout.num_micro_batches)
    activations = flight * sum(costs.layer(k).activation_bytes[index] for k in kinds) / layout.pp
    parts = {"model_states": states, "activations": activations, "comm_buffers": costs.comm_buffer_bytes}
    return sum(parts.values()), parts


def search(model: ModelCosts, cluster: Cluster, global_batch: int, pins: Pins = Pins(),
           precision: str = "bf16", time_limit_s: float = 60.0, top_k: int = 3,
           overlap: OverlapModel = OverlapModel(), ep_imbalance: float = 1.0, graph=None,
           progress=None) -> SearchOutcome:
    start = time.perf_counter()
    allowed = (pins.recompute,) if pins.recompute else (Recompute.none, Recompute.selective, Recompute.full)
    layouts = candidate_layouts(graph, cluster.num_devices, global_batch, pins, precision,
                                cluster.fast_domain_devices)
    capacity = usable_bytes(cluster.device)
    bounds = []
    smallest, smallest_parts, best_effort = float("inf"), {}, None
    pruned_memory = 0
    for layout in layouts:
        costs = MeshCosts(model, cluster, layout, overlap, ep_imbalance)
        floor, parts = _memory_floor(costs, layout, allowed)
        if floor < smallest:
            smallest, smallest_parts, best_effort = floor, parts, layout
        if floor > capacity:
            pruned_memory += 1
            continue
        bounds.append((_balanced_bound(costs, layout), layout, costs))
    bounds.sort(key=lambda item: (item[0], item[1].short()))
    ranked: list[Scored] = []
    pruned_bound = solved = 0
    for position, (bound, layout, costs) in enumerate(bounds):
        if progress:
            progress(position + 1, len(bounds))
        kth = ranked[top_k - 1].estimate.step_time_s if len(ranked) >= top_k else float("inf")
        remaining = time_limit_s - (time.perf_counter() - start)
        if bound >= kth or remaining <= 0:
            pruned_bound += 1
            continue
        result = solve_partition(costs, allowed, time_limit_s=min(remaining, 30.0))
        solved += 1
        if not result.stage_layers:
            continue
        full = replace(layout, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute)
        scored = Scored(estimate(model, cluster, full, overlap, ep_imbalance, mesh_costs=costs), result)
        if not scored.estimate.fits:
            continue
        ranked.append(scored)
        ranked.sort(key=lambda s: (round(s.estimate.step_time_s, 9), s.estimate.layout.short()))
        ranked = ranked[: max(top_k, 1)]
    return SearchOutcome(tuple(ranked), len(layouts), pruned_memory, pruned_bound, solved,
                         time.perf_counter() - start, smallest, smallest_parts, best_effort)
