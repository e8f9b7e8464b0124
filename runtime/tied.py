"""Tied weights (one parameter used under two names, e.g. the embedding and the output layer) kept tied.

Found from the module itself: a parameter that `named_parameters(remove_duplicate=False)` lists under
more than one name. Tensor parallelism builds one DTensor per name, so the names are tied again to one
parameter when their shardings agree (vocabulary-parallel embedding and column-parallel output layer
both shard the weight's rows). Pipeline stages hold the names on different ranks, so the copies' gradients
are summed over the pipeline group before the optimizer step, as Megatron-LM does for its shared word
embeddings; both copies start equal (the same model) and so stay equal. Under DualPipeV's V the first and
the last chunk sit on one rank: the output layer's copy is made a parameter of its own there too (each
chunk's data-parallel wrapper owns its parameters) and the two gradients are summed in place.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .dims import PlanError, local_shard


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of parameter names that share one tensor, in the model's order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _present(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def retie(module: nn.Module, groups: list[tuple[str, ...]]) -> None:
    """Make every name of a group that this module holds one parameter again (after tensor parallelism)."""
    for names in groups:
        held = [name for name in names if _present(module, name)]
        if len(held) < 2:
            continue
        first = module.get_parameter(held[0])
        for name in held[1:]:
            other = module.get_parameter(name)
            if getattr(first, "placements", None) != getattr(other, "placements", None):
                raise PlanError(f"tied weights {held[0]} and {name} are sharded differently "
                                f"({getattr(first, 'placements', None)} vs {getattr(other, 'placements', None)}) "
                                "and cannot stay one parameter under this tensor-parallel layout")
            owner, attr = _owner(module, name)
            setattr(owner, attr, first)


def _chunk_side(name: str, embedding: tuple[str, ...], head: tuple[str, ...]) -> str | None:
    module = name.rpartition(".")[0]
    if any(module == m or module.startswith(m + ".") for m in embedding):
        return "first"
    if any(module == m or module.startswith(m + ".") for m in head):
        return "last"
    return None


def untie_head(head_chunk: nn.Module, groups: list[tuple[str, ...]], head: tuple[str, ...]) -> None:
    """Give the output layer's names in `head_chunk` a copy of the tied weight of their own: the chunk shares
    the model's modules with the embedding's chunk on the same rank (DualPipeV's V)."""
    for names in groups:
        for name in names:
            if _chunk_side(name, (), head) == "last" and _present(head_chunk, name):
                owner, attr = _owner(head_chunk, name)
                setattr(owner, attr, nn.Parameter(getattr(owner, attr).detach().clone()))


class StageTies:
    """Tied weights whose copies sit in the first chunk (the embedding) and the last (the output layer):
    their gradients are summed over the two pipeline ranks holding them, one pair group per pipeline, or in
    place where one rank holds both chunks (`last_rank` 0: DualPipeV's V)."""

    def __init__(self, groups: list[tuple[str, ...]], mesh, embedding: tuple[str, ...], head: tuple[str, ...],
                 last_rank: int):
        self.groups = groups
        self.in_place = last_rank == 0
        for names in groups:
            sides = {_chunk_side(name, embedding, head) for name in names}
            if sides != {"first", "last"}:
                raise PlanError(f"tied weights {', '.join(names)} are not one embedding and one output layer: "
                                "under pipeline parallelism only those can stay tied (their gradients are summed "
                                "between the first and the last stage)")
        pp_axis = mesh.mesh_dim_names.index("pp")
        ranks = mesh.mesh.movedim(pp_axis, -1).reshape(-1, mesh.mesh.shape[pp_axis])
        me = dist.get_rank()
        self.group = None
        for row in ([] if self.in_place else ranks.tolist()):   # every rank creates every pair group, in order
            pair = dist.new_group([row[0], row[last_rank]])
            if me in (row[0], row[last_rank]):
                self.group = pair

    def sum_gradients(self, modules: list[nn.Module]) -> None:
        for names in self.groups:
            held = [module.get_parameter(name) for module in modules for name in names if _present(module, name)]
            if self.in_place and len(held) == 2:   # both copies here (pipeline rank 0 of a V)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in held]
                held[0].grad, held[1].grad = grads[0] + grads[1], grads[0] + grads[1]
            if self.group is None:
                continue
            for param in held[:1]:   # one copy per rank: the first and the last chunk are on different ranks
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
                dist.all_reduce(local_shard(grad), group=self.group)
