"""`ParallelDims`: one typed description of the mesh a plan runs on, checked before any collective."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cost_models.layout import Layout
from cost_models.pipeline import even_partition, most_chunks, partition_problem


class PlanError(ValueError):
    """A plan that cannot run on this world: raised on every rank before any collective."""


def error_line(error: BaseException, limit: int = 200) -> str:
    """An exception's first line, cut to `limit` characters, or its type where it says nothing."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    vp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    zero: int
    mesh_order: tuple[str, ...]     # innermost first, Megatron-Core style

    @classmethod
    def of(cls, layout: Layout) -> "ParallelDims":
        return cls(dp=layout.dp, tp=layout.tp, pp=layout.pp, vp=layout.vp, cp=layout.cp, ep=layout.ep,
                   etp=layout.etp, sp=layout.sp, zero=layout.zero, mesh_order=tuple(layout.mesh_order))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def check(self, world_size: int, num_blocks: int, stage_layers: tuple[int, ...] | None) -> None:
        problems = []
        if self.world_size != world_size:
            problems.append(f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size} but "
                            f"the job has {world_size} ranks")
        chunks = self.pp * self.vp
        if chunks > most_chunks(num_blocks):
            problems.append(f"{num_blocks} layers, the embedding and the loss do not split into pp*vp = {chunks} "
                            "chunks")
        else:
            problem = partition_problem(stage_layers or even_partition(num_blocks, chunks), num_blocks, chunks)
            if problem:
                problems.append(problem)
        if self.etp not in (1, self.tp):
            problems.append(f"etp={self.etp} must be 1 or tp={self.tp} in this runtime")
        if self.ep > 1 and self.dp % self.ep:
            problems.append(f"ep={self.ep} must divide dp={self.dp}: this runtime folds experts over data-parallel ranks")
        if problems:
            raise PlanError("the plan cannot run here: " + "; ".join(problems))

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """World mesh with named dims; DeviceMesh lists dims outermost first."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        order = [name for name in reversed(self.mesh_order) if name in sizes]
        return init_device_mesh(device_type, tuple(sizes[n] for n in order), mesh_dim_names=tuple(order))

    def local_ranks(self, mesh: DeviceMesh) -> dict[str, int]:
        return {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names}


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
