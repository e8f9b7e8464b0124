"""Capture: trace any nn.Module with torch.fx on the meta device and measure what each node costs.

Repeated blocks are found from the module tree (a ModuleList of alike modules) and each distinct kind
is traced and measured once, so capture time does not grow with depth or width. Saved-for-backward
bytes are measured for real: the graph runs forward on meta tensors under saved_tensors_hooks and every
saved storage is attributed to the node that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from cost_models.records import OpCost, OpKind, SavedTensor, Sharding
from hardware_profiles.errors import UserInputError

from .graph_analysis import (MATMUL_FUNCS, attention_heads, find_tp_pairs, is_expert_container, is_norm_like,
                             routed_experts, router_topk)
from .graph import BlockStructure
from .reference_model import CoreAttention
from .op_costs import node_costs


class CaptureTracer(fx.Tracer):
    """fx tracer that treats norms, expert containers and chosen modules as leaves."""
    proxy_buffer_attributes = True  # RoPE slices its cos/sin buffers (torch-notes: fixes cos[:s])

    def __init__(self, leaf_ids: set[int] = frozenset(), leaf_names: tuple[str, ...] = ()):
        super().__init__()
        self.leaf_ids = set(leaf_ids)
        self.leaf_names = leaf_names
        self.entered_modules: list[str] = []
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self.leaf_ids or is_norm_like(m) or is_expert_container(m):
            return True
        if any(qualname == n or qualname.endswith("." + n) for n in self.leaf_names):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.entered_modules.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.entered_modules[-1]
            raise
        finally:
            self.entered_modules.pop()


def trace(root: nn.Module, leaf_ids: set[int] = frozenset(), leaf_names: tuple[str, ...] = (),
          label: str = "model") -> fx.GraphModule:
    tracer = CaptureTracer(leaf_ids, leaf_names)
    try:
        graph = tracer.trace(root)
    except Exception as exc:  # turn any tracing failure into one paragraph naming the module
        where = tracer.failed_in or type(root).__name__
        op = str(exc).splitlines()[0][:300]
        raise UserInputError(
            f"cannot trace {label}: module '{where or type(root).__name__}' failed with {type(exc).__name__}: "
            f"{op}", expected=f"a module torch.fx can trace; mark it a leaf with leaf_modules=['{where}'] "
            "(--leaf-modules on the CLI) so that it is measured as one op") from None
    return fx.GraphModule(root, graph)


# what op_costs bills as GEMMs, plus the Tensor-method spellings a torch function mode sees
GEMM_FUNCTIONS = {F.linear, torch.mm, *MATMUL_FUNCS, torch.Tensor.__matmul__, torch.Tensor.matmul,
                  torch.Tensor.bmm, torch.Tensor.mm}


class _GemmTracker(TorchFunctionMode):
    """Knows, while a torch function runs (inside leaf modules too), whether it multiplies by a weight:
    autograd packs that function's saved tensors before it returns."""

    def __init__(self, state_keys: set[int]):
        super().__init__()
        self.state_keys = state_keys
        self.depth_in_weight_gemm = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight_gemm = func in GEMM_FUNCTIONS and _has_state(list(args) + list(kwargs.values()), self.state_keys)
        self.depth_in_weight_gemm += weight_gemm
        try:
            return func(*args, **kwargs)
        finally:
            self.depth_in_weight_gemm -= weight_gemm


def _has_state(args, state_keys: set[int]) -> bool:
    return any(isinstance(a, torch.Tensor) and _storage_key(a) in state_keys for a in args)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _FlashAttention(torch.autograd.Function):
    """SDPA measured as a fused flash kernel: saves q, k, v, the output and the fp32 log-sum-exp,
    never the s x s matrix (on meta SDPA would take the math path and save it). The output is laid
    out [b, s, heads, d] and returned transposed, as CUDA's flash kernel returns it, so the usual
    transpose-and-reshape into the output projection is a view that shares its storage (measured on
    an H200: one h-wide tensor per layer less than a [b, heads, s, d] output; docs/gpu-validation.md)."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, heads, s = q.shape[:-1]
        out = q.new_empty(b, s, heads, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@dataclass
class _Savers:
    """Who keeps one saved storage: FP8 training casts a weight GEMM's input to a 1-byte copy and keeps
    that (Transformer Engine Linear: saved_inputmat = the FP8 inputmat); other savers keep the original."""
    saved: list
    index: int
    elements: int
    gemm: bool = False
    other: bool = False

    def add(self, is_weight_gemm: bool) -> None:
        self.gemm |= is_weight_gemm
        self.other |= not is_weight_gemm
        record = self.saved[self.index]
        fp8_bytes = (record.bytes if self.other else 0.0) + (self.elements if self.gemm else 0.0)
        self.saved[self.index] = replace(record, fp8_bytes=float(fp8_bytes))


@dataclass
class Measured:
    ops: list[OpCost] = field(default_factory=list)
    saved: list[SavedTensor] = field(default_factory=list)
    shapes: dict[str, tuple] = field(default_factory=dict)
    output: object = None
    warnings: list[str] = field(default_factory=list)


class _Analyzer(fx.Interpreter):
    """Runs a graph on meta tensors; records node costs and attributes saved tensors to producers."""

    def __init__(self, gm: fx.GraphModule, tensor_region: set[str], seq_len: int, part_of=None):
        super().__init__(gm)
        self.modules = dict(gm.named_modules())
        self.tensor_region = tensor_region
        self.seq_len = seq_len
        self.part_of = part_of or (lambda node: "all")
        self.state_keys = {_storage_key(t) for t in list(gm.parameters()) + list(gm.buffers())}
        self.param_ids = {id(p) for p in gm.parameters()}
        self.producer: dict[int, str] = {}
        self.seen: set[int] = set()
        self.alive: list[torch.Tensor] = []  # storages are keyed by address: keep them from being reused
        self.current: fx.Node | None = None
        self.gemms = _GemmTracker(self.state_keys)
        self.attention_nodes: set[str] = set()   # q k^T and the scale/mask/softmax/dropout applied to it
        self.savers: dict[int, _Savers] = {}
        self.results: dict[str, Measured] = {}

    def _sharding(self, node: fx.Node) -> Sharding:
        return Sharding.tensor if node.name in self.tensor_region else Sharding.sequence

    def pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self.savers and self.current is not None:
            self.savers[key].add(self.gemms.depth_in_weight_gemm > 0)
        if key in self.state_keys or key in self.seen or self.current is None:
            return t
        self.seen.add(key)
        self.alive.append(t)
        producer = self.producer.get(key, self.current.name)
        nbytes = t.untyped_storage().nbytes()
        is_dropout = self.current.target is F.dropout or isinstance(self.modules.get(self.current.target), nn.Dropout)
        if is_dropout and key not in self.producer:
            nbytes = t.numel()  # dropout keeps a 1-byte mask (meta decomposes it to the input dtype)
        producer_node = next((n for n in self.module.graph.nodes if n.name == producer), self.current)
        attention_matrix = (producer in self.attention_nodes if producer != self.current.name  # made by this op:
                            else self._is_attention_matrix(self.current, t))               # not classified yet
        saved = self.results.setdefault(self.part_of(self.current), Measured()).saved
        saved.append(SavedTensor(producer, float(nbytes), self._sharding(producer_node), attention_matrix,
                                 float(nbytes)))
        self.savers[key] = _Savers(saved, len(saved) - 1, t.untyped_storage().nbytes() // t.element_size())
        self.savers[key].add(self.gemms.depth_in_weight_gemm > 0)
        return t

    def _is_attention_matrix(self, node: fx.Node, out) -> bool:
        """s x s shaped and born of two activations multiplied, or of such a matrix: the shape alone would
        take a (b, s, h) hidden state for one when h equals s."""
        square = isinstance(out, torch.Tensor) and out.dim() >= 3 and out.shape[-1] == self.seq_len == out.shape[-2]
        if not square:
            return False
        args = [self.env.get(n) for n in node.all_input_nodes]
        scores = node.op == "call_function" and node.target in GEMM_FUNCTIONS and not _has_state(args, self.state_keys)
        return scores or any(n.name in self.attention_nodes for n in node.all_input_nodes)

    def call_function(self, target, args, kwargs):
        if target is F.scaled_dot_product_attention:
            return _FlashAttention.apply(args[0], args[1], args[2])
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        try:
            return super().call_module(target, args, kwargs)
        except Exception as exc:  # a leaf that cannot run on meta (data-dependent): shape-preserving op
            first = args[0] if args else None
            if not isinstance(first, torch.Tensor):
                raise UserInputError(f"leaf module '{target}' cannot run on meta tensors "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
            self.results.setdefault(self.part_of(self.current), Measured()).warnings.append(
                f"leaf '{target}' cannot run on meta tensors; measured as a shape-preserving op")
            return first * 1.0

    def run_node(self, node: fx.Node):
        self.current = node
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        out = super().run_node(node)
        if self._is_attention_matrix(node, out):
            self.attention_nodes.add(node.name)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.producer.setdefault(_storage_key(t), node.name)
                self.alive.append(t)
        measured = self.results.setdefault(self.part_of(node), Measured())
        if isinstance(out, torch.Tensor):
            measured.shapes[node.name] = tuple(out.shape)
        module = self.modules.get(node.target) if node.op == "call_module" else None
        ops = node_costs(node, module, list(args) + list(kwargs.values()), out, self._sharding(node), self.param_ids)
        if node.name in self.attention_nodes:  # scale, mask, softmax, dropout of an unfused attention core
            ops = [replace(op, kind=OpKind.attention_elementwise) if op.kind is OpKind.elementwise else op
                   for op in ops]
        measured.ops.extend(ops)
        if node.op == "output":
            measured.output = out
        return out

    def measure(self, *inputs) -> dict[str, Measured]:
        try:
            with saved_tensors_hooks(self.pack, lambda t: t), self.gemms:
                self.run(*inputs)
        except UserInputError as exc:  # the interpreter decorates messages; keep ours one paragraph
            raise UserInputError(str(exc).split("\n")[0]) from None
        return self.results


def find_block_stack(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The largest ModuleList of modules outside any expert container: the repeated blocks."""
    best_name, best = "", []
    expert_lists = {id(routed_experts(m).module_list) for m in model.modules() if is_expert_container(m)}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and id(module) not in expert_lists and len(module) > len(best):
            best_name, best = name, [(f"{name}.{i}", child) for i, child in enumerate(module)]
    return best_name, best


def measure_block(block: nn.Module, example: torch.Tensor, seq_len: int, label: str,
                  leaf_names: tuple[str, ...] = ()) -> tuple[Measured, BlockStructure, fx.GraphModule]:
    gm = trace(block, leaf_names=leaf_names, label=label)
    modules = dict(gm.named_modules())
    pairs, region = find_tp_pairs(gm.graph, modules)
    pair_linears = {name for pair in pairs for name in pair.columns + (pair.row,)}
    region |= {n.name for n in gm.graph.nodes if n.op == "call_module" and n.target in pair_linears}
    x = example.detach().requires_grad_(True)
    measured = _Analyzer(gm, region, seq_len).measure(x)["all"]
    heads, groups, head_dim = attention_heads(gm.graph, measured.shapes)
    experts = next(((n, m) for n, m in block.named_modules() if is_expert_container(m)), None)
    structure = BlockStructure(
        kind=label, tp_pairs=tuple(pairs), attention_heads=heads, kv_groups=groups, head_dim=head_dim,
        norms=tuple(n for n, m in block.named_modules() if is_norm_like(m) or isinstance(m, nn.LayerNorm)),
        expert_container=experts[0] if experts else None,
        num_experts=routed_experts(experts[1]).count if experts else 0,
        router_topk=router_topk(experts[1]) if experts else 0,
        reference_attention=any(isinstance(m, CoreAttention) for m in block.modules()),
        stacked_experts=bool(experts) and _stacked(experts[1]))
    return measured, structure, gm


def _stacked(container: nn.Module) -> bool:
    """Experts as stacked weights with the reference MoE's route/routed protocol (what runtime/experts.py
    shards), not a ModuleList of expert modules."""
    found = routed_experts(container)
    return found is not None and found.module_list is None and hasattr(container, "routed")


def block_params(block: nn.Module, structure: BlockStructure) -> dict[Sharding, int]:
    """Parameters by how tp/ep divide them: pair Linears by tp, routed experts by ep x etp."""
    pair_linears = {name for pair in structure.tp_pairs for name in pair.columns + (pair.row,)}
    routed = set()
    if structure.expert_container:
        container = block.get_submodule(structure.expert_container)
        routed = set(routed_experts(container).param_ids)
    counts = {Sharding.tensor: 0, Sharding.sequence: 0, Sharding.expert: 0}
    for name, param in block.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        in_shared_tp = structure.expert_container and module_name.startswith(structure.expert_container) \
            and param.dim() == 2 and id(param) not in routed and param.shape[0] != structure.num_experts
        if id(param) in routed:
            counts[Sharding.expert] += param.numel()
        elif module_name in pair_linears or in_shared_tp:
            counts[Sharding.tensor] += param.numel()
        else:
            counts[Sharding.sequence] += param.numel()
    return counts


__all__ = ["CaptureTracer", "trace", "Measured", "find_block_stack", "measure_block", "block_params"]
