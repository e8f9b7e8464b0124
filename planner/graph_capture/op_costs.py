"""Work of one fx node from its operand shapes: FLOPs (forward, backward split) and bytes moved."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import fx, nn

from cost_models.layout import RecomputeModule
from cost_models.records import OpCost, OpKind, Sharding

from .expert_structure import router_topk
from .graph_analysis import ATTENTION_FUNCS, GROUPED_MM_FUNCS, MATMUL_FUNCS, is_varlen_attention, is_view_node
from .module_kinds import is_linear_like, is_norm_like, linear_features, routed_experts


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


def linear_cost(name: str, x: torch.Tensor, weight: torch.Tensor, out, sharding: Sharding,
                features: tuple[int, int] | None = None) -> OpCost:
    n_in, n_out = features or (weight.shape[1], weight.shape[0])
    tokens = x.numel() // n_in
    return _gemm(name, sharding, tokens, n_in, n_out, tensor_bytes(x) + tensor_bytes(out) + tensor_bytes(weight),
                 tensor_bytes(weight))


def attention_cost(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out, window: int = 0) -> OpCost:
    # QK^T and PV: 2*b*h*s*keys*(d + d_v), counted without the causal half (model-FLOPs convention), keys = s_kv or,
    # under a sliding window of w keys, w: a causal windowed kernel computes w s - w (w - 1) / 2 of those pairs
    # (query i sees min(i + 1, w) keys: transformers' sliding_window_overlay, kv > q - w)
    batch_heads = math.prod(q.shape[:-2])
    s, d = q.shape[-2], q.shape[-1]
    s_kv, d_v = k.shape[-2], v.shape[-1]
    windowed = 0 < window < s_kv
    keys = window if windowed else s_kv
    flops = 2.0 * batch_heads * s * keys * (d + d_v)
    moved = tensor_bytes(q) + tensor_bytes(k) + tensor_bytes(v) + tensor_bytes(out)
    return OpCost(name, OpKind.attention, Sharding.tensor, flops, 2 * flops, 0.0, moved, None,
                  causal_work=1 - (window - 1) / (2 * s) if windowed else None)


def matmul_cost(name: str, a: torch.Tensor, b: torch.Tensor, out, sharding: Sharding) -> OpCost:
    """An activation x activation matmul (attention scores, probs x values)."""
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    batch = math.prod(out.shape[:-2]) if out.dim() > 2 else 1
    flops = 2.0 * batch * m * n * k
    moved = tensor_bytes(a) + tensor_bytes(b) + tensor_bytes(out)
    return OpCost(name, OpKind.attention_matmul, sharding, flops, 2 * flops, 0.0, moved, (m, n, k), batch)


def varlen_attention_cost(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q, out) -> OpCost:
    # packed sequences [tokens, heads, d]: 2 h (d + d_v) sum(len_i^2), each sequence attending to itself
    # (non-causal count, as attention_cost); cu_seq_q holds the cumulative lengths, real-valued in capture
    lengths = torch.diff(cu_seq_q.to("cpu")).to(torch.float64) if not cu_seq_q.is_meta else \
        torch.tensor([float(q.shape[0])], dtype=torch.float64)
    flops = 2.0 * q.shape[1] * (q.shape[-1] + v.shape[-1]) * float((lengths ** 2).sum())
    moved = tensor_bytes(q) + tensor_bytes(k) + tensor_bytes(v) + tensor_bytes(out)
    return OpCost(name, OpKind.attention, Sharding.tensor, flops, 2 * flops, 0.0, moved, None)


def grouped_mm_cost(name: str, a: torch.Tensor, b: torch.Tensor, out, weight_bytes: float) -> OpCost:
    """torch._grouped_mm of routed tokens [S, in] by stacked expert weights [E, in, out]: S rows in all,
    however the router spread them (balanced: S/E per expert for the GEMM shape)."""
    experts, n_in, n_out = b.shape
    rows = a.numel() // n_in
    moved = tensor_bytes(a) + tensor_bytes(b) + tensor_bytes(out)
    return _gemm(name, Sharding.expert, rows / experts, n_in, n_out, moved, weight_bytes, experts)


def elementwise_cost(name: str, args, out, sharding: Sharding, kind: OpKind = OpKind.elementwise) -> OpCost:
    moved = sum(tensor_bytes(a) for a in args) + tensor_bytes(out)
    numel = out.numel() if isinstance(out, torch.Tensor) else 0
    return OpCost(name, kind, sharding, float(numel), float(numel), 0.0, moved, None)


def _activation_widths(gemms: tuple[tuple[int, int], ...], hidden: int) -> list[int]:
    """Each expert GEMM's side other than the hidden size: the up side(s) and the down-projection's input."""
    return [n_out if n_in == hidden else n_in for n_in, n_out in gemms]


def expert_down_width(gemms: tuple[tuple[int, int], ...], hidden: int) -> int:
    """The width of an expert's down-projection input (the activation's output): the narrowest side."""
    return min(_activation_widths(gemms, hidden))


def experts_gated(gemms: tuple[tuple[int, int], ...], hidden: int) -> bool:
    """Whether experts' activation gates (act(gate) * up): their up side is twice as wide as the
    down-projection's input f, the narrowest (one gate-and-up GEMM 2f wide, or a gate and an up GEMM)."""
    widths = _activation_widths(gemms, hidden)
    return sum(widths) - min(widths) > min(widths)


def expert_activation_elements(gemms: tuple[tuple[int, int], ...], hidden: int) -> tuple[int, int]:
    """(written, moved) elements per routed token of the activation between an expert's up- and
    down-projections, run as the model's code runs a dense layer's (no fused kernel credited). Gated:
    act(gate) reads and writes f, the product reads 2f and writes f, 5f moved; plain: 2f."""
    written = min(_activation_widths(gemms, hidden))
    return written, 5 * written if experts_gated(gemms, hidden) else 2 * written


def expert_costs(name: str, module: nn.Module, x: torch.Tensor, out, topk: int) -> list[OpCost]:
    """Router, routed experts (balanced: tokens*k spread over experts) with the activation between their
    GEMMs, and shared experts of a MoE leaf."""
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
    if len(experts.gemms) > 1:
        written, moved = expert_activation_elements(experts.gemms, hidden)
        slots = tokens * topk
        costs.append(OpCost(f"{name}.experts.activation", OpKind.elementwise, Sharding.expert, float(slots * written),
                            float(slots * written), 0.0, slots * moved * size, None,
                            inner_module=RecomputeModule.moe_act))
    expert_modules = set(experts.module_list.modules()) if experts.module_list is not None else set()
    for child_name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or child in expert_modules:
            continue
        weight_bytes = child.weight.numel() * child.weight.element_size()
        moved = tokens * (child.in_features + child.out_features) * size + weight_bytes
        router = child.out_features == experts.count
        gemm = _gemm(f"{name}.{child_name}", Sharding.sequence if router else Sharding.tensor,
                     tokens, child.in_features, child.out_features, moved, weight_bytes)
        costs.append(gemm if router else replace(gemm, inner_module=RecomputeModule.shared_experts))
    costs.append(elementwise_cost(f"{name}.dispatch_combine", [x] * (2 * topk), out, Sharding.sequence))
    routed = tokens * topk * hidden   # one copy of the routed tokens, read and written; its count: the experts
    costs.append(OpCost(f"{name}.dispatcher_copy", OpKind.token_copy, Sharding.sequence, float(routed),
                        float(routed), 0.0, 2.0 * routed * size, None, experts.count))   # they are sorted among
    return costs


def storage_key(t: torch.Tensor) -> int:
    """A tensor's storage: views of one weight (transposed, indexed) share it."""
    return t.untyped_storage()._cdata


def node_costs(node: fx.Node, module: nn.Module | None, args, out, sharding: Sharding,
               storages: set[int], window: int = 0) -> list[OpCost]:
    """Costs of one executed node; views and shape queries cost nothing. `storages` holds the
    parameters' storages: a matmul by one (or a view of one: a transposed or indexed weight) is a GEMM. `window`:
    the keys each query sees where the block's attention slides (0: all)."""
    name = node.name
    if node.op in ("placeholder", "output", "get_attr"):
        return []
    if is_view_node(node):
        return []
    if module is not None and is_linear_like(module):
        return [linear_cost(node.target, args[0], module.weight, out, sharding, linear_features(module, args[0]))]
    if isinstance(module, nn.Embedding) or (node.op == "call_function" and node.target is F.embedding):
        return [elementwise_cost(name, [out], out, Sharding.tensor, OpKind.embedding)]
    if module is not None and routed_experts(module) is not None:
        return expert_costs(node.target, module, args[0], out, router_topk(module))
    if module is not None and is_norm_like(module):
        return [elementwise_cost(node.target, args, out, sharding)]
    if node.op == "call_function" and node.target is F.linear:
        return [linear_cost(name, args[0], args[1], out, sharding)]
    if node.op == "call_function" and node.target in ATTENTION_FUNCS:
        return [attention_cost(name, args[0], args[1], args[2], out, window)]
    if node.op == "call_function" and is_varlen_attention(node.target):
        return [varlen_attention_cost(name, args[0], args[1], args[2], args[3],
                                      out[0] if isinstance(out, (tuple, list)) else out)]
    is_matmul = (node.op == "call_function" and node.target in MATMUL_FUNCS) or (
        node.op == "call_method" and node.target in ("matmul", "bmm"))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if node.op == "call_function" and node.target in GROUPED_MM_FUNCS:
        weight = tensors[1]
        state = storage_key(weight) in storages
        return [grouped_mm_cost(name, tensors[0], weight, out, tensor_bytes(weight) if state else 0.0)]
    if is_matmul and len(tensors) >= 2:
        a, b = tensors[-2], tensors[-1]
        if storage_key(b) in storages or storage_key(a) in storages:
            weight = b if storage_key(b) in storages else a
            return [_gemm(name, sharding, a.numel() // a.shape[-1], a.shape[-1], weight.shape[-1],
                          tensor_bytes(tensors) + tensor_bytes(out), tensor_bytes(weight))]
        return [matmul_cost(name, a, b, out, sharding)]
    if node.op == "call_function" and node.target is F.cross_entropy:
        return [elementwise_cost(name, args, out, sharding, OpKind.loss)]
    return [elementwise_cost(name, tensors, out, sharding)]
