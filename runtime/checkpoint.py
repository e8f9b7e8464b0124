"""The whole training state in one DCP checkpoint, resumable under any other layout.

Keys are full-model names, whatever the layout: `model/<param>` (from `get_model_state_dict`, DTensors where
sharded), `optim/<param>/<state>` (AdamW's `exp_avg`, `exp_avg_sq`, `step`, shaped and sharded like the
parameter), `train/step` (the last finished step: the data position, since a step's batch is a function of
its index), `train/lr` and `train/rng` (the CPU generator; every rank seeds and draws alike). DCP
reshards DTensors on load and deduplicates replicated tensors on save; under ZeRO-1
(`ZeroRedundancyOptimizer`) each rank saves and loads the optimizer state of the parameters it owns.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer


@dataclass(frozen=True)
class TrainState:
    step: int       # the last step the checkpoint includes; training resumes at step + 1
    lr: float


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


def _optimizer_template(named: dict[str, nn.Parameter], optimizer) -> dict[str, torch.Tensor]:
    """Empty tensors, shaped and sharded like each owned parameter, for the state `optimizer` keeps."""
    local = local_optimizer(optimizer)
    template = {}
    if not isinstance(local, torch.optim.AdamW):
        return template
    for name, param in named.items():
        template[f"optim/{name}/exp_avg"] = torch.zeros_like(param)
        template[f"optim/{name}/exp_avg_sq"] = torch.zeros_like(param)
        template[f"optim/{name}/step"] = torch.zeros((), dtype=torch.float32)
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


def training_state(modules, optimizer, canonical, train: TrainState) -> dict[str, torch.Tensor]:
    """What one checkpoint holds, for this rank."""
    named = _named_owned(modules, optimizer, canonical)
    return {**_model_state(modules), **_optimizer_state(named, optimizer),
            "train/step": torch.tensor(train.step), "train/lr": torch.tensor(train.lr, dtype=torch.float64),
            "train/rng": torch.get_rng_state()}


def save(path: str, modules, optimizer, canonical, train: TrainState, asynchronous: bool = False,
         process_group=None):
    """Write the checkpoint; with `asynchronous`, return the future `dcp.async_save` gives (wait on it
    before the next save or the end of the job), its collectives on `process_group` (a gloo group)."""
    state = training_state(modules, optimizer, canonical, train)
    if asynchronous:
        return dcp.async_save(state, checkpoint_id=path, process_group=process_group)
    dcp.save(state, checkpoint_id=path)
    return None


def load(path: str, modules, optimizer, canonical) -> TrainState:
    """Read the checkpoint into this layout's modules and optimizer; returns where training stood."""
    named = _named_owned(modules, optimizer, canonical)
    state = {**_model_state(modules), **_optimizer_template(named, optimizer),
             "train/step": torch.tensor(0), "train/lr": torch.tensor(0.0, dtype=torch.float64),
             "train/rng": torch.get_rng_state()}
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
    for group in local.param_groups:
        group["lr"] = lr
    torch.set_rng_state(state["train/rng"])
    return TrainState(step=int(state["train/step"]), lr=lr)


LATEST = "latest"   # names the last checkpoint of a directory that every rank finished writing (runtime/checkpointing.py)


def latest(directory: str) -> Path | None:
    """The last complete checkpoint in `directory`, or None."""
    marker = Path(directory) / LATEST
    return Path(directory) / marker.read_text().strip() if marker.is_file() else None
