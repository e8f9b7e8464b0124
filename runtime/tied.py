"""Tied weights (one parameter used under two names, e.g. the embedding and the output layer) kept tied.

Found from the module itself: a parameter that `named_parameters(remove_duplicate=False)` lists under
more than one name. Tensor parallelism builds one DTensor per name, so the names are tied again to one
parameter when their shardings agree (vocabulary-parallel embedding and column-parallel output layer
both shard the weight's rows). Pipeline stages hold the names on different ranks, so the copies' gradients
are summed over the pipeline group before the optimizer step, as Megatron-LM does for its shared word
embeddings; both copies start equal (the same model) and so stay equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .dims import PlanError


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


class StageTies:
    """Tied weights whose copies sit in the first chunk (the embedding) and the last (the output layer):
    their gradients are summed over the two pipeline ranks holding them, one pair group per pipeline."""

    def __init__(self, groups: list[tuple[str, ...]], mesh, embedding: tuple[str, ...], head: tuple[str, ...]):
        self.groups = groups
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
        for row in ranks.tolist():   # every rank creates every pair group, in the same order
            pair = dist.new_group([row[0], row[-1]])
            if me in (row[0], row[-1]):
                self.group = pair

    def sum_gradients(self, modules: list[nn.Module]) -> None:
        if self.group is None:
            return
        for names in self.groups:
            held = [module.get_parameter(name) for module in modules for name in names if _present(module, name)]
            for param in held[:1]:   # one copy per rank: the first and the last chunk are on different ranks
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.group)
