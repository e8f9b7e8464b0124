"""Activation offloading (`Layout.offload_layers`): what copying the first N blocks' saved activations to host
memory frees on the device and costs in time.

Megatron-Core's --cpu-offloading-num-layers N runs Transformer Engine's CPU offload context over the blocks
(megatron/core/transformer/transformer_block.py, get_cpu_offload_context): in forward, block i's saved tensors
are copied to host memory on a side stream while block i + 1 computes, and freed when the copy is done; in
backward, block i's come back while block i + 1's backward runs. So at the activation peak (the start of
backward) the device holds the blocks not offloaded plus one offloaded block in flight, and a copy costs time
only where it outlasts the pass it runs beside. Copies run over the device's host link
(`Device.host_link_gbytes_per_s`, per direction); the forward's copies and the backward's are not concurrent.
TransformerConfig allows it at pp = 1 without recomputation (planner/rules/stack.py), so one stage holds every
block and one micro-batch's activations are in flight.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layer_costs import MeshCosts
from .layer_records import RECOMPUTE_INDEX, LayerCost
from .layout import Recompute


@dataclass(frozen=True)
class OffloadCost:
    """N offloaded blocks' effect on one micro-batch: bytes off the device, the one in flight, exposed copies."""
    layers: int
    host_bytes: float          # saved activations held in host memory at the peak (per device)
    in_flight_bytes: float     # the largest offloaded block's, still on the device while its copy runs
    exposed_s: float           # per micro-batch: copies beyond the passes they run beside


NO_OFFLOAD = OffloadCost(0, 0.0, 0.0, 0.0)


def _blocks(costs: MeshCosts) -> list[LayerCost]:
    model = costs.model
    return [costs.layer(model.kind(name)) for name in model.blocks]


def saved_bytes(cost: LayerCost) -> float:
    """A block's saved-for-backward bytes per micro-batch without recomputation (what offloading moves)."""
    return cost.activation_bytes[RECOMPUTE_INDEX[Recompute.none]]


def offload_cost(costs: MeshCosts, layers: int) -> OffloadCost:
    """The first `layers` blocks offloaded (fewer than the model's blocks: each copy runs beside a next block)."""
    if layers <= 0:
        return NO_OFFLOAD
    link = costs.cluster.device.host_link_gbytes_per_s * 1e9
    blocks = _blocks(costs)
    sizes = [saved_bytes(b) for b in blocks[:layers]]
    exposed = 0.0
    for size, beside in zip(sizes, blocks[1:layers + 1]):
        copy_s = size / link   # one direction of the host link (PCIe or NVLink-C2C)
        # device-to-host beside the next block's forward, host-to-device beside its backward
        exposed += max(0.0, copy_s - beside.forward_s) + max(0.0, copy_s - beside.backward_s)
    return OffloadCost(layers, sum(sizes), max(sizes), exposed)


def freed_bytes(sizes: list[float]) -> float:
    """What offloading blocks of these saved sizes frees on the device at the peak: all of them but one in flight,
    the largest at most."""
    return sum(sizes) - max(sizes, default=0.0)


def least_offload(costs: MeshCosts, deficit_bytes: float) -> OffloadCost | None:
    """The fewest offloaded blocks that free `deficit_bytes` (the copies only add time, so fewer is faster);
    None where even all but the last block do not, or where the fewest overfill the host memory
    (`Device.host_memory_bytes`: more blocks only hold more there)."""
    if deficit_bytes <= 0:
        return NO_OFFLOAD
    sizes = [saved_bytes(b) for b in _blocks(costs)[:-1]]
    host = costs.cluster.device.host_memory_bytes or 0.0
    total, largest = 0.0, 0.0
    for count, size in enumerate(sizes, start=1):
        total, largest = total + size, max(largest, size)   # `freed_bytes` of the first `count`, kept running
        if total > host:
            return None
        if total - largest >= deficit_bytes:
            return offload_cost(costs, count)
    return None
