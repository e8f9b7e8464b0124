"""The data-parallel part of one layout's costs: the per-step gradient reduction and parameter all-gather, the
optimizer step, and ZeRO-2/3's traffic per micro-batch with what hides it.

`DataParallelCommunication` is a part of `MeshCosts` (cost_models/layer_costs.py), which gives it the layout, the
stack, the state sharding and the collective times.
"""
from __future__ import annotations

from functools import cached_property
from math import ceil

from .communication import Collective
from .compute import memory_seconds
from .layer_records import StepParts
from .memory import WEIGHT_BYTES, adam_bytes_touched, optimizer_state_bytes_per_param, params_on_rank
from .layout import RecomputeModule
from .records import LayerKind, OpKind, Sharding, joins_previous_projection


class DataParallelCommunication:
    """The data-parallel part of `MeshCosts`."""

    def step_parts(self, kind: LayerKind) -> StepParts:
        """The parts of a layer's cost that its ZeRO stage sets: its share of the per-step reduction, its optimizer
        step, and the ZeRO-2/3 traffic per micro-batch with the compute that hides it. The search bounds a
        placement's ZeRO stages by them without the layer's memory (`planner.search.bounds.ZeroExtras`)."""
        lay = self.layout
        dense_params, expert_params = params_on_rank(kind, self.state_sharding)
        optimizer_params = dense_params / self.state_sharding.dp_cp + expert_params / self.state_sharding.expert_dp \
            if lay.zero >= 1 else dense_params + expert_params
        grad_bytes, expert_grad_bytes = dense_params * lay.gradient_bytes, expert_params * lay.gradient_bytes
        (_, dense_slope), (_, expert_slope) = self.dp_lines
        compute = self.compute_of(kind)
        traffic = self.sharded_dp_comm_s(kind) if lay.zero >= 2 else 0.0
        hidden = lay.zero < 3 or self.stack.zero3_traffic_hidden
        return StepParts(dense_slope * grad_bytes + expert_slope * expert_grad_bytes,
                         self.optimizer_s(optimizer_params), traffic, compute.forward_s + compute.backward_s, hidden,
                         self.regather_s(kind))

    def optimizer_s(self, params: float) -> float:
        """The update of `params` optimizer-local parameters; where the stack swaps the states to host, each
        chunk is copied in and out over the host link (both directions at once) beside the update of the one
        before it, so the slower of the two paces the step, plus the first chunk's copy, which nothing hides."""
        update = memory_seconds(self.cluster.device, params * adam_bytes_touched(self.state_sharding))
        chunks = self.state_sharding.optimizer_swap_chunks
        if not chunks:
            return update
        link = self.cluster.device.host_link_gbytes_per_s * 1e9
        copy = params * optimizer_state_bytes_per_param(self.state_sharding) / link
        return max(update, copy) + copy / chunks

    @cached_property
    def dp_lines(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(latency, seconds per byte) of the per-step gradient reduction for dense and expert gradients,
        taken at the size of one stage's share so that stage cost stays linear in its layers."""
        lay = self.layout
        counts = self.model.block_counts
        dense = sum(n * params_on_rank(k, self.state_sharding)[0] for k, n in counts) * lay.gradient_bytes / lay.pp
        expert = sum(n * params_on_rank(k, self.state_sharding)[1] for k, n in counts) * lay.gradient_bytes / lay.pp
        return self._line(max(dense, 1.0), "dpcp"), self._line(max(expert, 1.0), "edp") if expert else (0.0, 0.0)

    def _line(self, size: float, dim: str) -> tuple[float, float]:
        """Once per step: ZeRO-0 all-reduces gradients; ZeRO-1 reduce-scatters them, as ZeRO-2/3 do where they
        accumulate unsharded; ZeRO-1 and 2 all-gather the updated bf16 weights; ZeRO-2/3 reduce gradients per
        micro-batch otherwise (sharded_dp_comm_s)."""
        lay = self.layout
        latency = per_byte = 0.0
        if lay.zero <= 1 or self.state_sharding.unsharded_gradients:
            op = Collective.all_reduce if lay.zero == 0 else Collective.reduce_scatter
            cost = self.collective(op, size, dim)
            per_byte, latency = cost.bandwidth_seconds / size, cost.latency_seconds
        if lay.zero == 1 or (lay.zero == 2 and not self.stack.gathers_per_micro_batch(lay)):
            # bf16 parameter all-gather after the optimizer step
            gather = self.collective(Collective.all_gather, size * WEIGHT_BYTES / lay.gradient_bytes, dim)
            per_byte += gather.bandwidth_seconds / size
            latency += gather.latency_seconds
        return latency, per_byte

    @cached_property
    def dp_latency_s(self) -> float:
        """The per-step reduction's latency, paid by every stage whatever its layers."""
        (a_dense, _), (a_expert, _) = self.dp_lines
        return a_dense + a_expert

    def dp_exposed_s(self, reduce_s: float, compute_s: float) -> float:
        """A stage's per-step reduction (latency plus its layers' `dp_reduce_s`) not hidden behind the last
        micro-batch's compute (Megatron overlap_grad_reduce). The estimate, the solver and the search
        bound all use this form: it is linear in the layers up to the max with 0."""
        return max(0.0, self.dp_latency_s + reduce_s - self.stack.dp_window_fraction * compute_s)

    def sharded_dp_comm_s(self, kind: LayerKind) -> float:
        """Per micro-batch and layer: ZeRO-2/3 reduce-scatter the gradients (unless the stack accumulates them
        unsharded, reducing once per step: `_line`); ZeRO-3 (FSDP) also all-gathers the bf16 weights for forward
        and again for backward, and ZeRO-2 for forward where the stack reshards after backward
        (`SoftwareStack.gathers_per_micro_batch`; tests/test_precision_memory.py counts both in torch)."""
        seconds = 0.0
        per_micro_batch = not self.state_sharding.unsharded_gradients
        dense_params, expert_params = params_on_rank(kind, self.state_sharding)
        for params, dim, calls in ((dense_params, "dpcp", self._collectives_per_layer(kind, expert=False)),
                                   (expert_params, "edp", self._collectives_per_layer(kind, expert=True))):
            if not params:
                continue
            if per_micro_batch:
                seconds += self._split_collective_s(Collective.reduce_scatter, params * self.layout.gradient_bytes,
                                                    dim, calls)
            if self.layout.zero >= 3 or self.stack.gathers_per_micro_batch(self.layout):
                gathers = 2 if self.layout.zero >= 3 else 1   # ZeRO-2: the forward's, kept for the backward
                seconds += gathers * self._split_collective_s(Collective.all_gather, params * 2, dim, calls)
        return seconds

    def regather_s(self, kind: LayerKind) -> float:
        """Under full recomputation, the all-gathers of the parameters a ZeRO-3 stack releases between a module's
        recomputed forward and its backward (`SoftwareStack.zero3_reuse_distance_params`): 0 where it keeps them."""
        distance = self.stack.zero3_reuse_distance_params
        if self.layout.zero < 3 or distance is None:
            return 0.0
        params, tensors = regathered_dense(kind, distance, self.stack.fused_projections, self.layout.tp)
        if not params:
            return 0.0
        calls = tensors if self.stack.zero3_collectives == "per_tensor" else 1
        return self._split_collective_s(Collective.all_gather, params * WEIGHT_BYTES, "dpcp", max(1, calls))

    def _collectives_per_layer(self, kind: LayerKind, expert: bool) -> int:
        """The collectives one layer's dense (or expert) parameters take each way: one, or under ZeRO-3 where the
        stack issues one per parameter tensor (`SoftwareStack.zero3_collectives`), the tensors a rank holds."""
        if self.layout.zero < 3 or self.stack.zero3_collectives != "per_tensor":
            return 1
        dense, experts = param_tensors_on_rank(kind, self.stack.fused_projections, self.layout.ep)
        return max(1, experts if expert else dense)

    def _split_collective_s(self, op: Collective, size: float, dim: str, calls: int) -> float:
        """`size` bytes moved by `calls` collectives, taken as equal shares: each pays a collective's latency, and a
        ring's bandwidth term, linear in bytes, sums to the whole's."""
        return calls * self.collective(op, size / calls, dim).seconds


def param_tensors_on_rank(kind: LayerKind, fused_projections: bool, ep: int) -> tuple[int, int]:
    """(dense, expert) parameter tensors of one layer that a rank holds: every dense tensor (tp splits each, leaving
    a piece of each on every rank), the projections reading one input as one where the stack fuses them
    (Megatron's linear_qkv: q, k and v's weights one tensor, their biases another), the expert tensors over ep (a
    rank holds its experts' tensors, or a slice of stacked ones)."""
    projections = kind.param_tensors_by(Sharding.tensor)
    if fused_projections:
        projections = round(projections / kind.projections_per_input)
    experts = kind.param_tensors_by(Sharding.expert)
    return projections + kind.param_tensors_by(Sharding.sequence), ceil(experts / ep) if experts else 0


def regathered_dense(kind: LayerKind, reuse_distance_params: float, fused_projections: bool, tp: int
                     ) -> tuple[float, int]:
    """(parameters, tensors) of one layer's dense modules that a rank gathers again for the backward after its
    recomputed forward, where the stack keeps a module's parameters only while fewer than `reuse_distance_params`
    are fetched before their next use (DeepSpeed v0.3.15 stage3.py _keep_for_later over its module trace). Between
    a module's recomputed forward and its backward run the recomputed forward and the backward of every module after
    it in its layer, so a module is kept only where twice their parameters (on the rank: tp splits the projections)
    fall short of the distance: the last module always, those before it as the sum allows. The modules: the norms
    (sharing the replicated parameters and tensors) and the GEMM modules (sharing the projections' tensors; q, k and
    v one where the stack fuses them), in forward order; expert modules are left out (no stack that releases them
    runs experts)."""
    norms = sum(1 for op in kind.ops if op.module is RecomputeModule.layernorm and op.kind is not OpKind.gemm)
    modules: list[list] = []   # [the module's last op, parameters on the rank, tensors or None for a GEMM module]
    for op in kind.ops:
        if op.module is RecomputeModule.layernorm and op.kind is not OpKind.gemm:
            modules.append([op, kind.params_by(Sharding.sequence) / norms, kind.param_tensors_by(Sharding.sequence)
                            / norms])
        elif op.kind is OpKind.gemm and op.sharding is not Sharding.expert:
            params = op.weight_bytes / WEIGHT_BYTES / (tp if op.sharding is Sharding.tensor else 1)
            if fused_projections and modules and joins_previous_projection(modules[-1][0], op):
                modules[-1][0:2] = [op, modules[-1][1] + params]   # q, k and v as one module (Megatron's linear_qkv)
            else:
                modules.append([op, params, None])
    gemms = sum(1 for module in modules if module[2] is None)
    dense, _ = param_tensors_on_rank(kind, fused_projections, 1)
    per_gemm = (dense - kind.param_tensors_by(Sharding.sequence)) / gemms if gemms else 0.0
    later, kept = 0.0, 0
    for _, params, _ in reversed(modules):
        if 2 * later >= reuse_distance_params:
            break
        kept += 1
        later += params
    released = modules[:len(modules) - kept]
    tensors = sum(per_gemm if module_tensors is None else module_tensors for _, _, module_tensors in released)
    return sum(params for _, params, _ in released), round(tensors)
