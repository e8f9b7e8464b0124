"""Load device and cluster profiles from YAML: built-ins by name, or any file by path."""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from .errors import UserInputError, format_pydantic_error
from .parsing import parse_yaml, read_bounded_text
from .schema import Cluster, Device
from .stack import DEFAULT_STACK, SoftwareStack

PROFILE_DIR = Path(__file__).resolve().parent
DEVICE_DIR = PROFILE_DIR / "devices"
CLUSTER_DIR = PROFILE_DIR / "clusters"
STACK_DIR = PROFILE_DIR / "stacks"


MAX_INPUT_FILE_BYTES = 1 << 20   # profiles and model files are a few KB; a larger one is not one


def read_small_text(path: Path, what: str) -> str:
    """The text of a small input file, refused when it is not one (size, encoding, special file, unreadable)."""
    return read_bounded_text(path, what, MAX_INPUT_FILE_BYTES)


def read_yaml_mapping(path: Path, what: str = "YAML profile") -> dict:
    """A small YAML file that must hold a mapping of fields (profiles, model files)."""
    data = parse_yaml(read_small_text(path, what), str(path))
    if not isinstance(data, dict):
        raise UserInputError("the file does not hold a mapping of fields", source=str(path),
                             expected="a YAML mapping such as 'name: h100-sxm'")
    return data


def list_devices() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def list_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def list_stacks() -> list[str]:
    return sorted(p.stem for p in STACK_DIR.glob("*.yaml"))


def load_stack(name_or_path: str | None = None) -> SoftwareStack:
    """A software stack by built-in name or YAML path; Megatron-Core's defaults when none is named."""
    path = _resolve(DEFAULT_STACK if name_or_path is None else name_or_path, STACK_DIR, list_stacks(), "stack")
    try:
        return SoftwareStack.model_validate(read_yaml_mapping(path, "software-stack profile"))
    except ValidationError as exc:
        raise format_pydantic_error(str(path), exc) from None


def resolve_stack(stack) -> SoftwareStack:
    """A `SoftwareStack`, a built-in name, a YAML path, or None (the default stack)."""
    if isinstance(stack, SoftwareStack):
        return stack
    if stack is not None and not isinstance(stack, (str, os.PathLike)):
        raise UserInputError(f"{type(stack).__name__}", field="stack",
                             expected=f"a stack name ({', '.join(list_stacks())}), a YAML path or a SoftwareStack")
    return load_stack(None if stack is None else str(stack))


def _resolve(name_or_path: str, directory: Path, names: list[str], kind: str) -> Path:
    if not str(name_or_path).strip():
        raise UserInputError(f"the {kind} name is empty", field=f"--{kind}",
                             expected=f"a path to a YAML file or one of: {', '.join(names)}")
    candidate = Path(name_or_path)
    # a built-in name is the built-in, whatever lies in the working directory; a path says it is one (a
    # separator or an extension): './h100-sxm' or 'h100-sxm.yaml'
    if name_or_path in names and os.sep not in name_or_path and not candidate.suffix:
        return directory / f"{name_or_path}.yaml"
    if candidate.suffix in (".yaml", ".yml") or os.path.exists(candidate):
        return candidate
    raise UserInputError(f"unknown {kind} '{name_or_path}'",
                         expected=f"a path to a YAML file or one of: {', '.join(names)}")


def parse_device(data: dict, source: str) -> Device:
    try:
        return Device.model_validate(data)
    except ValidationError as exc:
        raise format_pydantic_error(source, exc) from None


def load_device(name_or_path: str) -> Device:
    path = device_profile_path(name_or_path)
    device = parse_device(read_yaml_mapping(path), str(path))
    device._profile = _profile_name(path, DEVICE_DIR)
    return device


def _profile_name(path: Path, builtin_dir: Path) -> str:
    """A profile as any process can load it again: its built-in name, else its file's absolute path."""
    resolved = path.resolve()
    return resolved.stem if resolved.parent == builtin_dir else str(resolved)


def device_profile_path(name_or_path: str) -> Path:
    """The YAML file of a device profile given by built-in name or path."""
    return _resolve(name_or_path, DEVICE_DIR, list_devices(), "device")


def _device_reference(device_ref: str, cluster_file: Path | None) -> str:
    """A cluster's `device:` is a built-in name, or a path relative to the cluster file (as includes are),
    never to wherever the planner happens to run."""
    if device_ref in list_devices() or cluster_file is None:
        return device_ref
    path = Path(device_ref)
    return str(path if path.is_absolute() else cluster_file.parent / path)


def parse_cluster(data: dict, source: str, cluster_file: Path | None = None) -> Cluster:
    data = dict(data)
    device_ref = data.get("device")
    if isinstance(device_ref, str):
        try:
            data["device"] = load_device(_device_reference(device_ref, cluster_file))
        except UserInputError as exc:
            raise UserInputError(f"cannot load device '{device_ref}' (a path is read relative to the cluster "
                                 f"file): {exc}", source=source, field="device") from None
    elif device_ref is None:
        raise UserInputError("missing", source=source, field="device",
                             expected=f"a device name ({', '.join(list_devices())}) or a device path")
    try:
        return Cluster.model_validate(data)
    except ValidationError as exc:
        raise format_pydantic_error(source, exc) from None


def load_cluster(name_or_path: str) -> Cluster:
    path = _resolve(name_or_path, CLUSTER_DIR, list_clusters(), "cluster")
    cluster = parse_cluster(read_yaml_mapping(path), str(path), path)
    cluster._profile = _profile_name(path, CLUSTER_DIR)
    return cluster


def default_cluster_for(device: Device) -> Cluster | None:
    """The built-in cluster whose device is `device`, used to fill network and storage figures."""
    for name in list_clusters():
        cluster = load_cluster(name)
        if cluster.device.name == device.name:
            return cluster
    return None


def cluster_from_device(device_name: str, num_devices: int, devices_per_node: int | None = None,
                        segment_devices: int | None = None) -> Cluster:
    """A cluster built on the command line: `--device h100-sxm --num-devices 16384`.

    Network, storage and reliability come from the built-in cluster of that device.
    """
    device = load_device(device_name)
    template = default_cluster_for(device)
    if template is None:
        raise UserInputError(f"no built-in cluster uses device '{device_name}' to take network figures from",
                             field="--device", expected="a device with a built-in cluster, or --cluster FILE")
    if devices_per_node is not None and devices_per_node <= 0:
        raise UserInputError(f"{devices_per_node}", field="--devices-per-node", expected="a positive count")
    # a job smaller than a node sits inside one node, using that many of its devices
    per_node = devices_per_node or min(template.devices_per_node, max(num_devices, 1))
    if num_devices <= 0:
        raise UserInputError(f"{num_devices} devices", field="--num-devices", expected="a positive count")
    if num_devices % per_node:
        raise UserInputError(f"{num_devices} devices do not fill whole nodes of {per_node}",
                             field="--num-devices", expected=f"a multiple of {per_node}")
    # the device's scale-up domain: the node where the node is the domain (DGX, Atlas 800), else the
    # template's rack or supernode (72 for NVL72, 384 for CloudMatrix), whatever the job's size: a job
    # smaller than a rack still sits inside its NVLink domain (Cluster.placement_domain_devices)
    node_is_domain = template.fast_domain_devices == template.devices_per_node
    fast = per_node if node_is_domain else template.fast_domain_devices
    # a device file is named by its stem: 'cpu-fit.yaml' makes 'cpu-fit-x2', never the built-in's name
    label = Path(device_name).stem if device_name not in list_devices() else device_name
    update = {"name": f"{label}-x{num_devices}", "num_nodes": num_devices // per_node,
              "devices_per_node": per_node, "fast_domain_devices": fast, "segment_devices": segment_devices}
    data = template.model_dump()
    data.update(update)
    data["device"] = device
    return parse_cluster(data, f"--device {device_name} --num-devices {num_devices}")
