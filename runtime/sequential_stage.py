"""Pipeline stages of models torch.fx cannot trace (transformers' classes, read by recording): the model's
own top-level forward runs on every stage, with only that stage's blocks in its block container.

Capture names the block container (`model.layers`), the embedding part and the head part. A stage is a
shell of the model: the modules on the way from the root to those parts are shallow copies (their own
module, parameter and hook tables), everything else is shared with the model, so parameter names stay the
full model's. The container holds the stage's blocks under their own indices; the embedding part's
parameterised modules are on the first stage only (elsewhere a stand-in returns zeros of the embedding's
width, so that the top-level code derives masks and positions from the whole token shape, as it does on
the first stage), the head part on the last only. A non-first stage puts the hidden state it receives in
as its first block's input; on a non-last stage the first call into the head part ends the forward, and
what that call was given is the stage's output.

The top-level code must call the container's blocks once each, in order, and pass each block's output
to the next (transformers' decoders all do); `sequential_stage` runs each stage once before training to
see that it does, and refuses the model otherwise.
"""
from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass

import torch
from torch import nn

from .dims import PlanError, error_line


class StageBlocks(nn.ModuleList):
    """A stage's blocks under their full-model indices ("4", "5"), indexed by position as the model's
    own code indexes its list (`self.layers[i]`, `self.layers[:n]`)."""

    def __init__(self, blocks: dict[str, nn.Module] | list[nn.Module] | None = None):
        super().__init__()
        items = blocks.items() if isinstance(blocks, dict) else enumerate(blocks or [])
        for key, block in items:
            self.add_module(str(key), block)

    def __getitem__(self, index):
        values = list(self._modules.values())
        return nn.ModuleList(values[index]) if isinstance(index, slice) else values[index]


class AbsentEmbedding(nn.Module):
    """An embedding another stage holds: zeros of its width for the shapes the top-level code reads."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.width, self.dtype = embedding.embedding_dim, embedding.weight.dtype

    def forward(self, ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, device=ids.device, dtype=self.dtype)


class StageEnd(Exception):
    """Raised by the head part on a non-last stage: carries the hidden state the stage hands on."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("end of pipeline stage")
        self.hidden = hidden


class HeadOnLaterStage(nn.Module):
    """A head-part module another stage holds: calling it ends this stage with its input."""

    def forward(self, hidden, *args, **kwargs):
        raise StageEnd(hidden)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy that shares submodules and tensors but owns its tables (modules, parameters, hooks)."""
    twin = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set, list)):
            twin.__dict__[key] = copy.copy(value)
    return twin


def _shell(model: nn.Module, paths: list[str]) -> nn.Module:
    """The model with the modules on the way to each path shallow-copied (path leaves themselves not)."""
    root = _shallow(model)
    copied = {"": root}
    for path in paths:
        parts = path.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix not in copied:
                parent = copied[".".join(parts[:depth - 1])]
                copied[prefix] = _shallow(parent._modules[parts[depth - 1]])
                parent._modules[parts[depth - 1]] = copied[prefix]
    return root


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    (root.get_submodule(parent_path) if parent_path else root)._modules[name] = module


@dataclass(frozen=True)
class HiddenInput:
    """Where a module takes its hidden state in a forward pre-hook's (args, kwargs): the first positional
    argument, or its first parameter by name where the model passes it so."""
    name: str

    @classmethod
    def of(cls, module: nn.Module) -> "HiddenInput":
        return cls(next(iter(inspect.signature(module.forward).parameters)))

    def get(self, args: tuple, kwargs: dict):
        return args[0] if args else kwargs[self.name]

    def put(self, args: tuple, kwargs: dict, new) -> tuple[tuple, dict]:
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, self.name: new})


def sequential_stage(model: nn.Module, container: str, blocks: range, is_first: bool, is_last: bool,
                     embedding_modules: tuple[str, ...], head_modules: tuple[str, ...],
                     sequence_shards: int) -> nn.Module:
    """The stage running blocks `blocks` of `model.<container>` (with the embedding and/or head part as
    it holds them). `sequence_shards`: by how much the hidden state the stage receives is cut along the
    sequence (tp under sequence parallelism), to rebuild the whole token shape the top-level code reads."""
    owned_names = [f"{container}.{i}" for i in blocks]
    stage = _shell(model, [container, *embedding_modules, *head_modules])
    full = model.get_submodule(container)
    if not isinstance(full, nn.ModuleList):
        raise PlanError(f"{container} is a {type(full).__name__}, not an nn.ModuleList: this runtime cuts pipeline "
                        "stages of a recorded model by the list its forward iterates; run it with pp=1")
    owned = StageBlocks({str(i): full[i] for i in blocks})
    _replace(stage, container, owned)
    if not is_first:
        for name in embedding_modules:
            sub = model.get_submodule(name)
            if isinstance(sub, nn.Embedding):
                _replace(stage, name, AbsentEmbedding(sub))
            elif any(True for _ in sub.parameters()):
                raise PlanError(f"{name} holds parameters before the blocks and is not an embedding: this runtime "
                                "cannot leave it to the first pipeline stage; run the model with pp=1")
    if not is_last:
        for name in head_modules:
            _replace(stage, name, HeadOnLaterStage())
    _check_parameters(stage, owned_names, embedding_modules if is_first else (), head_modules if is_last else ())
    stage._stage_input, stage._stage_calls = None, []
    for block in owned:
        block.register_forward_pre_hook(_count_call(stage))
    if not is_first:   # the received hidden state enters the first block, or the head where there is none
        entries = [owned[0]] if len(owned) else [stage.get_submodule(name) for name in head_modules]
        for entry in entries:
            entry.register_forward_pre_hook(_inject(stage, HiddenInput.of(entry)), with_kwargs=True)
    stage.forward = types.MethodType(_stage_forward(type(model).forward, is_first), stage)
    embedding = model.get_submodule(embedding_modules[0])
    stage._sequence_shards = 1   # the check runs before tensor parallelism cuts anything
    _check_calls(stage, list(owned), is_first, embedding.embedding_dim, embedding.weight.dtype)
    stage._sequence_shards = sequence_shards
    return stage


def _check_parameters(stage: nn.Module, blocks: list[str], embedding: tuple[str, ...], head: tuple[str, ...]) -> None:
    """Every parameter the stage holds belongs to its blocks or to the parts it holds."""
    allowed = (*blocks, *embedding, *head)
    for name, _ in stage.named_parameters():
        if not any(name.startswith(part + ".") for part in allowed):
            raise PlanError(f"parameter {name} is neither in a block nor in the embedding or head part: this runtime "
                            "cannot place it on a pipeline stage; run the model with pp=1")


def _count_call(stage):
    def hook(block, args):
        stage._stage_calls.append(block)
    return hook


def _inject(stage, hidden: HiddenInput):
    """Pre-hook of the stage's entry (its first block, or its head): the hidden state received from the
    previous stage replaces what the top-level code computed from the stand-in embedding."""
    def hook(module, args, kwargs):
        received, stage._stage_input = stage._stage_input, None
        return None if received is None else hidden.put(args, kwargs, received)
    return hook


def _stage_forward(whole, is_first: bool):
    def forward(self, inputs):
        if is_first:
            tokens = inputs
        else:   # the whole token shape for the top-level code; the entry sees what was received
            self._stage_input = inputs
            tokens = torch.zeros((inputs.shape[0], inputs.shape[1] * self._sequence_shards), dtype=torch.long,
                                 device=inputs.device)
        self._stage_calls = []
        try:
            return whole(self, tokens)
        except StageEnd as end:
            return end.hidden
    return forward


def _check_calls(stage: nn.Module, owned: list[nn.Module], is_first: bool, width: int, dtype: torch.dtype) -> None:
    """One forward of one short sequence before training (no gradients, RNG put back): the stage calls
    its blocks once each, in order, or the model is refused here rather than trained wrong."""
    param = next(stage.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    inputs = torch.zeros((1, 8), dtype=torch.long, device=device) if is_first else \
        torch.zeros((1, 8, width), dtype=dtype, device=device)
    training = stage.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device],
                                                    device_type=device.type):
            stage.eval()
            stage(inputs)
    except (RuntimeError, IndexError, TypeError, ValueError) as exc:
        raise PlanError(f"a pipeline stage of this model fails when run alone ({error_line(exc, 160)}): this runtime "
                        "cuts a recorded model into stages by its block list, which its forward must call in order; "
                        "run it with pp=1") from None
    finally:
        stage.train(training)
    if [id(b) for b in stage._stage_calls] != [id(b) for b in owned]:
        raise PlanError(f"the model's forward called {len(stage._stage_calls)} of a stage's {len(owned)} blocks, or "
                        "not in order: this runtime cuts a recorded model into stages by its block list, which its "
                        "forward must call once each, in order; run it with pp=1")
