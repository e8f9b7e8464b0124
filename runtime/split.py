"""Split a model into pipeline stage modules from its traced top-level graph.

The top level is traced with the repeated blocks as leaves, so the graph is: the embedding part, one
call per block in order, the head part. A stage keeps the nodes of its blocks (plus the embedding for
the first and the head for the last). The stage is an fx.GraphModule over the same submodules, so
parameter names stay those of the full model ("layers.7.mlp.up_proj.weight") whatever the layout.
"""
from __future__ import annotations

from torch import fx, nn

from planner.capture.tracing import trace


def _block_calls(graph: fx.Graph, block_names: set[str]) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_module" and n.target in block_names]


def split_stage(model: nn.Module, block_names: list[str], first: int, last: int, is_first: bool,
                is_last: bool) -> fx.GraphModule:
    """Module running blocks[first..last] (inclusive), with embedding and/or head when it holds them."""
    blocks = {name: model.get_submodule(name) for name in block_names}
    top = trace(model, leaf_ids={id(m) for m in blocks.values()}, label=type(model).__name__)
    calls = _block_calls(top.graph, set(block_names))
    if [c.target for c in calls] != block_names:
        raise ValueError("blocks are not called once each, in order: the model cannot be split into stages")
    for previous, call in zip(calls, calls[1:]):
        if call.args != (previous,) or call.kwargs:
            raise ValueError(f"block {call.target} does not take exactly the previous block's output")
    nodes = list(top.graph.nodes)
    start = 0 if is_first else nodes.index(calls[first])
    stop = len(nodes) if is_last else nodes.index(calls[last]) + 1
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if not is_first:
        env[calls[first].args[0]] = graph.placeholder("hidden")
    result = None
    for node in nodes[start:stop]:
        if node.op == "output":
            result = env[node.args[0]]
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        result = env[node]
    graph.output(result)
    return fx.GraphModule(top, graph, class_name=f"Stage{first}to{last}")
