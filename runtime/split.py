"""Split a model into pipeline stage modules from its traced top-level graph.

The top level is traced with the repeated blocks as leaves, so the graph is: the embedding part, one
call per block in order, the head part. A stage keeps the nodes of its blocks (plus the embedding for
the first and the head for the last). The stage is an fx.GraphModule over the same submodules, so
parameter names stay those of the full model ("layers.7.mlp.up_proj.weight") whatever the layout.
"""
from __future__ import annotations

from torch import fx, nn

from hardware_profiles.errors import UserInputError
from planner.graph_capture.block_graphs import trace


def _block_calls(graph: fx.Graph, block_names: set[str]) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_module" and n.target in block_names]


def split_stage(model: nn.Module, block_names: list[str], blocks: range, is_first: bool,
                is_last: bool) -> fx.GraphModule:
    """Module running the blocks in `blocks`, with the embedding and/or the head when it holds them; the
    first chunk may hold only the embedding and the last only the head (an empty `blocks`)."""
    modules = {name: model.get_submodule(name) for name in block_names}
    try:
        top = trace(model, leaf_ids={id(m) for m in modules.values()}, label=type(model).__name__)
    except UserInputError as exc:
        raise ValueError(f"pipeline stages are cut from a torch.fx trace of the model, and torch.fx cannot trace "
                         f"{type(model).__name__} ({str(exc).split('. Expected')[0]}): run it with pp=1") from None
    calls = _block_calls(top.graph, set(block_names))
    if [c.target for c in calls] != block_names:
        raise ValueError("blocks are not called once each, in order: the model cannot be split into stages")
    for previous, call in zip(calls, calls[1:]):
        if call.args != (previous,) or call.kwargs:
            raise ValueError(f"block {call.target} does not take exactly the previous block's output")
    nodes = list(top.graph.nodes)
    # the hidden state entering and leaving the chunk: the previous block's output, or the embedding's
    entering = calls[blocks.start].args[0] if blocks.start < len(calls) else calls[-1]
    leaving = calls[blocks.stop - 1] if len(blocks) else entering
    if is_first:
        start = 0
    else:   # from the chunk's first block, or, holding only the head, from after the last block
        start = nodes.index(calls[blocks.start]) if len(blocks) else nodes.index(calls[-1]) + 1
    stop = len(nodes) if is_last else nodes.index(leaving) + 1
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if not is_first:
        env[entering] = graph.placeholder("hidden")
    result = None
    for node in nodes[start:stop]:
        if node.op == "output":
            result = env[node.args[0]]
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(result if is_last else env[leaving])
    return fx.GraphModule(top, graph, class_name=f"Stage{blocks.start}to{blocks.stop - 1}")
