"""What a module is, read from its parameters and children alone: a linear layer, a norm, an activation, routed
experts and their router (the capture's recognisers; `graph_analysis` reads the fx graph)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, or a childless module holding one 2-D weight and at most a 1-D bias (Hugging Face's
    GPT-2 `Conv1D`, which stores the weight [in, out] and multiplies with addmm)."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, nn.Embedding) or list(module.children()):
        return False
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return (weight is not None and weight.dim() == 2 and set(params) <= {"weight", "bias"}
            and (params.get("bias") is None or params["bias"].dim() == 1))


def linear_features(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(in, out) of a linear-like module, read against its input's last dimension."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    rows, cols = module.weight.shape
    return (rows, cols) if x.shape[-1] == rows and x.shape[-1] != cols else (cols, rows)


def may_be_activation(module: nn.Module) -> bool:
    """A stateless childless module (transformers' ACT2FN classes, nn.GELU): an activation function if it
    turns one tensor into one of the same shape, which the recording checks after the call."""
    return (not list(module.children()) and not list(module.parameters()) and not list(module.buffers())
            and not isinstance(module, nn.Dropout | nn.Identity))


def output_width(module: nn.Module) -> int:
    """A linear-like module's output features: nn.Linear's; for another 2-D weight (Conv1D stores it
    [in, out]) the larger side, as without an input there is no telling them apart."""
    return module.out_features if isinstance(module, nn.Linear) else max(module.weight.shape)


def is_norm_like(module: nn.Module) -> bool:
    """A parameterised module with no children and only 1-D parameters: a normalisation."""
    params = list(module.parameters(recurse=False))
    return (not list(module.children()) and bool(params) and all(p.dim() == 1 for p in params)
            and not isinstance(module, nn.Linear | nn.Embedding))


def signature(module: nn.Module) -> tuple:
    """Modules with the same class and parameter shapes are the same kind of layer."""
    return (type(module).__name__,
            tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


@dataclass(frozen=True)
class RoutedExperts:
    """Routed experts found in a module: a router Linear with E outputs and E alike experts, held
    either as a ModuleList of modules or as stacked [E, in, out] weights."""
    count: int
    param_ids: frozenset[int]
    gemms: tuple[tuple[int, int], ...]      # (in, out) of one expert's GEMMs
    module_list: nn.ModuleList | None


def _router_sizes(module: nn.Module) -> set[tuple[int, int]]:
    """(experts, input width) of the child modules that could be a router: a Linear, a module holding a 2-D
    `weight` [experts, hidden] it multiplies by itself (Hugging Face 5.x `*TopKRouter`), or a module
    around a gate Linear (torchtitan's `TokenChoiceTopKRouter.gate`)."""
    sizes = set()
    for child in module.children():
        weight = getattr(child, "weight", None)
        if isinstance(child, nn.Linear):
            sizes.add((child.out_features, child.in_features))
        elif isinstance(weight, nn.Parameter) and weight.dim() == 2 and not isinstance(child, nn.Embedding):
            sizes.add((weight.shape[0], weight.shape[1]))
        elif _wraps_one_linear(child):   # a router module around its gate Linear (torchtitan)
            gate = next(g for g in child.children() if isinstance(g, nn.Linear))
            sizes.add((gate.out_features, gate.in_features))
    return sizes


def _wraps_one_linear(module: nn.Module) -> bool:
    """A module whose only parameters are one Linear child's (torchtitan's TokenChoiceTopKRouter.gate)."""
    holders = [m for m in module.modules() if list(m.parameters(recurse=False))]
    return len(holders) == 1 and isinstance(holders[0], nn.Linear) and holders[0] is not module


def stacked_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(path, parameter) of the module's [E, in, out] weights with E > 1: stacked experts, where a router scores E
    (a convolution's [out, in, kernel] weight is none)."""
    return [(f"{owner}.{name}".lstrip("."), p) for owner, m in module.named_modules()
            if not isinstance(m, nn.modules.conv._ConvNd)
            for name, p in m.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]


def routed_experts(module: nn.Module) -> RoutedExperts | None:
    routers = _router_sizes(module)
    if not routers:
        return None
    sizes = {experts for experts, _ in routers}
    for child in module.children():
        if isinstance(child, nn.ModuleList) and len(child) in sizes and len({signature(m) for m in child}) == 1:
            gemms = tuple((m.in_features, m.out_features) for m in child[0].modules() if isinstance(m, nn.Linear))
            return RoutedExperts(len(child), frozenset(id(p) for p in child.parameters()), gemms, child)
    # an expert's GEMM reads or writes the width the router scores: Inkling2's and Mamba's depthwise conv
    # weights [channels, 1, kernel] beside a Linear of as many outputs hold no experts
    stacked = [p for _, p in stacked_weights(module)
               if any(p.shape[0] == experts and width in p.shape[1:] for experts, width in routers)]
    if stacked:
        return RoutedExperts(stacked[0].shape[0], frozenset(id(p) for p in stacked),
                             tuple((p.shape[1], p.shape[2]) for p in stacked), None)
    return None


def is_router(module: nn.Module, experts: int) -> bool:
    """A container's child that scores the experts: its one weight matrix has a row per expert (a gate Linear,
    transformers' router modules holding that weight, torchtitan's router around a Linear); a shared
    expert's 1-wide gate is not one."""
    weights = [p for p in module.parameters() if p.dim() == 2]
    return len(weights) == 1 and weights[0].shape[0] == experts


def shared_children(container: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, child, whether a shared expert) for an expert container's children that hold no routed expert
    weights: the router (not shared) and the shared experts with any gate of theirs."""
    experts = routed_experts(container)
    return [(name, child, not is_router(child, experts.count)) for name, child in container.named_children()
            if child is not experts.module_list and not any(id(q) in experts.param_ids for q in child.parameters())]


def is_expert_container(module: nn.Module) -> bool:
    return routed_experts(module) is not None
