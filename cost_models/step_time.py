"""Step time, throughput, MFU and memory of a fully specified layout, as sums of named parts."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from hardware_profiles.schema import Cluster

from .layer_costs import MeshCosts
from .layer_records import LayerCost
from hardware_profiles.loader import load_stack
from hardware_profiles.stack import SoftwareStack

from .layout import Layout, Recompute
from .memory import (ModelStateBytes, StageMemory, gradients_held_at_peak, logits_bytes, loss_gradient_bytes,
                     usable_bytes)
from .pipeline import (RankPasses, dualpipev_seconds, even_partition, in_flight_micro_batches,
                       p2p_transfers_on_critical_path, pipeline_seconds)
from .offload import offload_cost
from .records import ModelCosts
from .stage_terms import LayerTerms, TermContext, terms_sum


@dataclass(frozen=True)
class StepBreakdown:
    """Named parts that add up to the step time (seconds)."""
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float
    zero_comm_s: float
    pipeline_bubble_s: float
    pp_comm_s: float
    dp_comm_s: float
    optimizer_s: float
    host_s: float = 0.0   # the host issuing kernels slower than the device runs them (cost_models/host_time.py)
    offload_s: float = 0.0   # activation copies to and from host memory beyond the passes beside them (offload.py)

    @property
    def total_s(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    step_time_s: float
    breakdown: StepBreakdown
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    hfu: float
    stage_memory: tuple[StageMemory, ...]
    stage_layers: tuple[int, ...]
    layer_recompute: tuple[Recompute, ...]

    @property
    def peak_memory_bytes(self) -> float:
        return max(stage.total for stage in self.stage_memory)

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stage_memory)


@dataclass(frozen=True)
class StageTotals:
    work_s: float
    compute_s: float
    recompute_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    zero_s: float
    host_s: float
    memory: StageMemory
    dp_reduce_s: float
    optimizer_s: float
    passes: RankPasses | None   # per micro-batch, for DualPipeV's critical path (None under other schedules)


def chunk_blocks(stage_layers: tuple[int, ...]) -> list[range]:
    ranges, start = [], 0
    for count in stage_layers:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_totals(costs: MeshCosts, stage: int, block_ids: list[int], recompute: tuple[Recompute, ...],
                 with_embedding: bool, with_head: bool, micro_batches: int) -> StageTotals:
    """The stage's terms (`stage_terms.LayerTerms`) summed over its blocks, the embedding and the head, and its
    memory as named parts."""
    model, lay = costs.model, costs.layout
    context = TermContext.of(costs)
    # (layer, method, how many): blocks of one kind and method cost alike
    groups = Counter((model.blocks[b], recompute[b]) for b in block_ids)
    items: list[tuple[LayerCost, Recompute, int]] = [(costs.layer(model.kind(name)), r, n)
                                                     for (name, r), n in groups.items()]
    if with_embedding:
        items.append((costs.layer(model.embedding), Recompute.none, 1))
    if with_head:
        items.append((costs.layer(model.head), Recompute.none, 1))
    sums = terms_sum((LayerTerms.of(c, r, context), n) for c, r, n in items)
    in_flight = in_flight_micro_batches(stage, lay.pp, micro_batches, lay.vp, costs.stack.hides_moe_a2a(lay),
                                        lay.dualpipev)
    working = max((c.working_bytes for c, r, _ in items if r is not Recompute.none), default=0.0)
    states = sum((n * c.states for c, _, n in items), ModelStateBytes(0.0, 0.0, 0.0))
    loss = costs.stack.loss_gradient
    memory = StageMemory(
        stage=stage, weights=states.weights, gradients=states.gradients, optimizer=states.optimizer,
        activations=in_flight * sums.activation_bytes,
        logits=logits_bytes(model.head, lay.tp, lay.cp, lay.micro_batch, loss) if with_head else 0.0,
        loss_gradient=loss_gradient_bytes(model.head, lay.tp, lay.cp, lay.micro_batch, loss) if with_head else 0.0,
        recompute_working=working, comm_buffers=costs.comm_buffer_bytes, capacity=usable_bytes(costs.cluster.device),
        gradients_held=gradients_held_at_peak(costs.stack.gradient_buffer_in(lay), micro_batches))
    # what DualPipeV's critical path reads beside the steady state's work
    passes = RankPasses(paired_s=sums.work_s, alone_s=sums.alone_s, bubble_s=sums.bubble_s) if lay.dualpipev else None
    return StageTotals(work_s=sums.work_s, compute_s=sums.compute_s, recompute_s=sums.recompute_s, passes=passes,
                       tp_s=sums.tp_s, cp_s=sums.cp_s, ep_s=sums.ep_s, zero_s=sums.zero_s, host_s=sums.host_s,
                       memory=memory, dp_reduce_s=sums.dp_reduce_s, optimizer_s=sums.optimizer_s)


def physical_stages(costs: MeshCosts, stage_layers: tuple[int, ...], recompute: tuple[Recompute, ...]) -> list[StageTotals]:
    """Chunk j of the pp * vp chunks runs on stage `Layout.chunk_rank(j)`: j mod pp (interleaved), or the V."""
    lay = costs.layout
    ranges = chunk_blocks(stage_layers)
    chunks = len(stage_layers)
    stages = []
    for stage in range(lay.pp):
        owned = [j for j in range(chunks) if lay.chunk_rank(j) == stage]
        blocks = [b for j in owned for b in ranges[j]]
        stages.append(stage_totals(costs, stage, blocks, recompute, 0 in owned, chunks - 1 in owned,
                                   lay.num_micro_batches))
    return stages


def estimate(model: ModelCosts, cluster: Cluster, layout: Layout, stack: SoftwareStack | None = None,
             ep_imbalance: float = 1.0, mesh_costs: MeshCosts | None = None) -> Estimate:
    """Predict one training step of `layout` (partition and recomputation default to even / uniform) under
    `stack` (the mesh costs' stack where given; else Megatron-Core's defaults, `DEFAULT_STACK`)."""
    costs = mesh_costs or MeshCosts(model, cluster, layout, stack or load_stack(), ep_imbalance)
    num_blocks = len(model.blocks)
    stage_layers = layout.stage_layers or even_partition(num_blocks, layout.pp * layout.vp)
    recompute = layout.block_recompute(stage_layers)
    stages = physical_stages(costs, stage_layers, recompute)
    offload = offload_cost(costs, layout.offload_layers)
    if offload.layers:   # at pp = 1 (the rulebook's): one stage, one micro-batch's activations in flight
        if layout.pp != 1:
            raise ValueError(f"offload_layers={layout.offload_layers} with pp={layout.pp}: offloading runs at pp=1")
        held = stages[0].memory
        stages[0] = replace(stages[0], memory=replace(
            held, activations=held.activations - offload.host_bytes, offload_in_flight=offload.in_flight_bytes,
            host_bytes=offload.host_bytes, host_capacity=cluster.device.host_memory_bytes or 0.0))
    m = layout.num_micro_batches
    if layout.dualpipev:
        pipeline = dualpipev_seconds([s.passes for s in stages], m)
    else:
        pipeline = pipeline_seconds([s.work_s for s in stages], m, layout.vp)
    slowest = max(stages, key=lambda s: s.work_s)
    pp_comm = p2p_transfers_on_critical_path(layout.pp, layout.vp, layout.dualpipev) * costs.p2p_s()
    dp_exposed = max(costs.dp_exposed_s(s.dp_reduce_s, s.compute_s) for s in stages)
    optimizer = max(s.optimizer_s for s in stages)
    breakdown = StepBreakdown(
        compute_s=m * slowest.compute_s, recompute_s=m * slowest.recompute_s, tp_comm_s=m * slowest.tp_s,
        cp_comm_s=m * slowest.cp_s, ep_comm_s=m * slowest.ep_s, zero_comm_s=m * slowest.zero_s,
        pipeline_bubble_s=pipeline - m * slowest.work_s, pp_comm_s=pp_comm, dp_comm_s=dp_exposed,
        optimizer_s=optimizer, host_s=m * slowest.host_s, offload_s=m * offload.exposed_s)
    step = breakdown.total_s
    tokens = layout.global_batch * model.seq_len
    model_flops = model.model_flops_per_sample * layout.global_batch
    recompute_flops = layout.global_batch * sum(
        n * _recompute_flops(costs.layer(model.kind(name)), r)
        for (name, r), n in Counter(zip(model.blocks, recompute)).items())
    peak = cluster.device.peak_flops("bf16") * layout.world_size
    return Estimate(layout=layout, step_time_s=step, breakdown=breakdown, tokens_per_s=tokens / step,
                    tflops_per_device=model_flops / step / layout.world_size / 1e12,
                    mfu=model_flops / step / peak, hfu=(model_flops + recompute_flops) / step / peak,
                    stage_memory=tuple(s.memory for s in stages), stage_layers=tuple(stage_layers),
                    layer_recompute=tuple(recompute))


def _recompute_flops(cost: LayerCost, recompute: Recompute) -> float:
    """Matmul FLOPs per sample that recomputation repeats (HFU counts them, MFU does not)."""
    if recompute is Recompute.full:
        return cost.forward_flops_model
    if recompute is Recompute.selective:
        return cost.selective_forward_flops
    return 0.0
