"""Structure from an fx graph: leaves, tensor-parallel pairs by dataflow, attention heads, experts."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from .graph import TensorParallelPair

VIEW_OPS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "contiguous",
            "split", "chunk", "flatten", "size", "dim", "t", "unbind", "narrow", "type_as", "to", "float"}
VIEW_FUNCS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.split, torch.chunk,
              torch.unsqueeze, torch.squeeze, torch.flatten, torch.narrow, getattr}
REDUCTIONS = {"mean", "sum", "var", "std", "norm", "amax", "max"}
ATTENTION_FUNCS = {F.scaled_dot_product_attention}
MATMUL_FUNCS = {torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.einsum}
KV_REPEAT_OPS = {"repeat_interleave", "expand", "repeat", "contiguous"}


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


def routed_experts(module: nn.Module) -> RoutedExperts | None:
    sizes = {m.out_features for m in module.children() if isinstance(m, nn.Linear)}
    if not sizes:
        return None
    for child in module.children():
        if isinstance(child, nn.ModuleList) and len(child) in sizes and len({signature(m) for m in child}) == 1:
            gemms = tuple((m.in_features, m.out_features) for m in child[0].modules() if isinstance(m, nn.Linear))
            return RoutedExperts(len(child), frozenset(id(p) for p in child.parameters()), gemms, child)
    stacked = [p for p in module.parameters() if p.dim() == 3 and p.shape[0] in sizes]
    if stacked:
        return RoutedExperts(stacked[0].shape[0], frozenset(id(p) for p in stacked),
                             tuple((p.shape[1], p.shape[2]) for p in stacked), None)
    return None


def is_expert_container(module: nn.Module) -> bool:
    return routed_experts(module) is not None


def router_topk(module: nn.Module) -> int:
    for attr in ("top_k", "router_topk", "num_experts_per_tok", "topk", "k"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


def node_module(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    return modules.get(node.target) if node.op == "call_module" else None


def is_linear_node(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    return isinstance(node_module(node, modules), nn.Linear) or (
        node.op == "call_function" and node.target is F.linear)


def is_barrier(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Where a column-parallel output may not flow: norms, experts, reductions, the graph output."""
    module = node_module(node, modules)
    if module is not None and (is_norm_like(module) or is_expert_container(module)
                               or isinstance(module, nn.LayerNorm | nn.Embedding)):
        return True
    if node.op == "output":
        return True
    if node.op == "call_method" and node.target in REDUCTIONS:
        return True
    return node.op == "call_function" and getattr(node.target, "__name__", "") in REDUCTIONS


def _linear_name(node: fx.Node) -> str:
    return node.target if node.op == "call_module" else node.name


def find_tp_pairs(graph: fx.Graph, modules: dict[str, nn.Module]) -> tuple[tuple[TensorParallelPair, ...], set[str]]:
    """Column -> row Linear pairs by dataflow, and the names of the nodes strictly between them."""
    columns_of: dict[str, list[str]] = {}
    fused: set[str] = set()
    region: set[str] = set()
    for start in graph.nodes:
        if not is_linear_node(start, modules):
            continue
        seen: set[str] = set()
        rows: dict[str, fx.Node] = {}
        stack, clean = list(start.users), True
        while stack and clean:
            node = stack.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if is_linear_node(node, modules):
                rows[node.name] = node
            elif is_barrier(node, modules):
                clean = False
            else:
                stack.extend(node.users)
        if clean and len(rows) == 1:
            if any((u.op == "call_method" and u.target in ("split", "chunk", "unbind"))
                   or u.target in (torch.split, torch.chunk) for u in start.users):
                fused.add(_linear_name(start))
            row_name, row = next(iter(rows.items()))
            columns_of.setdefault(_linear_name(row), []).append(_linear_name(start))
            region |= seen - {row_name}
    pairs = tuple(TensorParallelPair(columns=tuple(cols), row=row, fused_columns=tuple(c for c in cols if c in fused))
                  for row, cols in columns_of.items())
    return pairs, region


def _kv_parent(node: fx.Node) -> fx.Node | None:
    """Step back over kv-head repeats and the last-two-dims transpose of K; None when done."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in KV_REPEAT_OPS:
        return node.args[0]
    if name == "transpose" and tuple(node.args[1:3]) in ((-1, -2), (-2, -1), (2, 3), (3, 2)):
        return node.args[0]
    return None


def attention_heads(graph: fx.Graph, shapes: dict[str, tuple]) -> tuple[int, int, int]:
    """(query heads, kv groups, head dim) from the first attention op's operands, [b, heads, s, d]."""
    for node in graph.nodes:
        if node.op == "call_function" and (node.target in ATTENTION_FUNCS or node.target in MATMUL_FUNCS):
            q, k = node.args[0], node.args[1]
            if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)) or k.op == "get_attr":
                continue
            q_shape = shapes.get(q.name)
            if q_shape is None or len(q_shape) != 4:
                continue
            parent = _kv_parent(k)
            while parent is not None and len(shapes.get(parent.name, ())) == 4:
                k, parent = parent, _kv_parent(parent)
            return q_shape[1], shapes[k.name][1], q_shape[3]
    return 0, 0, 0
