"""The whole training state in one DCP checkpoint, resumable under any other layout.

Keys are full-model names, whatever the layout: `model/<param>` (from `get_model_state_dict`, DTensors where
sharded), `optim/<param>/<state>` (whatever the optimizer keeps per parameter: AdamW's `exp_avg`,
`exp_avg_sq`, `step`, SGD's `momentum_buffer`..., shaped and sharded like the parameter; on load, what the
checkpoint holds, read from its metadata), `train/step` (the last finished step), `train/lr` and `train/rng`
(the CPU generator; every rank seeds and draws alike), and `train/loop`: the loop's own state as JSON bytes
(each parameter group's learning rate, the LR scheduler's state, the data loader's layout-free position). DCP
reshards DTensors on load and deduplicates replicated tensors on save; under ZeRO-1
(`ZeroRedundancyOptimizer`) each rank saves and loads the optimizer state of the parameters it owns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from .verified import STEP_DIR, Identity


@dataclass(frozen=True)
class TrainState:
    step: int       # the last step the checkpoint includes; training resumes at step + 1
    lr: float
    loop: dict = field(default_factory=dict)   # group lrs, scheduler state, data position (JSON)


def _json_tensor(data: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(data, sort_keys=True).encode()), dtype=torch.uint8)


def _json_of(tensor: torch.Tensor) -> dict:
    return json.loads(bytes(tensor.tolist()).decode())


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO-1 keeps its shard in an inner optimizer)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _named_owned(modules: list[nn.Module], optimizer, canonical: dict[str, str]) -> dict[str, nn.Parameter]:
    """This rank's parameters whose optimizer state it holds, by full-model name (a tied weight's first)."""
    local = local_optimizer(optimizer)
    owned = {id(p) for group in local.param_groups for p in group["params"]}
    named = {}
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in owned:
                named.setdefault(canonical.get(name, name), param)
    return named


def _optimizer_template(named: dict[str, nn.Parameter], path: str) -> dict[str, torch.Tensor]:
    """Empty tensors for the optimizer state the checkpoint holds of each owned parameter, read from its
    metadata: those of the parameter's shape shaped and sharded like it, the others (AdamW's step) as saved."""
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    template = {}
    for key, meta in saved.items():
        if not key.startswith("optim/"):
            continue
        name = key[len("optim/"):].rsplit("/", 1)[0]
        if name not in named:
            continue
        param = named[name]
        size = tuple(getattr(meta, "size", ()))
        template[key] = torch.zeros_like(param) if size == tuple(param.shape) and size else \
            torch.zeros(size, dtype=meta.properties.dtype)
    return template


def _optimizer_state(named: dict[str, nn.Parameter], optimizer) -> dict[str, torch.Tensor]:
    local = local_optimizer(optimizer)
    state = {}
    for name, param in named.items():
        for key, value in local.state.get(param, {}).items():
            state[f"optim/{name}/{key}"] = value
    return state


def _model_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    state: dict = {}
    for module in modules:
        state.update({f"model/{k}": v for k, v in get_model_state_dict(module).items()})
    return state


def identity_of(modules: list[nn.Module], optimizer) -> Identity:
    """What a checkpoint of this rank's state is of: the optimizer class, its model keys and global shapes."""
    parameters = {}
    for module in modules:
        for key, value in get_model_state_dict(module).items():
            parameters[f"model/{key}"] = list(value.shape)   # a DTensor's shape is the whole tensor's
    return Identity(optimizer=type(local_optimizer(optimizer)).__name__, parameters=parameters)


def training_state(modules, optimizer, canonical, train: TrainState) -> dict[str, torch.Tensor]:
    """What one checkpoint holds, for this rank."""
    named = _named_owned(modules, optimizer, canonical)
    return {**_model_state(modules), **_optimizer_state(named, optimizer),
            "train/step": torch.tensor(train.step), "train/lr": torch.tensor(train.lr, dtype=torch.float64),
            "train/rng": torch.get_rng_state(), "train/loop": _json_tensor(train.loop)}


def save(path: str, modules, optimizer, canonical, train: TrainState, asynchronous: bool = False,
         process_group=None, writer=None):
    """Write the checkpoint; with `asynchronous`, return the future `dcp.async_save` gives (wait on it
    before the next save or the end of the job), its collectives on `process_group` (a gloo group).
    `writer`: DCP's storage writer (runtime.verified.HashingWriter: what was written, hashed as written)."""
    state = training_state(modules, optimizer, canonical, train)
    if asynchronous:
        return dcp.async_save(state, checkpoint_id=path, process_group=process_group, storage_writer=writer)
    dcp.save(state, checkpoint_id=path, storage_writer=writer)
    return None


def load(path: str, modules, optimizer, canonical) -> TrainState:
    """Read the checkpoint into this layout's modules and optimizer; returns where training stood."""
    from torch.distributed.checkpoint import FileSystemReader
    named = _named_owned(modules, optimizer, canonical)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {**_model_state(modules), **_optimizer_template(named, path),
             "train/step": torch.tensor(0), "train/lr": torch.tensor(0.0, dtype=torch.float64),
             "train/rng": torch.get_rng_state()}
    if "train/loop" in saved:   # checkpoints written before the loop's state was kept have none
        state["train/loop"] = torch.zeros(saved["train/loop"].size, dtype=torch.uint8)
    dcp.load(state, checkpoint_id=path)
    for module in modules:
        names = set(get_model_state_dict(module))
        set_model_state_dict(module, {k: state[f"model/{k}"] for k in names})
    local = local_optimizer(optimizer)
    for name, param in named.items():
        entries = {key.rsplit("/", 1)[1]: value for key, value in state.items()
                   if key.startswith(f"optim/{name}/")}
        if entries:
            local.state[param] = entries
    lr = float(state["train/lr"])
    loop = _json_of(state["train/loop"]) if "train/loop" in state else {}
    lrs = loop.get("lrs") or [lr] * len(local.param_groups)
    for group, group_lr in zip(local.param_groups, lrs):
        group["lr"] = group_lr
    torch.set_rng_state(state["train/rng"])
    return TrainState(step=int(state["train/step"]), lr=lr, loop=loop)


def save_training(path: str, model, optimizer, step: int, scheduler=None, loader=None, asynchronous: bool = False,
                  process_group=None, writer=None):
    """A user loop's whole state after `step`: the laid-out model (`runtime.laid_out.LaidOutModel`), its
    optimizer (any torch.optim, its groups' learning rates), the LR scheduler's state and the data loader's
    layout-free position (`runtime.data.rank_loader`) where given; loadable under any other layout."""
    from .laid_out import inner
    loop = {"lrs": [group["lr"] for group in optimizer.param_groups]}
    if scheduler is not None:
        loop["scheduler"] = scheduler.state_dict()
    if loader is not None:
        loop["data"] = loader.batch_sampler.state_dict()
    return save(path, [inner(m) for m in model.modules], optimizer, model.canonical_names,
                TrainState(step=step, lr=loop["lrs"][0], loop=loop), asynchronous, process_group, writer)


def load_training(path: str, model, optimizer, scheduler=None, loader=None) -> int:
    """Resume a user loop from `save_training`'s checkpoint (written under any layout); the step it ended."""
    from .laid_out import inner
    train = load(path, [inner(m) for m in model.modules], optimizer, model.canonical_names)
    for group, lr in zip(optimizer.param_groups, train.loop.get("lrs", [train.lr] * len(optimizer.param_groups))):
        group["lr"] = lr
    if scheduler is not None and "scheduler" in train.loop:
        scheduler.load_state_dict(train.loop["scheduler"])
    if loader is not None and "data" in train.loop:
        loader.batch_sampler.load_state_dict(train.loop["data"])
    return train.step


@dataclass
class LoopState:
    """A user loop's state as `runtime.checkpointing.Checkpointer` saves and restores it: the laid-out model, its
    optimizer and, where given, the LR scheduler and the data loader (`runtime.data.rank_loader`)."""
    model: object                 # runtime.laid_out.LaidOutModel
    optimizer: torch.optim.Optimizer
    scheduler: object = None
    loader: object = None

    @property
    def params(self) -> list:
        return self.model.params

    def save(self, path: str, step: int, asynchronous: bool = False, process_group=None, writer=None):
        return save_training(path, self.model, self.optimizer, step, self.scheduler, self.loader, asynchronous,
                             process_group, writer)

    def load(self, path: str) -> int:
        return load_training(path, self.model, self.optimizer, self.scheduler, self.loader)

    def identity(self) -> Identity:
        from .laid_out import inner
        return identity_of([inner(m) for m in self.model.modules], self.optimizer)


LATEST = "latest"   # names the last checkpoint of a directory that every rank finished writing (runtime/checkpointing.py)


def latest(directory: str) -> Path | None:
    """The last complete checkpoint in `directory`, or None (no marker, or one that names no checkpoint of it)."""
    name = latest_name(Path(directory))
    return None if name is None else Path(directory) / name


def latest_name(directory: Path) -> str | None:
    """What `latest` names where it names a checkpoint directory inside `directory`; None otherwise."""
    marker = directory / LATEST
    try:
        name = marker.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_DIR.match(name) and (directory / name).is_dir() else None
