"""`Job`: what a user states about a training job, resolved and checked once.

The model (captured on meta), the cluster at its device count, the global batch, the sequence (the captured
graph's), the precision, the software stack and the layout fields pinned. The CLI and the API build it with
`job_of`; `plan`, `evaluate`, `whatif` and `replan` take it. Nothing here loads the search, so the runtime
reads the cluster a plan names through `plan_cluster`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.layout import Precision
from cost_models.layout_domains import MAX_DEGREE
from hardware_profiles.errors import UserInputError, clip
from hardware_profiles.loader import cluster_from_device, load_cluster, resolve_stack
from hardware_profiles.schema import Cluster
from hardware_profiles.stack import SoftwareStack

from .graph_capture.graph import ModelGraph
from .graph_capture.model_capture import capture
from .rules.device import check_device_for, check_model_on_stack
from .rules.pins import Pins, pins_from


@dataclass(frozen=True)
class Job:
    """One training job as the user states it (the model as given is kept: a what-if point at another
    sequence length captures it again)."""
    source: object                   # a built-in name, a file, a config dict or an nn.Module
    graph: ModelGraph                # captured at the job's sequence, attention and kernels as the stack runs them
    cluster: Cluster
    global_batch: int
    precision: Precision
    stack: SoftwareStack
    pins: Pins = Pins()              # layout fields the user fixed (the stack's rules are applied by the search)
    ep_imbalance: float = 1.0        # the busiest expert rank's routed tokens over the mean, as measured
    leaf_modules: tuple[str, ...] = ()
    strict_capture: bool = False

    @property
    def seq_len(self) -> int:
        return self.graph.seq_len

    def at(self, *, cluster: Cluster | None = None, seq_len: int | None = None,
           global_batch: int | None = None) -> "Job":
        """The same job at another point (a what-if sweep): another cluster, sequence or batch."""
        graph = self.graph if seq_len in (None, self.seq_len) else \
            capture_for(self.source, seq_len, self.leaf_modules, self.stack, self.strict_capture)
        if cluster is not None:
            check_device_for(cluster, self.stack, self.precision, self.pins.fp8_recipe, self.pins.dispatcher,
                             self.pins.offload_layers)
        if global_batch is not None:
            check_batch(global_batch)
        return replace(self, graph=graph, cluster=cluster or self.cluster,
                       global_batch=self.global_batch if global_batch is None else global_batch)


def job_of(model, cluster=None, *, global_batch: int, seq_len: int | None = None, precision: str | None = None,
           device: str | None = None, num_devices: int | None = None, devices_per_node: int | None = None,
           segment_devices: int | None = None, stack=None, ep_imbalance: float = 1.0,
           leaf_modules: tuple[str, ...] = (), strict_capture: bool = False, layout_values: dict | None = None) -> Job:
    """The job from what the user gave, each part checked in one place: `layout_values` are typed layout
    values (`layout_codec.parse_text`/`parse_values`) whose batch and precision must agree with the
    arguments; the others become the job's pins."""
    check_batch(global_batch)
    check_imbalance(ep_imbalance)
    values = dict(layout_values or {})
    resolved_stack = resolve_stack(stack)
    graph = capture_for(model, seq_len, leaf_modules, resolved_stack, strict_capture)
    resolved = resolve_cluster(cluster, device, num_devices, devices_per_node, segment_devices)
    chosen = resolve_precision(precision, values)
    check_recipe_beside(chosen, values.get("fp8_recipe"))
    check_model_on_stack(graph, resolved_stack)
    check_device_for(resolved, resolved_stack, chosen, values.get("fp8_recipe"), values.get("dispatcher"),
                     values.get("offload_layers"))
    given_once("--global-batch", global_batch, values.pop("gbs", None))
    return Job(model, graph, resolved, global_batch, chosen, resolved_stack, pins_from(values), ep_imbalance,
               tuple(leaf_modules), strict_capture)


def capture_for(model, seq_len: int | None, leaf_modules: tuple[str, ...], stack: SoftwareStack,
                strict: bool = False) -> ModelGraph:
    """Capture, with a config-built model's attention as the stack runs it (a module's own code decides)
    and norms as the stack runs them (fused kernels, or the model's own code). `strict`: a capture that
    had to bill any part inexactly (capture_notes) is an error instead of a note in the plan."""
    graph = capture(model, seq_len, leaf_modules, attention_impl="flash" if stack.flash_attention else "math",
                    fused_kernels=stack.fused_kernels, fused_gated_activation=stack.fused_gated_activation,
                    dropout=stack.model_dropout)
    if strict and graph.capture_notes:
        raise UserInputError(f"capture of {graph.name} is not exact: " + "; ".join(graph.capture_notes),
                             field="--strict-capture", expected="a model whose every part capture can read "
                             "(drop --strict-capture to plan with these parts billed as the notes say)")
    return graph


def resolve_cluster(cluster=None, device: str | None = None, num_devices: int | None = None,
                    devices_per_node: int | None = None, segment_devices: int | None = None) -> Cluster:
    """The job's cluster: a profile (name, file or `Cluster`) at `num_devices`, or one built from a device;
    `segment_devices` lays the job out in equal segments of the scale-up domains (Cluster.segment_devices)."""
    check_count("--num-devices", num_devices)
    check_count("--devices-per-node", devices_per_node)
    check_count("--segment-devices", segment_devices)
    resolved = _resolve_cluster(cluster, device, num_devices, devices_per_node)
    if segment_devices is None:
        return resolved
    segmented = resolved.model_copy(update={"segment_devices": segment_devices})   # checked here, not by pydantic
    problem = segmented.segment_problem(segmented.num_devices)
    if problem:
        raise UserInputError(problem, field="--segment-devices",
                             expected=f"whole nodes of {resolved.devices_per_node}, at most the "
                             f"{resolved.fast_domain_devices}-device domain, dividing {resolved.num_devices} devices")
    return segmented


def _resolve_cluster(cluster, device: str | None, num_devices: int | None, devices_per_node: int | None) -> Cluster:
    if cluster is not None and (device is not None or devices_per_node is not None):
        given = "--device" if device is not None else "--devices-per-node"
        raise UserInputError(f"{given} is given with --cluster, which already names the device and its nodes",
                             field=given, expected="either --cluster NAME|FILE [--num-devices N] or --device NAME "
                             "--num-devices N [--devices-per-node K]")
    if isinstance(cluster, Cluster):
        resolved = cluster
    elif cluster is not None:
        resolved = load_cluster(str(cluster))
    elif device is not None:
        if num_devices is None:
            raise UserInputError("--device needs --num-devices", field="--num-devices", expected="a device count")
        return cluster_from_device(device, num_devices, devices_per_node)
    else:
        raise UserInputError("no cluster given", field="--cluster",
                             expected="--cluster NAME|FILE or --device NAME --num-devices N")
    if num_devices is not None and num_devices != resolved.num_devices:
        if num_devices <= 0 or (num_devices % resolved.devices_per_node and num_devices > resolved.devices_per_node):
            raise UserInputError(f"{num_devices} devices do not fill whole nodes of {resolved.devices_per_node}",
                                 field="--num-devices", expected=f"a positive multiple of {resolved.devices_per_node}")
        if resolved.segment_problem(num_devices):
            raise UserInputError(resolved.segment_problem(num_devices), field="--num-devices",
                                 expected="a device count the cluster's segment_devices divides")
        resolved = resolved.with_devices(num_devices)
    return resolved


def check_count(field: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DEGREE):
        raise UserInputError(f"{clip(repr(value))}", field=field,
                             expected=f"a positive integer of at most {MAX_DEGREE:,} (a plan's largest degree)")


def check_batch(global_batch: int) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch <= 0:
        raise UserInputError(f"{global_batch!r}", field="global_batch", expected="a positive number of sequences")


def check_imbalance(ep_imbalance) -> None:
    if isinstance(ep_imbalance, bool) or not isinstance(ep_imbalance, (int, float)) \
            or not 1.0 <= ep_imbalance < float("inf"):
        raise UserInputError(f"{ep_imbalance!r}", field="--ep-imbalance",
                             expected="the most loaded expert-parallel rank's routed tokens over the mean: a finite "
                             "number >= 1 (1 = balanced routing, as a benchmark that forces balance runs)")


def given_once(field: str, argument, in_layout):
    """A field given both as an argument and inside the layout text must say the same."""
    if argument is not None and in_layout is not None and argument != in_layout:
        raise UserInputError(f"{field.lstrip('-')} is given twice, as {argument} and as {in_layout} in the layout",
                             field=field, expected="one value, or the same value in both places")
    return in_layout if in_layout is not None else argument


def check_recipe_beside(precision: Precision, fp8_recipe) -> None:
    """An FP8 recipe the user gives applies to FP8 training only: beside another precision it would do nothing."""
    if fp8_recipe is not None and precision != Precision.fp8:
        raise UserInputError(f"fp8_recipe={fp8_recipe} with precision {precision}", field="fp8_recipe",
                             expected="--precision fp8 (or precision=fp8 in the layout) beside an FP8 recipe, "
                             "or no fp8_recipe")


def resolve_precision(argument: str | None, values: dict) -> Precision:
    """The precision of an argument and of `precision=` in layout values (removed from them), bf16 if neither."""
    precision = given_once("--precision", argument, values.pop("precision", None))
    if precision is None:
        return Precision.bf16
    if precision not in Precision.texts():
        raise UserInputError(f"'{precision}'", field="--precision", expected="bf16 or fp8")
    return Precision(precision)


def plan_device(plan_) -> str:
    """The device profile a plan was made on (a built-in name or a file's path), for another process to load."""
    from hardware_profiles.loader import list_clusters, list_devices
    if plan_.device_profile:
        return plan_.device_profile
    if plan_.cluster in list_clusters():   # plans written before profiles were kept
        return load_cluster(plan_.cluster).device.name
    device = plan_.cluster.rsplit("-x", 1)[0]
    if device not in list_devices():
        raise UserInputError(f"cannot tell the device of cluster '{plan_.cluster}'", field="device_profile",
                             expected="a plan that names its device profile (plans written by this version do)")
    return device


def plan_cluster(plan_) -> Cluster:
    """The cluster a plan was made for, at the plan's device count: its profile, or its device's."""
    from hardware_profiles.loader import list_clusters
    profile = plan_.cluster_profile or (plan_.cluster if plan_.cluster in list_clusters() else "")
    if profile:
        return resolve_cluster(profile, None, plan_.num_devices, segment_devices=plan_.segment_devices)
    return resolve_cluster(None, plan_device(plan_), plan_.num_devices, plan_.devices_per_node,
                           plan_.segment_devices)
