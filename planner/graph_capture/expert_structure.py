"""What the runtime's expert parallelism needs to know of an experts container: how it routes (top-k,
groups) and which protocol its stacked weights are called through."""
from __future__ import annotations

import inspect

from torch import nn

from .module_kinds import routed_experts


def router_topk(module: nn.Module) -> int:
    """Experts per token, as the container or its router names it (0 when neither does)."""
    for owner in [module, *module.children()]:
        for attr in ("top_k", "router_topk", "num_experts_per_tok", "topk", "k"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def router_groups(module: nn.Module) -> tuple[int, int]:
    """Group-limited routing as the container or its router names it: (groups, groups each token may use);
    (1, 1) without. transformers' DeepSeek-V3 router: num_group / topk_group; the reference MoE: n_group."""
    for owner in [module, *module.children()]:
        groups = next((getattr(owner, a) for a in ("n_group", "num_group", "router_num_groups")
                       if isinstance(getattr(owner, a, None), int)), None)
        chosen = next((getattr(owner, a) for a in ("topk_group", "router_group_topk")
                       if isinstance(getattr(owner, a, None), int)), None)
        if groups and chosen and 0 < chosen <= groups:
            return groups, chosen
    return 1, 1


def indexed_experts(container: nn.Module) -> nn.Module | None:
    """The module holding all of the container's stacked expert weights when it is called with the
    routing as arguments, (tokens, expert index per token and slot, weight per token and slot), as
    transformers 5.x's experts modules are: an expert-parallel runtime can then hand it the tokens
    dispatched to its rank with their local expert index. None otherwise."""
    found = routed_experts(container)
    if found is None or found.module_list is not None:
        return None
    for sub in container.modules():
        own = {id(p) for p in sub.parameters(recurse=False)}
        if own >= found.param_ids:
            parameters = list(inspect.signature(sub.forward).parameters.values())
            positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            return sub if len(positional) == 3 and len(parameters) == 3 else None
    return None


def stacked_experts(container: nn.Module) -> bool:
    """Experts as stacked weights (not a ModuleList of expert modules) in a protocol runtime/experts.py
    shards: the reference MoE's route/routed, or an experts module called with the routing (transformers)."""
    found = routed_experts(container)
    return found is not None and found.module_list is None and (
        hasattr(container, "routed") or indexed_experts(container) is not None)
