"""The modules selective recomputation can repeat, found in a block's graph (Megatron-Core's names).

Each node of a block belongs to at most one recomputable module (`cost_models.layout.RecomputeModule`):

- core_attn: the attention core, as capture billed it (fused kernel, or q k^T, softmax and probs x v).
- mlp: a dense block's MLP, its column -> row pair (Megatron-Core's "mlp" skips MoE layers).
- moe: a MoE block's expert container (the router, experts and shared experts it holds).
- mla_up_proj: where the attention pair's columns take a low-rank latent made by another linear (MLA), the
  up-projections and everything after them on the way into the attention core, RoPE of the shared key part
  included (Megatron-Core's `qkv_up_proj_and_rope_apply`).
- layernorm: the norms on the residual stream: norm modules whose input no linear made.
- moe_act: the routed experts' activation between their GEMMs; shared_experts: the container's shared experts.
  Inside an expert container captured as one node, its ops and the tensors each makes and keeps name them as
  their `inner_module` (capture.tracing, capture.op_costs).

The cost models then drop, for each recomputed module, what it makes and keeps itself (or everything it
makes, for an output-discarding one): `SavedTensor.dropped_by`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from torch import fx, nn

from cost_models.layout import RecomputeModule
from cost_models.records import ATTENTION_CORE, OpCost, OpKind, SavedTensor, Sharding

from .graph import TensorParallelPair
from .graph_analysis import is_linear_node, is_view_node, node_module
from .module_kinds import is_norm_like, shared_children

GRAPH_EDGES = ("placeholder", "get_attr", "output")


def recompute_regions(graph: fx.Graph, modules: dict[str, nn.Module], pairs: tuple[TensorParallelPair, ...],
                      ops: list[OpCost], expert_container: str | None, container: nn.Module | None = None
                      ) -> tuple[dict[str, RecomputeModule], dict[str, RecomputeModule]]:
    """Node name -> the recomputable module it belongs to (nodes in none are left out), and node name -> the
    module inside that one (moe_act, shared_experts inside a moe region); `ops` as measured, their kinds
    naming the attention core's nodes."""
    core = {op.node for op in ops if op.kind in ATTENTION_CORE}
    nodes = [n for n in graph.nodes if n.op not in GRAPH_EDGES]
    linears: dict[str, list[fx.Node]] = {}
    for node in nodes:
        if is_linear_node(node, modules):
            linears.setdefault(node.target if node.op == "call_module" else node.name, []).append(node)
    regions = {name: RecomputeModule.core_attn for name in core}
    for pair in pairs:
        columns = [n for name in pair.columns for n in linears.get(name, [])]
        span = _descendants(columns) & _ancestors(linears.get(pair.row, []))
        if span & core:
            if any(_takes_latent(column, modules) for column in columns):
                _claim(regions, _up_projection(nodes, columns, core), RecomputeModule.mla_up_proj)
        elif expert_container is None:
            _claim(regions, span, RecomputeModule.mlp)
    inner: dict[str, RecomputeModule] = {}
    if expert_container is not None:
        _claim(regions, (n.name for n in nodes if n.op == "call_module" and n.target == expert_container),
               RecomputeModule.moe)
        _claim(regions, _recorded_inside(nodes, expert_container), RecomputeModule.moe)
    # experts the graph runs node by node (grouped GEMMs, a loop over expert linears): inside a moe region
    # where the recording says which nodes the container ran; inside a container captured as one node, the
    # container's ops and tensors name them (`inner_module`)
    spans = [(_expert_activation(nodes, ops), RecomputeModule.moe_act)]
    if expert_container is not None and container is not None:
        spans.append((_shared_experts(nodes, container, expert_container), RecomputeModule.shared_experts))
    for names, module in spans:
        _claim(inner, (n for n in names if regions.get(n) is RecomputeModule.moe), module)
        _claim(regions, (n for n in names if regions.get(n) is not RecomputeModule.moe), module)
    _claim(regions, (n.name for n in nodes if _is_residual_norm(n, modules)), RecomputeModule.layernorm)
    return regions, inner


def _recorded_inside(nodes: list[fx.Node], container: str) -> set[str]:
    """The nodes a recording made while the container ran (their module path, or a tuple item taken from
    one): the whole MoE layer, where a graph runs it node by node."""
    inside: set[str] = set()
    for node in nodes:
        path = node.meta.get("module_path")
        if path == container or (isinstance(path, str) and path.startswith(container + ".")) or (
                path is None and node.all_input_nodes and all(n.name in inside for n in node.all_input_nodes)):
            inside.add(node.name)
    return inside


def _expert_activation(nodes: list[fx.Node], ops: list[OpCost]) -> set[str]:
    """Between the routed experts' up- and down-projection GEMMs (the down one writes the hidden size, the
    up ones read it): the activation and gating multiply, as Megatron-Core's moe_act recomputes them."""
    gemms = {op.node: op.gemm_mnk for op in ops if op.sharding is Sharding.expert and op.kind is OpKind.gemm
             and op.gemm_mnk is not None}
    widths_in, widths_out = ({mnk[i] for mnk in gemms.values()} for i in (2, 1))
    hidden = widths_in & widths_out
    if len(hidden) != 1:
        return set()
    up = [n for n in nodes if n.name in gemms and gemms[n.name][2] in hidden]
    down = [n for n in nodes if n.name in gemms and gemms[n.name][1] in hidden]
    return (_descendants(up) & _ancestors(down)) - set(gemms)


def _shared_experts(nodes: list[fx.Node], module: nn.Module, container: str) -> set[str]:
    """Where the graph runs the expert container node by node: the modules of its shared experts (its children
    holding no routed expert weights and no router) and what runs between the first and the last of them."""
    shared = [name for name, _, is_shared in shared_children(module) if is_shared]
    inside = [n for n in nodes if n.op == "call_module" and any(
        n.target == f"{container}.{name}" or n.target.startswith(f"{container}.{name}.") for name in shared)]
    return {n.name for n in inside} | (_descendants(inside) & _ancestors(inside))


def found_modules(regions: dict[str, RecomputeModule], ops: list[OpCost]) -> tuple[RecomputeModule, ...]:
    """The modules some node belongs to, and those inside an expert container's ops (moe_act)."""
    found = set(regions.values()) | {op.inner_module for op in ops if op.inner_module is not None}
    found.discard(None)
    return tuple(m for m in RecomputeModule if m in found)


def tag_modules(ops: list[OpCost], saved: list[SavedTensor], regions: dict[str, RecomputeModule],
                inner: dict[str, RecomputeModule]) -> tuple[list[OpCost], list[SavedTensor]]:
    """Each op and saved tensor with the recomputable module of the nodes that ran, made and keep it, and
    the module inside it that made it (for a checkpointed one, only where it alone keeps it)."""
    return ([replace(op, module=regions.get(op.node), inner_module=op.inner_module or inner.get(op.node))
             for op in ops],
            [replace(t, producer_module=regions.get(t.producer),
                     saver_modules=frozenset(regions.get(name) for name in t.savers),
                     inner_module=t.inner_module or _kept_inside(t, inner)) for t in saved])


def _kept_inside(saved: SavedTensor, inner: dict[str, RecomputeModule]) -> RecomputeModule | None:
    made_by = inner.get(saved.producer)
    if made_by is None or made_by.discards_output or all(inner.get(s) is made_by for s in saved.savers):
        return made_by
    return None


def _claim(regions: dict[str, RecomputeModule], names: Iterable[str], module: RecomputeModule) -> None:
    for name in names:
        regions.setdefault(name, module)


def _descendants(starts: list[fx.Node]) -> set[str]:
    """The names of `starts` and every node fed by them."""
    return _walk(starts, lambda n: n.users)


def _ancestors(starts: list[fx.Node]) -> set[str]:
    """The names of `starts` and every node that feeds them."""
    return _walk(starts, lambda n: n.all_input_nodes)


def _walk(starts: list[fx.Node], step) -> set[str]:
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node.name not in seen:
            seen.add(node.name)
            stack.extend(step(node))
    return seen


def _up_projection(nodes: list[fx.Node], columns: list[fx.Node], core: set[str]) -> set[str]:
    """What feeds the attention core and is not on the way into the up-projections: the up-projections
    themselves, the splits, RoPE and concatenations after them, and RoPE of the key part that skips them."""
    into_core = _ancestors([n for n in nodes if n.name in core]) - core
    into_columns = _ancestors(columns) - {n.name for n in columns}
    return {n.name for n in nodes if n.name in into_core and n.name not in into_columns}


def _source(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """Step back from a node's first input over views and norms to what made it (None at the graph input)."""
    current = node.all_input_nodes[0] if node.all_input_nodes else None
    while current is not None and (is_view_node(current) or is_norm_like(node_module(current, modules) or nn.Module())):
        current = current.all_input_nodes[0] if current.all_input_nodes else None
    return current


def _takes_latent(column: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A column linear whose input another linear made (through norms and views): a low-rank latent."""
    source = _source(column, modules)
    return source is not None and is_linear_node(source, modules)


def _is_residual_norm(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    module = node_module(node, modules)
    if module is None or not (is_norm_like(module) or isinstance(module, nn.LayerNorm)):
        return False
    source = _source(node, modules)
    return source is None or not is_linear_node(source, modules)
