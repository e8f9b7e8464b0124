"""Finding a model's repeated blocks and turning one block into a graph: torch.fx's symbolic trace where it
can read the code (norms, expert containers and chosen modules as leaves), else a recording of its forward
run on meta (recording.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from hardware_profiles.errors import UserInputError

from .module_kinds import is_expert_container, is_norm_like, routed_experts
from .recording import record


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
        if _named(qualname, self.leaf_names):
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


def find_block_stack(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The largest ModuleList (or ModuleDict: torchtitan keys its layers "0", "1"...) outside any
    expert container: the repeated blocks."""
    best_name, best = "", []
    expert_lists = {id(routed_experts(m).module_list) for m in model.modules() if is_expert_container(m)}
    for name, module in model.named_modules():
        if id(module) in expert_lists or not isinstance(module, nn.ModuleList | nn.ModuleDict):
            continue
        children = list(module.named_children())
        if len(children) > len(best):
            best_name, best = name, [(f"{name}.{key}" if name else key, child) for key, child in children]
    return best_name, best


@dataclass(frozen=True)
class BlockGraph:
    """One block kind as an fx graph, with the meta tensors that feed its placeholders."""
    graph_module: fx.GraphModule
    inputs: tuple[torch.Tensor, ...]     # the hidden state first (it carries the gradient)
    front_end: str                       # "torch.fx" (symbolic) or "recorded" (run eagerly on meta, recording.py)
    notes: tuple[str, ...] = ()          # what the recording ran otherwise than the code asks


def block_graph(block: nn.Module, args: tuple, kwargs: dict, label: str,
                leaf_names: tuple[str, ...] = ()) -> BlockGraph:
    """A block called with one tensor is traced symbolically when torch.fx can; otherwise (keyword
    inputs such as RoPE tables and masks, or code fx cannot read) its forward is recorded."""
    hidden = args[0].detach().requires_grad_(True)
    others = [a.detach() if isinstance(a, torch.Tensor) else a for a in args[1:]]
    kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if not others and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        try:
            return BlockGraph(trace(block, leaf_names=leaf_names, label=label), (hidden,), "torch.fx")
        except UserInputError:
            pass  # recorded below; a failure there is reported from the recording
    leaf_ids = {id(m) for n, m in block.named_modules() if n and _named(n, leaf_names)}
    recording = record(block, (hidden, *others), kwargs, leaf_ids=leaf_ids, label=label,
                       seq_len=hidden.shape[1] if hidden.dim() >= 2 else None)
    return BlockGraph(recording.graph_module, recording.inputs, "recorded", recording.notes)


def _named(qualname: str, leaf_names: tuple[str, ...]) -> bool:
    return any(qualname == n or qualname.endswith("." + n) for n in leaf_names)
