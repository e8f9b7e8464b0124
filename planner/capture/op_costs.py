"""Work of one fx node from its operand shapes: FLOPs (forward, backward split) and bytes moved."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx, nn

from cost_models.records import OpCost, OpKind, Sharding

from .graph_analysis import ATTENTION_FUNCS, MATMUL_FUNCS, VIEW_FUNCS, VIEW_OPS, is_norm_like, routed_experts, router_topk


def tensor_bytes(value) -> float:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0.0


def _gemm(name, sharding, tokens, n_in, n_out, bytes_moved, weight_bytes, count=1) -> OpCost:
    # a (tokens x n_in) @ (n_in x n_out) GEMM: 2mnk forward; input and weight gradients each 2mnk
    flops = 2.0 * tokens * n_in * n_out * count
    return OpCost(name, OpKind.gemm, sharding, flops, flops, flops, bytes_moved,
                  (int(tokens), int(n_out), int(n_in)), count, float(weight_bytes))


def linear_cost(name: str, x: torch.Tensor, weight: torch.Tensor, out, sharding: Sharding) -> OpCost:
    n_out, n_in = weight.shape
    tokens = x.numel() // n_in
    return _gemm(name, sharding, tokens, n_in, n_out, tensor_bytes(x) + tensor_bytes(out) + tensor_bytes(weight),
                 tensor_bytes(weight))


def attention_cost(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out) -> OpCost:
    # QK^T and PV: 2*b*h*s*s_kv*(d + d_v), counted without the causal half (model-FLOPs convention)
    batch_heads = math.prod(q.shape[:-2])
    s, d = q.shape[-2], q.shape[-1]
    s_kv, d_v = k.shape[-2], v.shape[-1]
    flops = 2.0 * batch_heads * s * s_kv * (d + d_v)
    moved = tensor_bytes(q) + tensor_bytes(k) + tensor_bytes(v) + tensor_bytes(out)
    return OpCost(name, OpKind.attention, Sharding.tensor, flops, 2 * flops, 0.0, moved, None)


def matmul_cost(name: str, a: torch.Tensor, b: torch.Tensor, out, sharding: Sharding) -> OpCost:
    """An activation x activation matmul (attention scores, probs x values)."""
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = math.prod(out.shape[:-2]) if out.dim() > 2 else 1
    flops = 2.0 * batch * m * n * k
    moved = tensor_bytes(a) + tensor_bytes(b) + tensor_bytes(out)
    return OpCost(name, OpKind.attention_matmul, sharding, flops, 2 * flops, 0.0, moved, (m, n, k), batch)


def elementwise_cost(name: str, args, out, sharding: Sharding, kind: OpKind = OpKind.elementwise) -> OpCost:
    moved = sum(tensor_bytes(a) for a in args) + tensor_bytes(out)
    numel = out.numel() if isinstance(out, torch.Tensor) else 0
    return OpCost(name, kind, sharding, float(numel), float(numel), 0.0, moved, None)


def expert_costs(name: str, module: nn.Module, x: torch.Tensor, out, topk: int) -> list[OpCost]:
    """Router, routed experts (balanced: tokens*k spread over experts) and shared experts of a MoE leaf."""
    experts = routed_experts(module)
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    per_expert = tokens * topk / experts.count
    size = x.element_size()
    costs = []
    for n_in, n_out in experts.gemms:
        moved = (per_expert * (n_in + n_out) * size + n_in * n_out * size) * experts.count
        costs.append(_gemm(f"{name}.experts[{n_in}x{n_out}]", Sharding.expert, per_expert, n_in, n_out,
                           moved, n_in * n_out * size * experts.count, experts.count))
    expert_modules = set(experts.module_list.modules()) if experts.module_list is not None else set()
    for child_name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or child in expert_modules:
            continue
        weight_bytes = child.weight.numel() * child.weight.element_size()
        moved = tokens * (child.in_features + child.out_features) * size + weight_bytes
        router = child.out_features == experts.count
        costs.append(_gemm(f"{name}.{child_name}", Sharding.sequence if router else Sharding.tensor,
                           tokens, child.in_features, child.out_features, moved, weight_bytes))
    costs.append(elementwise_cost(f"{name}.dispatch_combine", [x] * (2 * topk), out, Sharding.sequence))
    return costs


def node_costs(node: fx.Node, module: nn.Module | None, args, out, sharding: Sharding,
               params: set[int]) -> list[OpCost]:
    """Costs of one executed node; views and shape queries cost nothing."""
    name = node.name
    if node.op in ("placeholder", "output", "get_attr"):
        return []
    if node.op == "call_method" and node.target in VIEW_OPS:
        return []
    if node.op == "call_function" and node.target in VIEW_FUNCS:
        return []
    if isinstance(module, nn.Linear):
        return [linear_cost(node.target, args[0], module.weight, out, sharding)]
    if isinstance(module, nn.Embedding) or (node.op == "call_function" and node.target is F.embedding):
        return [elementwise_cost(name, [out], out, Sharding.tensor, OpKind.embedding)]
    if module is not None and routed_experts(module) is not None:
        return expert_costs(node.target, module, args[0], out, router_topk(module))
    if module is not None and is_norm_like(module):
        return [elementwise_cost(node.target, args, out, sharding)]
    if node.op == "call_function" and node.target is F.linear:
        return [linear_cost(name, args[0], args[1], out, sharding)]
    if node.op == "call_function" and node.target in ATTENTION_FUNCS:
        return [attention_cost(name, args[0], args[1], args[2], out)]
    is_matmul = (node.op == "call_function" and node.target in MATMUL_FUNCS) or (
        node.op == "call_method" and node.target in ("matmul", "bmm"))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if is_matmul and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if id(b) in params or id(a) in params:
            weight = b if id(b) in params else a
            return [_gemm(name, sharding, a.numel() // a.shape[-1], a.shape[-1], weight.shape[-1],
                          tensor_bytes(tensors) + tensor_bytes(out), tensor_bytes(weight))]
        return [matmul_cost(name, a, b, out, sharding)]
    if node.op == "call_function" and node.target is F.cross_entropy:
        return [elementwise_cost(name, args, out, sharding, OpKind.loss)]
    return [elementwise_cost(name, tensors, out, sharding)]
