"""Capture: run a block's graph on the meta device and measure what each node costs.

Repeated blocks are found from the module tree (a ModuleList of alike modules) and each distinct kind
is traced and measured once, so capture time does not grow with depth or width. Saved-for-backward
bytes are measured for real: the graph runs forward on meta tensors under saved_tensors_hooks and every
saved storage is attributed to the node that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import contextlib

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from cost_models.records import OpCost, OpKind, ParamGroup, SavedTensor, Sharding
from hardware_profiles.errors import UserInputError

from .expert_leaf import ExpertLeafAttribution
from .expert_structure import router_groups, router_topk, stacked_experts
from .graph_analysis import (MATMUL_FUNCS, attention_heads, block_window, feeds_softmax, find_tp_pairs, function_name,
                             graph_topk, head_norms, is_activation_node, is_multiply)
from .module_kinds import is_expert_container, is_linear_like, is_norm_like, routed_experts
from .graph import BlockStructure
from .recompute_regions import found_modules, recompute_regions, tag_modules
from .block_graphs import BlockGraph, block_graph
from .values import on_one_device, with_value_width
from .reference_model import CoreAttention
from .kernels import (FlashAttention, FusedActivation, FusedNorm, attention_core, balanced_experts, bhsd,
                      is_activation, norm_statistics)
from .launches import LaunchCounter
from .op_costs import attention_cost, node_costs, storage_key


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
    return any(isinstance(a, torch.Tensor) and storage_key(a) in state_keys for a in args)


def _is_opaque_leaf(module: nn.Module) -> bool:
    """A leaf whose cost no rule reads from the module itself (a user's leaf_modules entry)."""
    return not (is_linear_like(module) or is_norm_like(module) or isinstance(module, nn.Embedding | nn.LayerNorm)
                or is_expert_container(module) or not list(module.parameters()) and not list(module.children()))


def _opaque_op(name: str, forward_flops: float, ops: list[OpCost]) -> OpCost:
    """A leaf's counted FLOPs as GEMM work, with backward twice the forward (input and weight gradients)."""
    moved = sum(op.bytes_accessed for op in ops)
    return OpCost(name, OpKind.gemm, Sharding.sequence, forward_flops, forward_flops, forward_flops, moved, None)


@dataclass
class _Savers:
    """Who keeps one saved storage: FP8 training casts a weight GEMM's input to a 1-byte copy and keeps
    that (Transformer Engine Linear: saved_inputmat = the FP8 inputmat); other savers keep the original."""
    saved: list
    index: int
    elements: int
    gemm: bool = False
    other: bool = False

    def add(self, is_weight_gemm: bool, saver: str) -> None:
        self.gemm |= is_weight_gemm
        self.other |= not is_weight_gemm
        record = self.saved[self.index]
        fp8_bytes = (record.bytes if self.other else 0.0) + (self.elements if self.gemm else 0.0)
        savers = record.savers if saver in record.savers else record.savers + (saver,)
        self.saved[self.index] = replace(record, fp8_bytes=float(fp8_bytes), savers=savers)


@dataclass
class Measured:
    ops: list[OpCost] = field(default_factory=list)
    saved: list[SavedTensor] = field(default_factory=list)
    shapes: dict[str, tuple] = field(default_factory=dict)
    output: object = None
    warnings: list[str] = field(default_factory=list)


class _Analyzer(ExpertLeafAttribution, fx.Interpreter):
    """Runs a graph on meta tensors; records node costs and attributes saved tensors to producers."""

    def __init__(self, gm: fx.GraphModule, tensor_region: set[str], seq_len: int, part_of=None,
                 shared_inputs: tuple[torch.Tensor, ...] = (), fused_kernels: bool = False,
                 fused_gated_activation: bool = False, window: int = 0):
        super().__init__(gm)
        self.window = window   # keys each query sees where the block's attention slides (graph_analysis.block_window)
        self.fused_kernels = fused_kernels
        self.fused_gated_activation = fused_gated_activation
        self.node_named = {n.name: n for n in gm.graph.nodes}
        self.opaque_flops: dict[str, float] = {}   # leaf modules measured as one op: their counted FLOPs
        self.modules = dict(gm.named_modules())
        self.tensor_region = tensor_region
        self.seq_len = seq_len
        self.part_of = part_of or (lambda node: "all")
        # parameters, buffers and the inputs every block is given alike (RoPE tables, masks) are made once,
        # outside the block: what the block saves of them is not the block's activation memory
        self.state_keys = {storage_key(t) for t in list(gm.parameters()) + list(gm.buffers()) + list(shared_inputs)}
        self.param_storages = {storage_key(p) for p in gm.parameters()}
        self.producer: dict[int, str] = {}
        self.seen: set[int] = set()
        self.alive: list[torch.Tensor] = []  # storages are keyed by address: keep them from being reused
        self.current: fx.Node | None = None
        self.gemms = _GemmTracker(self.state_keys)
        self.beside_routed: list[tuple[bool, set[int]]] = []   # ExpertLeafAttribution's
        self.attention_nodes: set[str] = set()   # q k^T and the scale/mask/softmax/dropout applied to it
        self.savers: dict[int, _Savers] = {}
        self.results: dict[str, Measured] = {}
        self.launches, self.stand_in = LaunchCounter(), False   # the running node's kernels (run_node)

    def _sharding(self, node: fx.Node) -> Sharding:
        return Sharding.tensor if node.name in self.tensor_region else Sharding.sequence

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        if key in self.savers and self.current is not None:
            self.savers[key].add(self.gemms.depth_in_weight_gemm > 0, self.current.name)
        if key in self.state_keys or key in self.seen or self.current is None:
            return t
        if self.fused_gated_activation and (self._recomputed_by_gated_kernel(key) or self._gated_in_experts(t)):
            return t
        self.seen.add(key)
        self.alive.append(t)
        producer = self.producer.get(key, self.current.name)
        nbytes = t.untyped_storage().nbytes()
        is_dropout = self.current.target is F.dropout or isinstance(self.modules.get(self.current.target), nn.Dropout)
        if is_dropout and key not in self.producer:
            nbytes = t.numel()  # dropout keeps a 1-byte mask (meta decomposes it to the input dtype)
        producer_node = self.node_named.get(producer, self.current)
        attention_matrix = (producer in self.attention_nodes if producer != self.current.name  # made by this op:
                            else self._is_attention_matrix(self.current, t))               # not classified yet
        saved = self.results.setdefault(self.part_of(self.current), Measured()).saved
        inner = self._inner_module(t)
        saved.append(SavedTensor(producer, float(nbytes), self._sharding(producer_node), attention_matrix,
                                 float(nbytes), inner_module=inner, routed_output_for_probs=self._routed_output(t)))
        self.savers[key] = _Savers(saved, len(saved) - 1, t.untyped_storage().nbytes() // t.element_size())
        self.savers[key].add(self.gemms.depth_in_weight_gemm > 0, self.current.name)
        return t

    def _recomputed_by_gated_kernel(self, key: int) -> bool:
        """The activation's output that a gating multiply keeps (act(gate) * up) where the stack runs the two
        as one kernel: it keeps gate and up (which the activation and the multiply also keep here) and
        recomputes act(gate) in backward (inside an expert container run as one leaf: `_gated_in_experts`)."""
        made_by = self.node_named.get(self.producer.get(key, ""))
        return (made_by is not None and is_multiply(self.current) and set(made_by.users) == {self.current}
                and is_activation_node(made_by, self.modules))

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
        args, kwargs = on_one_device(args, kwargs)
        if target is F.scaled_dot_product_attention:
            self.stand_in = True
            return FlashAttention.apply(args[0], args[1], args[2])
        return with_value_width(target, args, super().call_function(target, args, kwargs))

    def call_method(self, target, args, kwargs):
        args, kwargs = on_one_device(args, kwargs)
        return super().call_method(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        module = self.modules.get(target)
        args, kwargs = on_one_device(args, kwargs, module)
        if self.fused_kernels and module is not None and is_norm_like(module) and _one_float_tensor(args, kwargs):
            self.stand_in = True
            return FusedNorm.apply(args[0], norm_statistics(module))
        if self.current is not None and self.current.meta.get("attention_core"):
            self.stand_in = True
            return attention_core(self.current.meta["attention_core"], args)
        if self.fused_kernels and module is not None and is_activation(module, args) and not kwargs:
            self.stand_in = True
            return FusedActivation.apply(args[0])
        opaque = module is not None and _is_opaque_leaf(module)
        counter = FlopCounterMode(display=False) if opaque else contextlib.nullcontext()
        notes = self.results.setdefault(self.part_of(self.current), Measured()).warnings
        container = module is not None and is_expert_container(module)
        beside_routed = self._beside_routed(module) if container else contextlib.nullcontext()
        found = routed_experts(module) if container else None
        in_experts = self.launches.inside(found.module_list if found is not None else None)
        try:
            with counter, beside_routed, in_experts:
                out = super().call_module(target, args, kwargs)
        except Exception as exc:  # a leaf that cannot run on meta (data-dependent): shape-preserving op
            first = args[0] if args else None
            found = routed_experts(module) if module is not None else None
            if found is not None and found.module_list is not None and isinstance(first, torch.Tensor):
                with self._beside_routed(module), self.launches.inside(found.module_list):
                    return balanced_experts(module, found, first)
            if not isinstance(first, torch.Tensor):
                raise UserInputError(f"leaf module '{target}' cannot run on meta tensors "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
            notes.append(f"module '{target}' cannot run on meta tensors and is billed as a shape-preserving op: "
                         "its FLOPs, bytes and saved tensors are not counted")
            return first * 1.0
        if opaque:
            self.opaque_flops[self.current.name] = float(counter.get_total_flops())
            notes.append(f"module '{target}' is measured as one op (a leaf): its {counter.get_total_flops():.3g} "
                         "forward FLOPs are counted by torch's FlopCounterMode and billed as GEMM work, but its "
                         "inside is not seen (no tensor-parallel pairs, attention or experts: replicated under tp)")
        return out

    def run_node(self, node: fx.Node):
        self.current = node
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        self.launches, self.stand_in = LaunchCounter(), False
        with torch.set_grad_enabled(node.meta.get("grad_enabled", True)), self.launches:  # as recorded
            out = super().run_node(node)
        if self._is_attention_matrix(node, out):
            self.attention_nodes.add(node.name)
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.producer.setdefault(storage_key(t), node.name)
                self.alive.append(t)
        measured = self.results.setdefault(self.part_of(node), Measured())
        if isinstance(out, torch.Tensor):
            measured.shapes[node.name] = tuple(out.shape)
        module = self.modules.get(node.target) if node.op == "call_module" else None
        ops = node_costs(node, module, list(args) + list(kwargs.values()), out, self._sharding(node),
                         self.param_storages, self.window)
        if self.opaque_flops.get(node.name):
            ops = [_opaque_op(node.name, self.opaque_flops[node.name], ops)]
        if node.meta.get("attention_core"):
            q, k, v, o = bhsd(node.meta["attention_core"], (*args[:3], out))
            ops = [attention_cost(node.name, q, k, v, o, self.window)]
        # scale, mask, softmax, dropout of an unfused attention core; the scale and mask inside the softmax's
        # one pass where the stack fuses kernels (they move no bytes of their own and launch nothing)
        fused_away = node.name in self.attention_nodes and self.fused_kernels and feeds_softmax(node, self.modules)
        if node.name in self.attention_nodes:
            ops = [replace(op, kind=OpKind.attention_elementwise, **({"bytes_accessed": 0} if fused_away else {}))
                   if op.kind is OpKind.elementwise else op for op in ops]
        launched = self.launches.counted
        if ops:   # the node's launches beside its GEMMs ride on its first op (a fused stand-in is one kernel)
            ops[0] = replace(ops[0], launches=0 if fused_away else max(launched.other, int(self.stand_in)),
                             expert_launches=launched.in_experts)
        first_input = node.all_input_nodes[0].name if node.all_input_nodes else ""
        ops = [replace(op, reads=first_input) if op.kind is OpKind.gemm else op for op in ops]
        measured.ops.extend(replace(op, node=node.name) for op in ops)
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


def _one_float_tensor(args, kwargs) -> bool:
    """A module called on one floating tensor alone: what the fused-norm stand-in replaces. A norm of several
    tensors (Zaya's qk_norm of q and k, returning both) runs its own code."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return len(tensors) == 1 and bool(args) and tensors[0] is args[0] and args[0].is_floating_point()


def measure_block(block: nn.Module, args: tuple, kwargs: dict, seq_len: int, label: str,
                  leaf_names: tuple[str, ...] = (), fused_kernels: bool = False,
                  fused_gated_activation: bool = False, window: int = 0) -> tuple[Measured, BlockStructure, BlockGraph]:
    found = block_graph(block, args, kwargs, label, leaf_names)
    gm = found.graph_module
    modules = dict(gm.named_modules())
    pairs, region = find_tp_pairs(gm.graph, modules)
    pair_linears = {name for pair in pairs for name in pair.columns + (pair.row,)}
    region |= {n.name for n in gm.graph.nodes if n.op == "call_module" and n.target in pair_linears}
    analyzer = _Analyzer(gm, region, seq_len, shared_inputs=found.inputs[1:], fused_kernels=fused_kernels,
                         fused_gated_activation=fused_gated_activation, window=window)
    measured = analyzer.measure(*found.inputs)["all"]
    measured.warnings.extend(n for n in found.notes if n not in measured.warnings)
    pairs, _ = find_tp_pairs(gm.graph, modules, measured.shapes)   # fused columns need the shapes
    heads, groups, head_dim = attention_heads(gm.graph, measured.shapes)
    experts = next(((n, m) for n, m in block.named_modules() if is_expert_container(m)), None)
    num_experts = routed_experts(experts[1]).count if experts else 0
    topk = (graph_topk(gm.graph, measured.shapes, num_experts) or router_topk(experts[1])) if experts else 0
    if experts and not topk:
        raise UserInputError(f"{label}: routed experts in '{experts[0]}' but no top-k over {num_experts} experts "
                             "in its graph and no top_k / num_experts_per_tok attribute",
                             expected="a router that picks experts with torch.topk, or a top_k attribute")
    regions, inner = recompute_regions(gm.graph, modules, tuple(pairs), measured.ops,
                                       *(experts or (None, None)))
    measured.ops, measured.saved = tag_modules(measured.ops, measured.saved, regions, inner)
    structure = BlockStructure(
        kind=label, tp_pairs=tuple(pairs), attention_heads=heads,
        kv_groups=groups, head_dim=head_dim,
        norms=tuple(n for n, m in block.named_modules() if is_norm_like(m) or isinstance(m, nn.LayerNorm)),
        expert_container=experts[0] if experts else None, num_experts=num_experts, router_topk=topk,
        reference_attention=any(isinstance(m, CoreAttention) for m in block.modules()),
        stacked_experts=bool(experts) and stacked_experts(experts[1]),
        sdpa_attention=any(function_name(n) == "scaled_dot_product_attention" for n in gm.graph.nodes),
        sliding_window=block_window(block) > 0,
        reference_experts=bool(experts) and stacked_experts(experts[1]) and hasattr(experts[1], "routed"),
        **(dict(zip(("router_num_groups", "router_group_topk"), router_groups(experts[1]))) if experts else {}),
        head_norms=head_norms(gm.graph, modules, measured.shapes),
        recompute_modules=found_modules(regions, measured.ops))
    return measured, structure, found



def block_params(block: nn.Module, structure: BlockStructure) -> tuple[ParamGroup, ...]:
    """Parameters (and the tensors holding them) by how tp/ep divide them: pair Linears by tp, routed experts by
    ep x etp."""
    pair_linears = {name for pair in structure.tp_pairs for name in pair.columns + (pair.row,)}
    routed = set()
    if structure.expert_container:
        container = block.get_submodule(structure.expert_container)
        routed = set(routed_experts(container).param_ids)
    counts = {Sharding.tensor: 0, Sharding.sequence: 0, Sharding.expert: 0}
    tensors = dict.fromkeys(counts, 0)
    for name, param in block.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        in_shared_tp = structure.expert_container and module_name.startswith(structure.expert_container) \
            and param.dim() == 2 and id(param) not in routed and param.shape[0] != structure.num_experts
        if id(param) in routed:
            sharding = Sharding.expert
        elif module_name in pair_linears or in_shared_tp:
            sharding = Sharding.tensor
        else:
            sharding = Sharding.sequence
        counts[sharding] += param.numel()
        tensors[sharding] += 1
    return tuple(ParamGroup(count, sharding, tensors[sharding]) for sharding, count in counts.items() if count)


def weight_pass_groups(block: nn.Module) -> int:
    """Groups torch's split weight pass computes one by one (torch.distributed.pipelining's
    stage_backward_weight: one autograd.grad per set of parameters meeting the activations at one op): a Linear's
    weight and bias meet at its GEMM, a norm's at its scale; any other module's parameters each at an op of its own
    (stacked expert weights, a router's)."""
    groups = 0
    for module in block.modules():
        direct = list(module.parameters(recurse=False))
        if direct:
            groups += 1 if is_linear_like(module) or is_norm_like(module) or isinstance(module, nn.LayerNorm) \
                else len(direct)
    return groups


__all__ = ["Measured", "measure_block", "block_params", "weight_pass_groups"]
