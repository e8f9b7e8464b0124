"""What every export says the same way: recomputation counts and the notes shared by the targets."""
from __future__ import annotations

from hardware_profiles.loader import load_device
from hardware_profiles.stack_overlaps import cuda_device_max_connections

from ..plans import Plan


def _full_recompute_layers(plan: Plan) -> int:
    return sum(r == "full" for stage in plan.stages for r in stage.recompute)


def _full_layers_on_a_rank(plan: Plan) -> int:
    """The most fully recomputed layers any pipeline rank holds (over its virtual stages)."""
    per_rank: dict[int, int] = {}
    for stage in plan.stages:
        per_rank[stage.pipeline_rank] = per_rank.get(stage.pipeline_rank, 0) + stage.recompute.count("full")
    return max(per_rank.values(), default=0)


def _notes_for_recompute(plan: Plan, target: str) -> list[str]:
    kinds = {r for stage in plan.stages for r in stage.recompute}
    if len(kinds) > 1:
        return [f"{target} cannot express per-layer recomputation lists; the plan recomputes "
                f"{_full_recompute_layers(plan)} layers fully and "
                f"{sum(r == 'selective' for s in plan.stages for r in s.recompute)} selectively"]
    return []


FUSED_LOSS_NOTE = ("the plan's memory assumed Transformer Engine's fused cross-entropy (the bf16 logits hold their "
                   "own gradient); {target} keeps more for the loss (plan with that framework's stack to predict it)")
PRECISION_AWARE_NOTE = ("the plan's memory assumed Megatron-Core's precision-aware optimizer (the master kept as "
                        "16-bit remainders where it trains in BF16, or bf16 moments); {target} keeps fp32 states "
                        "(plan with that framework's stack to predict them)")


def notes_for_unexpressed(plan: Plan, *, framework: str, experts: str, mtp: str, optimizer: str,
                          loss: str) -> list[str]:
    """What a target without Megatron-Core's dispatchers, MTP, activation offloading, precision-aware optimizer and
    fused loss cannot say; each word names the target's own piece (the framework, its expert all-to-all, why it has
    no MTP, its optimizer, its loss)."""
    lay, notes = plan.layout, []
    if lay.offload_layers:
        notes.append(f"the plan offloads the first {lay.offload_layers} layers' activations to host memory (Megatron "
                     f"--cpu-offloading-num-layers); {framework} has no such setting in this export, so those "
                     "activations stay on the device and the plan's memory does not hold (plan with that "
                     "framework's stack, which recomputes instead)")
    if lay.moe_dispatcher != "alltoall":
        notes.append(f"the prediction dispatched MoE tokens {lay.moe_dispatcher.words}; {experts} "
                     "sends one per expert, which this export cannot change")
    if plan.mtp_layers:
        notes.append(f"the plan trains {plan.mtp_layers} multi-token prediction module(s); {mtp}")
    if lay.precision_aware_optimizer:
        notes.append(PRECISION_AWARE_NOTE.format(target=optimizer))
    if lay.fused_loss:
        notes.append(FUSED_LOSS_NOTE.format(target=loss))
    return notes


def connections_note(plan: Plan) -> list[str]:
    """The CUDA_DEVICE_MAX_CONNECTIONS a Megatron run of the plan needs in its environment: on Hopper and earlier
    TP overlap wants 1, combined 1F1B more (`hardware_profiles.stack.cuda_device_max_connections`)."""
    from ..job import plan_device
    lay = plan.layout
    device = load_device(plan_device(plan))
    connections = cuda_device_max_connections(device, lay.tp, lay.cp, lay.dp, lay.pp,
                                              lay.ep > 1 and lay.moe_dispatcher == "deepep", lay.moe_a2a_overlap)
    if connections is None:
        return []
    return [f"launch with CUDA_DEVICE_MAX_CONNECTIONS={connections} in the environment, as Megatron-Bridge's "
            f"performance launcher sets it for this layout on {device.name}"
            + (" (one connection: TP communication kernels queue before the GEMMs they overlap)"
               if connections == 1 else "")]
