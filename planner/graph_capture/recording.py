"""Capture by recording: run a module once, eagerly on meta tensors, and write every torch call it makes
into an fx.Graph.

torch.fx's symbolic tracer cannot read most real model code (Hugging Face 5.x decoders fail on their
`**kwargs` signatures, mask builders and routing loops branch on tensor values). Running the code
for real resolves all of its Python: branches, loops, config lookups. Parameters stay on meta (no
memory, no arithmetic); the few small tensors no parameter feeds (positions, packing ids) get real
values, so code that branches on them takes the branch it takes on a device (`run_call`), and nothing
pretends to be a tracer, so libraries take their eager paths (transformers then skips the causal
mask and calls SDPA with is_causal, as on a GPU). What is written down is
the sequence of torch functions (`F.linear`, `torch.Tensor.view`, `F.scaled_dot_product_attention`,
`torch._grouped_mm`...), with parameters as `get_attr` nodes and chosen modules (Linear, Embedding,
norms, repeated blocks) as `call_module` leaves. The graph is then measured by the same interpreter
as a symbolically traced one, on plain meta tensors, so both front ends bill work identically.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.fx.graph_module import _assign_attr
from torch.utils._pytree import tree_flatten, tree_map

from hardware_profiles.errors import UserInputError

from .module_kinds import is_expert_container, is_linear_like, is_norm_like, may_be_activation, signature
from .values import REAL_VALUE_MAX_ELEMENTS, TableOverrun, attention_layout, cpu_to_meta, query_key_value, run_call


def is_recorded_leaf(module: nn.Module) -> bool:
    """Modules written down as one call: their cost rules read the module, not its insides."""
    return isinstance(module, nn.Embedding) or is_linear_like(module) or is_norm_like(module)


@dataclass
class Recording:
    graph_module: "RecordedModule"
    inputs: tuple[torch.Tensor, ...]      # the meta tensors that feed the graph's placeholders, in order
    output: object                        # the recorded output (meta tensors: shapes and dtypes only)
    notes: tuple[str, ...] = ()           # capture notes: what ran otherwise than the code asks


@dataclass
class _Names:
    """Qualified names of the root's parameters, buffers and modules, by object identity."""
    tensors: dict[int, str] = field(default_factory=dict)
    modules: dict[int, str] = field(default_factory=dict)

    @staticmethod
    def of(root: nn.Module) -> "_Names":
        names = _Names()
        for name, tensor in list(root.named_parameters(remove_duplicate=False)) + \
                list(root.named_buffers(remove_duplicate=False)):
            names.tensors.setdefault(id(tensor), name)
        for name, module in root.named_modules(remove_duplicate=False):
            names.modules.setdefault(id(module), name)
        return names


class _Recorder(TorchFunctionMode):
    """Writes each top-level torch call into `graph`; calls made inside a leaf module are not written."""

    def __init__(self, root: nn.Module, leaf_ids: set[int], seq_len: int | None, repeated: set[int] = frozenset()):
        super().__init__()
        # leaves alike by class, parameter shapes and arguments give alike outputs: a model's repeated blocks are
        # run once per kind (a 126-layer model's top graph records in the time of a few layers, not 126)
        self.repeated = repeated
        self.outputs_of: dict[tuple, object] = {}
        self.seq_len = seq_len   # tells an attention kernel's sequence axis from its heads axis
        self.names = _Names.of(root)
        self.named_leaves = leaf_ids   # the user's leaf_modules (blocks too, at the top level)
        self.graph = fx.Graph()
        self.node_of: dict[int, fx.Node] = {}
        self.keep_alive: list[object] = []     # ids key node_of: the tensors must outlive the recording
        # each binding's (tensor id, the node it had): a folded module's bindings are undone with its nodes,
        # since an op that returns its input (x.float() of a float x, an in-place op) rebinds that tensor
        self.bindings: list[tuple[int, fx.Node | None]] = []
        self.attrs: dict[str, object] = {}     # get_attr targets: parameters, buffers, leaf modules, constants
        self.inside_leaf = 0
        self.module_path: list[str] = []
        self.notes: set[str] = set()   # what the recording could not do as the code asks (Recording.notes)

    # arguments: tensors become the nodes that made them
    def _arg(self, value):
        if not isinstance(value, torch.Tensor):
            return cpu_to_meta(value)  # a device read off a real-valued index tensor: the graph runs on meta
        node = self.node_of.get(id(value))
        if node is not None:
            return node
        name = self.names.tensors.get(id(value))
        if name is None:  # computed for real (small: REAL_VALUE_MAX_ELEMENTS), or made outside any torch call
            name = f"_constant{len(self.attrs)}"
            keep = not value.is_meta and value.numel() <= REAL_VALUE_MAX_ELEMENTS
            self.attrs[name] = value.detach() if keep else torch.empty(value.shape, dtype=value.dtype, device="meta")
        else:
            self.attrs[name] = value
        node = self.graph.get_attr(name)
        self._remember(value, node)
        return node

    def _remember(self, value, node: fx.Node) -> None:
        self.bindings.append((id(value), self.node_of.get(id(value))))
        self.node_of[id(value)] = node
        self.keep_alive.append(value)

    def _undo_bindings(self, mark: int) -> None:
        """Bind each tensor again to the node it had before `mark` (or to none)."""
        for key, previous in reversed(self.bindings[mark:]):
            if previous is None:
                self.node_of.pop(key, None)
            else:
                self.node_of[key] = previous
        del self.bindings[mark:]

    def _bind_outputs(self, out, node: fx.Node) -> None:
        if isinstance(out, torch.Tensor):
            self._remember(out, node)
        elif isinstance(out, (tuple, list)):
            for index, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    self._remember(item, self.graph.call_function(operator.getitem, (node, index)))

    def _annotate(self, node: fx.Node) -> None:
        node.meta["grad_enabled"] = torch.is_grad_enabled()
        node.meta["module_path"] = self.module_path[-1] if self.module_path else ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = run_call(func, args, kwargs)
        if self.inside_leaf:
            return out
        name = getattr(func, "__name__", "")
        mutates = (name.endswith("_") and not name.startswith("__")) or func is torch.Tensor.__setitem__
        if not mutates and not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            return out  # shape queries, dtype and device reads: their values are baked into the graph
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outputs and not any(t.is_meta for t in outputs):
            return out  # computed for real (positions, masks): a constant of the graph where it is used
        node = self.graph.call_function(func, tree_map(self._arg, args), tree_map(self._arg, kwargs))
        self._annotate(node)
        self._bind_outputs(out, node)
        return out

    def stateless_forward(self, module: nn.Module, original):
        """Record the call of a stateless module. An activation (one tensor in, one alike out) is folded
        into one call_module node, so that a stack's fused kernel can stand in for its ops. An attention
        kernel module that cannot run on meta (torchtitan's FlexAttention checks the device) but is
        called with q, k, v shaped [b, heads, s, d] becomes one attention-core node (billed as a fused
        attention kernel, which is what flex, flash and cuDNN attention are)."""
        def forward(*args, **kwargs):
            before = (len(self.graph.nodes), len(self.bindings))
            try:
                out = original(*args, **kwargs)
            except Exception:
                qkv = query_key_value(args)
                layout = attention_layout(qkv, self.seq_len) if qkv else None
                if self.inside_leaf or layout is None:
                    raise
                q, _, v = qkv
                out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device="meta")
                return self._fold(module, before, qkv, out, attention_layout=layout)
            tensors_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            single = len(tensors_in) == 1 and len(args) == 1 and isinstance(out, torch.Tensor)
            if self.inside_leaf or not single or out.shape != args[0].shape or not out.is_floating_point():
                return out
            return self._fold(module, before, (args[0],), out)
        return forward

    def experts_forward(self, module: nn.Module, original):
        """Record a MoE container's call; one whose code reads the routing (a loop over the experts the
        router chose: `nonzero`, `torch.where(mask)`) cannot run on meta, and becomes one call_module
        node that the measurement runs with balanced routing (tracing._balanced_experts)."""
        def forward(*args, **kwargs):
            before = (len(self.graph.nodes), len(self.bindings))
            try:
                return original(*args, **kwargs)
            except Exception:
                first = args[0] if args else None
                if self.inside_leaf or not isinstance(first, torch.Tensor):
                    raise
                self.notes.add(f"'{self.names.modules[id(module)]}' routes tokens by reading the router's choice "
                               "(not possible on meta): its experts are measured with balanced routing, "
                               "tokens x k / E each")
                return self._fold(module, before, (first,), torch.empty_like(first, device="meta"))
        return forward

    def _fold(self, module: nn.Module, before: tuple[int, int], inputs: tuple, out, attention_layout: str = ""):
        """One call_module node for what the module recorded since `before` (its node and binding counts)."""
        nodes, bindings = before
        for node in reversed(list(self.graph.nodes)[nodes:]):
            self.graph.erase_node(node)
        self._undo_bindings(bindings)
        target = self.names.modules[id(module)]
        self.attrs[target] = module
        node = self.graph.call_module(target, tuple(self._arg(t) for t in inputs))
        self._annotate(node)
        node.meta["attention_core"] = attention_layout   # "bhsd" or "bshd"; "" for an activation
        self._remember(out, node)
        return out

    # leaves: patched forwards that run the module unrecorded and write one call_module node
    def leaf_forward(self, module: nn.Module, original):
        def forward(*args, **kwargs):
            if self.inside_leaf:
                return original(*args, **kwargs)
            key = (signature(module), _argument_shapes(args, kwargs)) if id(module) in self.repeated else None
            if key is not None and key in self.outputs_of:
                out = tree_map(fresh_like, self.outputs_of[key])
                return self._leaf_node(module, args, kwargs, out)
            self.inside_leaf += 1
            try:
                out = original(*args, **kwargs)
            except Exception:
                if id(module) not in self.named_leaves:
                    raise
                # a leaf the user named because its code reads tensor values: it stands in as a
                # shape-preserving op here, and measuring it says so (tracing._Analyzer.call_module)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is None:
                    raise
                out = torch.empty_like(first, device="meta")
            finally:
                self.inside_leaf -= 1
            if key is not None:
                self.outputs_of[key] = out
            return self._leaf_node(module, args, kwargs, out)
        return forward

    def _leaf_node(self, module: nn.Module, args, kwargs, out):
        target = self.names.modules[id(module)]
        self.attrs[target] = module
        node = self.graph.call_module(target, tree_map(self._arg, args), tree_map(self._arg, kwargs))
        self._annotate(node)
        self._bind_outputs(out, node)
        return out


def _argument_shapes(args, kwargs) -> tuple:
    """What a leaf's output shapes may depend on: its tensors' shapes and dtypes, and its other arguments' plain
    values (the type alone of anything else: a mask or cache object)."""
    flat, spec = tree_flatten((args, kwargs))
    return (str(spec), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                             else a if isinstance(a, (int, float, str, bool, type(None))) else type(a).__name__
                             for a in flat))


def fresh_like(value):
    """A repeated block's output (recorded or measured, the block not run again): a new meta tensor shaped like
    the first one's, anything else as it was."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty(value.shape, dtype=value.dtype, device="meta", requires_grad=value.dtype.is_floating_point)


def _forward_kwargs(root: nn.Module) -> dict:
    """A model that keeps a generation cache would record its updates: ask it not to (training has none)."""
    try:
        parameters = inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in parameters else {}


def record(root: nn.Module, args: tuple, kwargs: dict | None = None, leaf_ids: set[int] = frozenset(),
           label: str = "model", seq_len: int | None = None, repeated: set[int] = frozenset()) -> Recording:
    """Run `root(*args, **kwargs)` once and return the graph of what it called.

    `args`/`kwargs` hold meta tensors; every tensor among them becomes a placeholder, in order. Without
    kwargs a whole model is called as for training (no generation cache)."""
    kwargs = _forward_kwargs(root) if kwargs is None else dict(kwargs)
    recorder = _Recorder(root, set(leaf_ids), seq_len, set(repeated))
    flat, _ = tree_flatten((args, kwargs))
    inputs = tuple(t for t in flat if isinstance(t, torch.Tensor))
    for index, tensor in enumerate(inputs):
        recorder._remember(tensor, recorder.graph.placeholder(f"input{index}"))
    patched = [m for m in root.modules() if m is not root and (id(m) in leaf_ids or is_recorded_leaf(m))]
    leaves = {id(m) for m in patched}   # a set: a 1,000-layer model has 15,000 modules to look up
    activations = [m for m in root.modules() if m is not root and id(m) not in leaves and may_be_activation(m)]
    experts = [m for m in root.modules() if m is not root and id(m) not in leaves and is_expert_container(m)]
    paths = _module_path_hooks(recorder)
    for module in patched:
        module.forward = recorder.leaf_forward(module, module.forward)
    for module in activations:
        module.forward = recorder.stateless_forward(module, module.forward)
    for module in experts:
        module.forward = recorder.experts_forward(module, module.forward)
    patched += activations + experts
    try:
        with recorder, _autocast_on_meta(recorder), _reference_kernels_heard(recorder):
            out = root(*args, **kwargs)
    except UserInputError:
        raise
    except TableOverrun as exc:
        where = recorder.module_path[-1] if recorder.module_path else type(root).__name__
        raise UserInputError(f"cannot capture {label}: module '{where}': {exc}", field="seq_len",
                             expected="a sequence length the model's position table holds") from None
    except Exception as exc:
        where = recorder.module_path[-1] if recorder.module_path else ""   # "": the root's own code
        leaf = (f", or leaf_modules=['{where}'] (--leaf-modules {where}) to bill that module as one shape-preserving "
                "op, reported in the plan (--strict-capture refuses it)") if where else ""
        raise UserInputError(
            f"cannot capture {label}: running its forward on meta tensors failed in "
            f"{f'module {where!r}' if where else f'its own forward ({type(root).__name__})'} with "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
            expected="a module whose forward runs without reading tensor values (no .item(), nonzero() or "
                     "branches on data; transformers MoE models: experts_implementation='grouped_mm')" + leaf
        ) from None
    finally:
        for module in patched:
            del module.forward
        for handle in paths:
            handle.remove()
    recorder.graph.output(tree_map(recorder._arg, _plain(out)))
    return Recording(RecordedModule(recorder.attrs, recorder.graph), inputs, out, tuple(sorted(recorder.notes)))


class RecordedModule(nn.Module):
    """The recorded graph with the modules and tensors it names installed at their qualified paths: what
    an fx.Interpreter runs. Not an fx.GraphModule, because some recorded targets (Tensor slot wrappers
    such as `__rsub__`) have no importable name for fx to generate Python code from."""

    def __init__(self, attrs: dict[str, object], graph: fx.Graph):
        super().__init__()
        modules_first = sorted(attrs.items(), key=lambda item: (not isinstance(item[1], nn.Module), item[0]))
        for target, value in modules_first:
            _assign_attr(value, self, target)  # plain tensors become buffers: state, never activations
        self.graph = graph


def _plain(out):
    """Model outputs as plain containers (transformers returns dict-like ModelOutput classes)."""
    if isinstance(out, dict):
        return {key: _plain(value) for key, value in out.items()}
    if isinstance(out, (tuple, list)) and type(out) not in (tuple, list):
        return tuple(_plain(v) for v in out)
    return out


@contextlib.contextmanager
def _autocast_on_meta(recorder: _Recorder):
    """torch.autocast refuses the meta device, and model code opens it on its input's device
    (torchtitan's MoE router computes its gate under fp32 autocast). While recording, such a region runs
    without autocast, and the recording says so: its casts (an fp32 gate GEMM) are not applied."""
    real = torch.autocast

    class MetaAwareAutocast(real):
        def __init__(self, device_type, *args, **kwargs):
            if device_type == "meta":
                recorder.notes.add(f"an autocast region in '{recorder.module_path[-1] if recorder.module_path else 'model'}'"
                                   " ran without autocast (torch has none on meta): its dtype casts are not applied")
                device_type, kwargs = "cpu", {**kwargs, "enabled": False}
            super().__init__(device_type, *args, **kwargs)
    torch.autocast = MetaAwareAutocast
    try:
        yield
    finally:
        torch.autocast = real


FALLBACK = "is falling back to its reference PyTorch implementation"   # transformers' hub_kernels.py warning


@contextlib.contextmanager
def _reference_kernels_heard(recorder: _Recorder):
    """transformers runs a kernel's PyTorch reference where its package (flash-linear-attention, causal-conv1d) is
    not installed, and warns once per process: while recording, each such warning becomes a capture note instead
    (every capture says it, not only a process's first), since the graph then holds the reference's many small
    ops, billed one by one, where a training run's fused kernel is one."""
    original = getattr(logging.Logger, "warning_once", None)   # transformers installs it on import
    if original is None:
        yield
        return

    def heard(logger, message, *args, **kwargs):
        text = str(message)
        if FALLBACK not in text:
            return original(logger, message, *args, **kwargs)
        if recorder.inside_leaf:   # a leaf is billed as one op by its counted FLOPs: the reference's ops are not
            return None
        names = text.split("`")
        function, package = (names[1], names[3]) if len(names) > 4 else ("a kernel", "its package")
        where = recorder.module_path[-1] if recorder.module_path else ""
        recorder.notes.add(f"transformers ran `{function}` in '{where}' as its PyTorch reference ({package} is not "
                           "installed where the plan was made): its many small ops are billed one by one, slower than "
                           f"the fused kernel a training run uses; --leaf-modules {where} bills that module as one op "
                           "of its counted FLOPs instead (replicated under tp)")
    logging.Logger.warning_once = heard
    try:
        yield
    finally:
        logging.Logger.warning_once = original


def _module_path_hooks(recorder: _Recorder) -> list:
    """Keep the path of the module whose code is running (nn_module_stack, for messages and node meta)."""
    def push(module, _args):
        recorder.module_path.append(recorder.names.modules.get(id(module), type(module).__name__))

    def pop(module, _args, _out):
        if recorder.module_path:
            recorder.module_path.pop()
    return [nn.modules.module.register_module_forward_pre_hook(push),
            nn.modules.module.register_module_forward_hook(pop)]


__all__ = ["Recording", "fresh_like", "record", "is_recorded_leaf"]
