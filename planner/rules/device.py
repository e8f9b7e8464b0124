"""Refusals before any search: what the device must have for the precision and the stack, and what of the
model the stack cannot train. Each is one paragraph naming the field (exit status 2 from the CLI)."""
from __future__ import annotations

from hardware_profiles.errors import UserInputError
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from .stack import untrainable_parts


def check_model_on_stack(graph, stack: SoftwareStack) -> None:
    """The model has parts the stack cannot train (multi-token prediction without it)."""
    refused = untrainable_parts(stack, graph)
    if refused:
        raise UserInputError("; ".join(refused), field="--stack",
                             expected="a stack that trains them (planner stacks show NAME), or the model without them")


def check_device_for(cluster: Cluster, stack: SoftwareStack, precision: str, fp8_recipe: str | None = None,
                     dispatcher: str | None = None, offload_layers: int | None = None) -> None:
    """The device profile has what the precision, the FP8 recipe, the MoE dispatcher, activation offloading and the
    stack's settings need to be costed."""
    device = cluster.device
    for name, what in (("host_link_gbytes_per_s", "host link bandwidth to cost the copies"),
                       ("host_memory_bytes", "host memory to hold the activations")):
        if offload_layers and getattr(device, name) is None:
            raise UserInputError(f"offload_layers={offload_layers} on {device.name}: the profile gives no {what}",
                                 source=device.profile, field=name,
                                 expected=f"{name} in the device profile, or offload_layers=0")
    if precision == "fp8" and not device.peak_tflops.fp8:
        raise UserInputError(f"{device.name} has no FP8 matrix units (its profile gives no fp8 peak)",
                             field="--precision", expected="bf16 on this device, or a device with FP8")
    if precision == "fp8" and fp8_recipe == "mxfp8" and not device.mxfp8:
        raise UserInputError(f"fp8_recipe=mxfp8 on {device.name}: MXFP8's block scales need Blackwell tensor cores "
                             "(the device profile's mxfp8)", field="fp8_recipe",
                             expected="tensorwise, delayed or blockwise on this device, or a Blackwell device")
    if dispatcher == "deepep" and device.flex_dispatcher_backend is None:
        raise UserInputError(f"dispatcher=deepep on {device.name}: Megatron-Core's flex dispatcher runs DeepEP or "
                             "HybridEP kernels, and the device profile names neither (its flex_dispatcher_backend)",
                             field="dispatcher", expected="alltoall or allgather on this device")
    held = stack.flex_dispatcher_sms(device)
    if dispatcher == "deepep" and device.sm_count is not None and held >= device.sm_count:
        name = "hybridep_sms" if device.flex_dispatcher_backend == "hybridep" and stack.hybridep_sms else "deepep_sms"
        raise UserInputError(f"{name} {held} leaves none of the {device.name}'s {device.sm_count} SMs to compute",
                             field=name, expected=f"fewer than {device.sm_count} SMs")
    if stack.optimizer_swap_chunks and device.host_link_gbytes_per_s is None:
        raise UserInputError(f"the {stack.name} stack swaps optimizer states to host memory "
                             f"(optimizer_swap_chunks {stack.optimizer_swap_chunks}), and the {device.name} "
                             "profile gives no host link bandwidth to cost it", source=device.profile,
                             field="host_link_gbytes_per_s",
                             expected="host_link_gbytes_per_s in the device profile, or a stack that keeps the "
                                      "optimizer on the device (optimizer_swap_chunks: 0)")


def check_overlaps_on(cluster: Cluster, tp: int, tp_overlap: bool, a2a_overlap: bool,
                      field: str = "tp_overlap") -> None:
    """TP communication overlap and combined 1F1B together where the device runs only one of them at this tp
    (`SoftwareStack.tp_overlap_blocked_by_a2a`)."""
    if tp_overlap and a2a_overlap and SoftwareStack.tp_overlap_blocked_by_a2a(tp, cluster.device):
        raise UserInputError(f"tp_overlap=true with combined 1F1B (a2a_overlap=true) at tp={tp} on "
                             f"{cluster.device.name}: TP overlap wants CUDA_DEVICE_MAX_CONNECTIONS=1 there and "
                             "combined 1F1B more (Megatron-Bridge's H100 recipes with combined 1F1B turn TP overlap "
                             "off)", field=field, expected="tp_overlap=false or a2a_overlap=false (or leave either "
                             "to the search)")


def check_plan_device(plan) -> None:
    """A plan file's precision, FP8 recipe, dispatcher and overlaps against its own device profile (a hand-edited
    mxfp8 or deepep on a device without them, TP overlap beside combined 1F1B where one connection is needed)."""
    from hardware_profiles.loader import load_stack

    from ..job import plan_cluster
    lay = plan.layout
    if lay.tp_comm_overlap and lay.moe_a2a_overlap:
        check_overlaps_on(plan_cluster(plan), lay.tp, True, True, field="tp_comm_overlap")
    if str(plan.layout.precision) != "fp8" and (plan.layout.ep == 1 or plan.layout.moe_dispatcher != "deepep") \
            and not plan.layout.offload_layers:
        return
    check_device_for(plan_cluster(plan), load_stack(plan.stack), str(plan.layout.precision), str(plan.layout.fp8_recipe),
                     str(plan.layout.moe_dispatcher) if plan.layout.ep > 1 else None, plan.layout.offload_layers)
