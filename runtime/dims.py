"""The mesh a plan runs on: checked by the rulebook on every rank before any collective, then built."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from cost_models.layout import Layout
from planner.rules.runtime import runtime_problems


class PlanError(ValueError):
    """A plan that cannot run on this world: raised on every rank before any collective."""


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is (isinstance: hasattr costs a raised error per plain
    tensor, on paths that run every step)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def error_line(error: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut to `limit` characters, or its type where it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def check_runnable(layout: Layout, world_size: int, num_blocks: int) -> None:
    """The rulebook's runtime rules (`planner.rules.runtime`), as one PlanError naming every problem."""
    problems = runtime_problems(layout, world_size, num_blocks)
    if problems:
        raise PlanError("the plan cannot run here: " + "; ".join(problems))


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """World mesh with named dims; DeviceMesh lists dims outermost first (the layout's order is innermost first,
    Megatron-Core style)."""
    sizes = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    order = [name for name in reversed(layout.mesh_order) if name in sizes]
    return init_device_mesh(device_type, tuple(sizes[n] for n in order), mesh_dim_names=tuple(order))


def local_ranks(mesh: DeviceMesh) -> dict[str, int]:
    return {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
