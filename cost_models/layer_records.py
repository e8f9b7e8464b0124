"""The per-layer, per-micro-batch cost records `layer_costs.MeshCosts` builds and the search, the step-time
estimate and the stage terms read: a layer's work before ZeRO, the parts its ZeRO stage sets, and the whole
record with memory, each by recomputation method in RECOMPUTE_ORDER.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout import Recompute
from .memory import ModelStateBytes

RECOMPUTE_ORDER = (Recompute.none, Recompute.selective, Recompute.full)
RECOMPUTE_INDEX = {method: i for i, method in enumerate(RECOMPUTE_ORDER)}   # none, selective, full: least memory last


@dataclass(frozen=True)
class LayerWork:
    """One layer's time for one micro-batch on one rank, before ZeRO-2/3 traffic."""
    forward_s: float
    backward_s: float
    recompute_s: tuple[float, float, float]        # by RECOMPUTE_ORDER
    tp_comm_s: float                               # exposed, forward + backward
    cp_comm_s: float
    ep_comm_s: float                               # as the steady state pays it (hidden where passes pair)
    module_recompute_s: tuple[float, ...]          # what recomputing each module repeats, RecomputeModule order
    backward_weight_s: float                       # the weight-gradient part of backward_s
    ep_comm_alone_s: float                         # the all-to-alls of a forward and backward run alone
    # what the host's issuing of the forward and backward takes beyond the device's work (cost_models/host_time.py)
    host_excess_s: float

    def work_before_zero_s(self, recompute: Recompute) -> float:
        return self.work_but_all_to_alls_s(recompute) + self.ep_comm_s

    def work_but_all_to_alls_s(self, recompute: Recompute) -> float:
        """`work_before_zero_s` less the all-to-alls: the part that no pipeline schedule changes."""
        return (self.forward_s + self.backward_s + self.recompute_s[RECOMPUTE_INDEX[recompute]]
                + self.tp_comm_s + self.cp_comm_s + self.host_excess_s)

    @property
    def unpaired_extra_s(self) -> float:
        """What a forward and backward run alone pay beyond the steady state's pair (DualPipeV's warm-up and
        cooldown): the all-to-alls the pair hid."""
        return self.ep_comm_alone_s - self.ep_comm_s

    def backward_alone_s(self, recompute: Recompute) -> float:
        """The backward run alone: its compute, recomputation and its half of the exposed communication
        (forward and backward each run the layer's collectives once)."""
        return (self.backward_s + self.recompute_s[RECOMPUTE_INDEX[recompute]]
                + (self.tp_comm_s + self.cp_comm_s + self.ep_comm_alone_s) / 2)


@dataclass(frozen=True)
class StepParts:
    """What a layer's ZeRO stage sets of its cost (`MeshCosts.step_parts`)."""
    dp_reduce_s: float          # its share of the per-step dp reduction (its slope)
    optimizer_step_s: float     # its optimizer step on this rank
    zero_traffic_s: float       # ZeRO-2/3 per-micro-batch traffic (`MeshCosts.sharded_dp_comm_s`)
    compute_s: float            # the layer's forward and backward, which hide that traffic
    hidden: bool = True         # whether compute runs beside the traffic (`SoftwareStack.zero3_traffic_hidden`)
    # under full recomputation, the parameters gathered again between the recomputed forward and the backward
    # (`SoftwareStack.zero3_reuse_distance_params`)
    regather_s: float = 0.0

    def zero_exposed_s(self, recompute_s: float, full: bool = False) -> float:
        """The traffic the layer's compute does not hide. Its recomputation hides it too: the recomputed forward
        runs inside the backward after the layer's pre-backward all-gather and gathers nothing itself
        (torch.distributed.fsdp._fully_shard._fsdp_state: _pre_forward returns early in PRE_BACKWARD; Megatron-Core's
        custom FSDP the same, docs/source/api-guide/custom_fsdp.md section 4.1 @1e057005), so it is compute on the
        compute stream beside the collective stream's gathers and reduce-scatters, as forward and backward are.
        Where the stack runs the traffic between compute (`hidden` false), all of it. Under full recomputation
        (`full`), with what it gathers again. Without `full` it is at or below any method's: what the search's
        bounds read."""
        traffic = self.zero_traffic_s + (self.regather_s if full else 0.0)
        if not self.hidden:
            return traffic
        return max(0.0, traffic - self.compute_s - recompute_s)

    def zero_exposed_by_method(self, recompute_s: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(self.zero_exposed_s(r, method is Recompute.full)
                     for r, method in zip(recompute_s, RECOMPUTE_ORDER))


@dataclass(frozen=True)
class LayerCost(LayerWork):
    """One layer, one micro-batch, one rank: time and memory."""
    activation_bytes: tuple[float, float, float]   # by RECOMPUTE_ORDER
    module_freed_bytes: tuple[float, ...]          # what recomputing each module alone frees, RecomputeModule
    #                                                order: additive, as each saved tensor has one maker
    working_bytes: float                           # a recomputed layer's activations, live during its backward
    states: ModelStateBytes
    grad_reduce_bytes: float                       # dense gradient bytes for the dp x cp reduction
    dp_reduce_s: float                             # this layer's share of the per-step dp reduction (its slope)
    optimizer_step_s: float                        # its optimizer step on this rank
    weight_bytes_unsharded: float                  # bf16 weights a ZeRO-3 all-gather materialises
    forward_flops_model: float                     # matmul forward FLOPs per sample: what full recompute repeats
    selective_forward_flops: float                 # matmul forward FLOPs per sample that selective repeats

    zero_exposed_s: tuple[float, float, float] = (0.0, 0.0, 0.0)   # ZeRO-2/3 per-micro-batch traffic not hidden
    #                                                by this layer, by RECOMPUTE_ORDER (`StepParts.zero_exposed_s`)
    weight_pass_recomputes: int = 0                # recomputations per split weight pass (the stack's
    #                                                dualpipev_weight_pass_recompute: its parameter groups)

    def work_s(self, recompute: Recompute) -> float:
        return self.work_before_zero_s(recompute) + self.zero_exposed_s[RECOMPUTE_INDEX[recompute]]

    def dualpipev_bubble_s(self, recompute: Recompute, weight_factor: int, split_factor: float = 0.0) -> float:
        """This layer's part of DualPipeV's bubble term A + B - kW (`cost_models.pipeline.dualpipev_seconds`):
        recomputation lengthens both the work alone and the backward, and, where split weight passes recompute
        once per parameter group, those passes (`split_factor`: `pipeline.dualpipev_split_recompute_factor`)."""
        return (self.work_s(recompute) + self.unpaired_extra_s + self.backward_alone_s(recompute)
                - weight_factor * self.backward_weight_s + split_factor * self.dualpipev_split_recompute_s(recompute))

    def dualpipev_split_recompute_s(self, recompute: Recompute) -> float:
        """What one split weight pass recomputes of this layer beyond a whole backward: its recomputation once per
        parameter group (`weight_pass_recomputes`; 0 where the stack's pass recomputes nothing more)."""
        return self.weight_pass_recomputes * self.recompute_s[RECOMPUTE_INDEX[recompute]]
