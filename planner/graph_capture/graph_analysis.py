"""Structure from an fx graph: leaves, tensor-parallel pairs by dataflow, attention heads, experts."""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from .graph import TensorParallelPair
from .module_kinds import is_expert_container, is_linear_like, is_norm_like, may_be_activation, output_width

VIEW_OPS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "contiguous",
            "split", "chunk", "flatten", "size", "dim", "t", "unbind", "narrow", "type_as", "to", "float",
            "view_as_complex", "view_as_real", "unflatten", "movedim", "as_strided"}
VIEW_FUNCS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.split, torch.chunk,
              torch.unsqueeze, torch.squeeze, torch.flatten, torch.narrow, getattr, torch.view_as_complex,
              torch.view_as_real, torch.unbind, torch.movedim}
REDUCTIONS = {"mean", "sum", "var", "std", "norm", "amax", "max"}
ATTENTION_FUNCS = {F.scaled_dot_product_attention}


def is_varlen_attention(target) -> bool:
    """torch.nn.attention.varlen's custom op (torchtitan's varlen backend): q, k, v packed [tokens, heads,
    d], sequences given by cumulative lengths."""
    return str(target).startswith("torch_attn._varlen_attn")
MATMUL_FUNCS = {torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.addmm,
                torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.mm, torch.mm}
GROUPED_MM_FUNCS = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f}
KV_REPEAT_OPS = {"repeat_interleave", "expand", "repeat", "contiguous"}


def graph_topk(graph: fx.Graph, shapes: dict[str, tuple], num_experts: int) -> int:
    """k of the top-k that picks experts: a topk over a last dimension of `num_experts` (group-limited
    routers also take a top-k over groups first, which this skips)."""
    for node in graph.nodes:
        if function_name(node) != "topk" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if shapes.get(node.args[0].name, ())[-1:] == (num_experts,):
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            if isinstance(k, int):
                return k
    return 0


def node_module(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    return modules.get(node.target) if node.op == "call_module" else None


# the activations of gated linear units: SwiGLU's silu(gate) * up, GeGLU's gelu(gate) * up
GATE_ACTIVATIONS = {"silu", "gelu"}
# the autograd nodes they leave on their outputs (SiluBackward0, ...): how a tensor made inside an opaque
# leaf (an expert container) is told apart where no graph node says what made it
GATE_ACTIVATION_BACKWARDS = tuple(f"{name.capitalize()}Backward" for name in sorted(GATE_ACTIVATIONS))
# what an expert's activation leaves on its output: a gating activation's, or the gating multiply's, or a plain
# activation's (ReLU, squared ReLU as a power)
EXPERT_ACTIVATION_BACKWARDS = GATE_ACTIVATION_BACKWARDS + ("MulBackward", "ReluBackward", "PowBackward",
                                                           "SigmoidBackward", "TanhBackward")


def is_multiply(node: fx.Node) -> bool:
    return node.target is operator.mul or function_name(node) in ("mul", "mul_")


def is_activation_node(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """An activation module (transformers' ACT2FN classes) or a silu / gelu call."""
    module = node_module(node, modules)
    return may_be_activation(module) if module is not None else function_name(node) in GATE_ACTIVATIONS


def function_name(node: fx.Node) -> str:
    """What a call_method or call_function node calls, by name: `view` for both x.view and
    torch.Tensor.view (the recording front end writes Tensor methods as functions)."""
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


# the ops over the attention scores a fused softmax kernel takes in: Megatron's FusedScaleMaskSoftmax scales,
# masks and normalises in one pass over the scores (megatron/model/fused_softmax.py, --masked-softmax-fusion)
SCORE_OPS_BEFORE_SOFTMAX = 4


def feeds_softmax(node: fx.Node, modules: dict) -> bool:
    """Whether `node` (an op over attention scores) reaches a softmax through single-user ops, at most
    SCORE_OPS_BEFORE_SOFTMAX of them: the scale, mask (and soft cap) a fused softmax kernel applies itself."""
    for _ in range(SCORE_OPS_BEFORE_SOFTMAX):
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
        module = modules.get(node.target) if node.op == "call_module" else None
        if function_name(node) == "softmax" or isinstance(module, nn.Softmax):
            return True
    return False


def block_window(block: nn.Module) -> int:
    """The keys each query sees in a block whose attention slides (0: all). A module's own `sliding_window`
    decides where it has one, None included (transformers' Gemma 3 and Qwen2 set it per layer type); else the
    config the block's modules read (Mistral and Phi-3 read `config.sliding_window`)."""
    own = [m.sliding_window for m in block.modules() if "sliding_window" in vars(m)]
    found = own if own else [getattr(getattr(m, "config", None), "sliding_window", None) for m in block.modules()]
    windows = [w for w in found if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(windows, default=0)


def is_view_node(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_OPS
    if node.op != "call_function":
        return False
    if node.target in VIEW_FUNCS:
        return True
    is_tensor_method = getattr(node.target, "__objclass__", None) is torch._C.TensorBase or \
        getattr(torch.Tensor, getattr(node.target, "__name__", ""), None) is node.target
    return is_tensor_method and function_name(node) in VIEW_OPS | {"__getitem__", "view_as", "expand_as"}


def is_linear_node(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    module = node_module(node, modules)
    return (module is not None and is_linear_like(module)) or (
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


SPLITS = ("split", "chunk", "unbind", "split_with_sizes", "tensor_split")
RESHAPES = ("view", "reshape", "transpose", "permute", "contiguous")


def _is_split(column: fx.Node, modules: dict[str, nn.Module], shapes: dict[str, tuple]) -> bool:
    """A Linear whose whole output is cut into parts ([q | k | v] or [gate | up] side by side: GPT-2,
    Phi-3): splitting its rows among tp ranks would mix the parts. A split within each head after a
    reshape to heads (GPT-NeoX's interleaved QKV, MLA's nope/rope parts, RoPE's halves) is not."""
    module = node_module(column, modules)
    width = output_width(module) if module is not None else shapes.get(column.name, (0,))[-1]
    frontier = list(column.users)
    while frontier:
        node = frontier.pop()
        name = function_name(node)
        if name in SPLITS or (name in ("__getitem__", "getitem") and len(node.args) > 1 and _slices(node.args[1])):
            source = node.args[0]
            shape = shapes.get(source.name, ()) if isinstance(source, fx.Node) else ()
            on_last = _split_dim(node, name, len(shape)) in (-1, len(shape) - 1)
            # the whole width cut side by side, or the heads axis cut into q / k / v head groups
            if shape and (not on_last or shape[-1] == width) and not _rejoined(node):
                return True
            continue
        if name in RESHAPES:
            frontier.extend(node.users)
    return False


def _split_dim(node: fx.Node, name: str, rank: int) -> int:
    """The axis a split, chunk or slice cuts (torch.split and chunk default to 0; unbind too)."""
    if name in ("__getitem__", "getitem"):
        items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if Ellipsis in items:  # x[..., a:b]: counted from the end
            after = items[items.index(Ellipsis) + 1:]
            cut = next((i for i, item in enumerate(after) if isinstance(item, slice)), 0)
            return rank - len(after) + cut
        return next((i for i, item in enumerate(items) if isinstance(item, slice)
                     and (item.start is not None or item.stop is not None)), 0)
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if name == "unbind":
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return dim if isinstance(dim, int) else 0


def _rejoined(part: fx.Node) -> bool:
    """The slice (or a split's parts) goes straight back into a cat, possibly negated: RoPE's rotate_half."""
    nodes = [part] + [u for u in part.users if function_name(u) in ("getitem", "__getitem__")]
    for node in nodes:
        for user in node.users:
            name = function_name(user)
            if name == "cat" or (name in ("neg", "__neg__") and any(function_name(u) == "cat" for u in user.users)):
                return True
    return False


def _slices(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, slice) and (i.start is not None or i.stop is not None) for i in items)


def _per_head_norm(module: nn.Module | None, column: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A norm over one head's channels (Qwen3 / Gemma 3 q_norm and k_norm): it acts within each head, so
    it stays inside a column-parallel region that splits the heads."""
    if module is None or not is_norm_like(module) or getattr(module, "weight", None) is None:
        return False
    width = module.weight.numel()
    column_module = node_module(column, modules)
    if column_module is None:
        return False
    out_features = output_width(column_module)
    return 0 < width < out_features and out_features % width == 0


def head_norms(graph: fx.Graph, modules: dict[str, nn.Module], shapes: dict[str, tuple]
               ) -> tuple[tuple[str, int], ...]:
    """Per-head norms that sit between a column and its row (module path, heads axis of the input)."""
    found = []
    for node in graph.nodes:
        module = node_module(node, modules)
        if module is None or not is_norm_like(module) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        column = _nearest_linear(node.args[0], modules)
        if column is None or not _per_head_norm(module, column, modules):
            continue
        shape = shapes.get(node.args[0].name, ())
        width = module.weight.numel()
        heads = output_width(node_module(column, modules)) // width
        axes = [i for i in range(len(shape) - 1) if shape[i] == heads]
        if axes and node.target not in {name for name, _ in found}:
            found.append((node.target, axes[-1]))
    return tuple(found)


def _nearest_linear(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The Linear a tensor comes from through views (q_proj(x).view(b, s, heads, d))."""
    while node is not None:
        if is_linear_node(node, modules):
            return node
        if not is_view_node(node) or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return None


def _linear_name(node: fx.Node) -> str:
    return node.target if node.op == "call_module" else node.name


def find_tp_pairs(graph: fx.Graph, modules: dict[str, nn.Module], shapes: dict[str, tuple] | None = None
                  ) -> tuple[tuple[TensorParallelPair, ...], set[str]]:
    """Column -> row Linear pairs by dataflow, and the names of the nodes strictly between them. With the
    measured `shapes`, columns whose whole output is split into parts are marked fused."""
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
            elif _per_head_norm(node_module(node, modules), start, modules):
                stack.extend(node.users)
            elif is_barrier(node, modules):
                clean = False
            else:
                stack.extend(node.users)
        if clean and len(rows) == 1:
            if shapes is not None and _is_split(start, modules, shapes):
                fused.add(_linear_name(start))
            row_name, row = next(iter(rows.items()))
            columns_of.setdefault(_linear_name(row), []).append(_linear_name(start))
            region |= seen - {row_name}
    pairs = tuple(TensorParallelPair(columns=tuple(cols), row=row, fused_columns=tuple(c for c in cols if c in fused))
                  for row, cols in columns_of.items())
    return pairs, region


def _kv_parent(node: fx.Node) -> fx.Node | None:
    """Step back over kv-head repeats (repeat_interleave, or Hugging Face's repeat_kv: index with None,
    expand, reshape) and the last-two-dims transpose of K; None when done."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name = function_name(node)
    if name in KV_REPEAT_OPS or name in ("reshape", "__getitem__", "getitem", "unsqueeze"):
        return node.args[0]
    if name == "transpose" and tuple(node.args[1:3]) in ((-1, -2), (-2, -1), (2, 3), (3, 2)):
        return node.args[0]
    return None


def attention_heads(graph: fx.Graph, shapes: dict[str, tuple]) -> tuple[int, int, int]:
    """(query heads, kv groups, head dim) from the first attention op's operands, [b, heads, s, d]."""
    for node in graph.nodes:
        if node.op == "call_function" and is_varlen_attention(node.target):   # [tokens, heads, d]
            q_shape, k_shape = shapes.get(node.args[0].name, ()), shapes.get(node.args[1].name, ())
            if len(q_shape) == 3 and len(k_shape) == 3:
                return q_shape[1], k_shape[1], q_shape[2]
        if (node.op == "call_function" and (node.target in ATTENTION_FUNCS or node.target in MATMUL_FUNCS)) \
                or node.meta.get("attention_core"):
            q, k = node.args[0], node.args[1]
            if not (isinstance(q, fx.Node) and isinstance(k, fx.Node)) or k.op == "get_attr":
                continue
            q_shape = shapes.get(q.name)
            if q_shape is None or len(q_shape) != 4:
                continue
            if node.meta.get("attention_core") == "bshd":   # [b, s, heads, d]: an attention kernel module
                return q_shape[2], shapes[k.name][2], q_shape[3]
            parent = _kv_parent(k)
            while parent is not None:  # the first [b, heads, s, d] before any repeat holds the kv heads
                shape = shapes.get(parent.name, ())
                if len(shape) == 4 and shape[2] == q_shape[2] and q_shape[1] % shape[1] == 0:
                    k = parent
                elif len(shape) == 4 or len(shape) < 3:
                    break
                parent = _kv_parent(parent)
            return q_shape[1], shapes[k.name][1], q_shape[3]
    return 0, 0, 0


@contextlib.contextmanager
def while_running(entered: list[tuple[nn.Module, object]], leave):
    """Hooks around each module's forward while the block runs: its own `enter(module, args)` before, `leave`
    after; removed on exit."""
    handles = [h for module, enter in entered
               for h in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
