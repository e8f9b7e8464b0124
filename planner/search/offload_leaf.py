"""A leaf's second way to fit its memory: activation offloading (`Layout.offload_layers`) in place of
recomputation, where the stack runs it (pp = 1, no recomputation, no combined 1F1B; the rulebook's).

Its only decision is the number of blocks offloaded, and fewer is always faster (each copy only adds
exposed time), so the route's best is the fewest blocks that fit: found in closed form from the layout's
memory without recomputation (`cost_models.offload.least_offload`), no CP-SAT model needed. The leaf ranks
the faster of this and the partition solver's recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.layer_costs import MeshCosts
from cost_models.layout import Layout, Recompute
from cost_models.offload import least_offload, offload_cost
from cost_models.step_time import Estimate, estimate
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from ..rules.pins import Pins
from ..rules.stack import leaf_recompute_methods, recompute_choices
from .bounds import Bounds
from .partition import solve_partition


def can_offload(stack: SoftwareStack, cluster: Cluster) -> bool:
    """The stack offloads activations and replays no CUDA graphs (Megatron-Core refuses the two together), and the
    device profile gives the host link and memory to cost it."""
    device = cluster.device
    return stack.activation_offload and not stack.cuda_graphs and device.host_link_gbytes_per_s is not None \
        and device.host_memory_bytes is not None


def layout_offloads(layout: Layout, stack: SoftwareStack) -> bool:
    """The layout's shape allows offloading: pp = 1 and its MoE all-to-alls not paired by combined 1F1B."""
    return layout.pp == 1 and not stack.hides_moe_a2a(layout)


@dataclass(frozen=True)
class OffloadRoute:
    """Whether and how the search's leaves may offload activations."""
    allowed: bool          # the stack runs it, the device profile costs it (`can_offload`), no pin rules it out
    pinned: int | None     # offload_layers as pinned (None: chosen per leaf)

    @classmethod
    def of(cls, stack: SoftwareStack, cluster: Cluster, pins: Pins, recompute: tuple[Recompute, ...]) -> "OffloadRoute":
        pinned = pins.offload_layers
        allowed = (can_offload(stack, cluster) and pinned != 0 and Recompute.none in recompute
                   and pins.recompute_layers is None)
        return cls(allowed, pinned)

    def applies(self, layout: Layout, stack: SoftwareStack) -> bool:
        """The layout may offload (`layout_offloads`) and the search may weigh it."""
        return self.allowed and layout_offloads(layout, stack)

    def only(self, layout: Layout, stack: SoftwareStack) -> bool:
        """Offloading is pinned on: the leaf does not recompute."""
        return bool(self.pinned) and self.applies(layout, stack)


def route_extra_floor_s(bounds: Bounds, layout: Layout, costs: MeshCosts, capacity: float,
                        pinned: int | None) -> float:
    """At or below the exposed copies of any plan of the route: those of the fewest blocks that free the deficit
    of the memory floor without recomputation (the real deficit is at least that; exposed time only grows with
    the blocks offloaded)."""
    if pinned:
        return layout.num_micro_batches * offload_cost(costs, pinned).exposed_s
    needed = least_offload(costs, bounds.no_recompute_floor(layout) - capacity)
    return layout.num_micro_batches * needed.exposed_s if needed is not None else float("inf")


def offload_estimate(model, cluster: Cluster, layout: Layout, stack: SoftwareStack, ep_imbalance: float,
                     costs: MeshCosts, pinned: int | None) -> Estimate | None:
    """The leaf without recomputation, offloading the pinned blocks or the fewest that fit; None where it
    fits without offloading (the partition's plan then covers it) or cannot fit by it."""
    blocks = len(model.blocks)
    plain = replace(layout, stage_layers=(blocks,), layer_recompute=(Recompute.none,) * blocks, offload_layers=0)
    if pinned:
        chosen = pinned
    else:
        without = estimate(model, cluster, plain, stack, ep_imbalance, mesh_costs=costs)
        if without.fits:
            return None
        needed = least_offload(costs, without.peak_memory_bytes - without.stage_memory[0].capacity)
        if needed is None:
            return None
        chosen = needed.layers
    result = estimate(model, cluster, replace(plain, offload_layers=chosen), stack, ep_imbalance, mesh_costs=costs)
    return result if result.fits else None


def offload_alternative(model, cluster: Cluster, best: Estimate, stack: SoftwareStack,
                        ep_imbalance: float) -> tuple[bool, Estimate | None, float]:
    """Whether the stack and the device could offload the plan's layout, the plan's other way of fitting it (for its
    reasons: an offloading plan against the partition solver's recomputation of the same layout, a recomputing one
    at pp = 1 against the fewest offloaded layers that fit; None where that way does not fit), and the host bytes
    the plan offloads."""
    lay = best.layout
    if not (can_offload(stack, cluster) and layout_offloads(lay, stack)):
        return False, None, 0.0
    plain = replace(lay, offload_layers=0, stage_layers=None, layer_recompute=None)
    costs = MeshCosts(model, cluster, plain, stack, ep_imbalance)
    if not lay.offload_layers:
        recomputes = any(r is not Recompute.none for r in best.layer_recompute)
        twin = offload_estimate(model, cluster, plain, stack, ep_imbalance, costs, None) if recomputes else None
        return True, twin, 0.0
    host_bytes = offload_cost(costs, lay.offload_layers).host_bytes
    methods = leaf_recompute_methods(stack, plain, recompute_choices(Pins(), stack))
    result = solve_partition(costs, methods, time_limit_s=10.0)
    if not result.stage_layers:
        return True, None, host_bytes
    recomputed = replace(plain, stage_layers=result.stage_layers, layer_recompute=result.layer_recompute,
                         recompute_modules=result.recompute_modules or lay.recompute_modules)
    return True, estimate(model, cluster, recomputed, stack, ep_imbalance), host_bytes


def offload_where_needed(model, cluster: Cluster, layout: Layout, stack: SoftwareStack, ep_imbalance: float) -> Layout:
    """A whole layout given without `offload_layers`, as the search would take it: without recomputation at pp = 1,
    where it does not fit on the device, offloading the fewest layers that fit (as given elsewhere)."""
    if not (can_offload(stack, cluster) and layout_offloads(layout, stack)) \
            or layout.recompute is not Recompute.none or layout.recompute_layers is not None \
            or any(r is not Recompute.none for r in layout.layer_recompute or ()):
        return layout
    costs = MeshCosts(model, cluster, layout, stack, ep_imbalance)
    chosen = offload_estimate(model, cluster, layout, stack, ep_imbalance, costs, None)
    return layout if chosen is None else replace(layout, offload_layers=chosen.layout.offload_layers)
