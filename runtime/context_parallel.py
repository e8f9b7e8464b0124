"""Context parallelism on functional collectives (torch's `context_parallel()` needs CUDA kernels).

The sequence is cut into 2 * cp chunks and rank r keeps chunks r and 2cp-1-r, so every rank holds as
much causal work as any other (Llama 3's load balancing). Attention all-gathers K and V over the cp
group with autograd (its backward reduce-scatters their gradients) and masks by global positions;
rotary embeddings use each token's global position. The reference attention
(`planner.reference_model.CoreAttention` and `Rotary`) is routed by its own code; in other models (transformers'
SDPA attention) every causal `scaled_dot_product_attention` inside a block is (a torch function mode), and the
embedding part's position readers (rotary `position_ids`, learned position embeddings) get global positions.
"""
from __future__ import annotations

import inspect
import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from planner.graph_capture.graph import ModelGraph
from planner.graph_capture.reference_model import CoreAttention, Rotary, rotate_half

from .dims import PlanError


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of rank's tokens: chunks rank and 2cp-1-rank of 2cp equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    return tensor[:, local_positions(tensor.shape[1], cp, rank)]


def _rotary_forward(self, x, offset: int = 0):
    positions = self._cp_positions
    cos = self.cos[positions].to(x.dtype)
    sin = self.sin[positions].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def _attention_forward(self, q, k, v):
    group, positions = self._cp_group, self._cp_positions
    k_all = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=group)
    v_all = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=group)
    key_positions = self._cp_key_positions
    mask = positions[:, None] >= key_positions[None, :]
    if self.kv_repeat > 1 and self.impl != "flash":
        k_all = k_all.repeat_interleave(self.kv_repeat, dim=1)
        v_all = v_all.repeat_interleave(self.kv_repeat, dim=1)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          enable_gqa=self.kv_repeat > 1 and self.impl == "flash")


class SequenceShardedAttention(TorchFunctionMode):
    """Inside a block: every causal `scaled_dot_product_attention` attends over the whole sequence, K and
    V all-gathered over the cp group (with autograd), masked by global positions."""

    def __init__(self, group, positions: torch.Tensor, key_positions: torch.Tensor):
        super().__init__()
        self.group, self.mask = group, positions[:, None] >= key_positions[None, :]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, *rest = args
        mask = kwargs.pop("attn_mask", rest[0] if rest else None)
        causal = kwargs.pop("is_causal", False)
        if mask is not None or not causal or len(rest) > 1:
            raise PlanError("context parallelism splits causal attention without a mask; this model's attention "
                            "was given a mask (padding, packed sequences or a sliding window): run it with cp=1")
        k_all = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.group)
        v_all = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.group)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self.mask.to(q.device), **kwargs)


def _sequence_sharded(block: nn.Module, mode: SequenceShardedAttention) -> None:
    original = block.forward

    def forward(*args, **kwargs):
        with mode:
            return original(*args, **kwargs)
    block.forward = forward


def _global_positions(module: nn.Module, argument: str | None, positions: torch.Tensor) -> None:
    """Pre-hook: positions the top-level code computed for the local tokens (0..n-1) become the tokens'
    global positions (rotary embeddings' `position_ids`, by keyword or position; a learned position
    embedding's input)."""
    signature = inspect.signature(module.forward)

    def hook(sub, args, kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        given = bound.get(argument) if argument else (args[0] if args else None)
        if given is None:
            return None
        local = torch.arange(given.shape[-1], device=given.device)
        if not torch.equal(given.reshape(-1, given.shape[-1])[0], local):
            raise PlanError(f"context parallelism gives {type(sub).__name__} global positions, but the model "
                            "passed it positions other than 0..n-1: run it with cp=1")
        moved = positions.to(given.device).expand_as(given)
        if not argument:
            return (moved, *args[1:]), kwargs
        bound[argument] = moved
        return (), bound
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _position_takers(module: nn.Module, embedding_modules: tuple[str, ...]) -> list[tuple[nn.Module, str | None]]:
    """Embedding-part modules that read positions: those taking `position_ids` (rotary embeddings) and
    embeddings other than the first (the token embedding), which read positions as their input."""
    takers, present = [], {name for name, _ in module.named_modules()}
    for index, name in enumerate(embedding_modules):
        if name not in present:
            continue
        sub = module.get_submodule(name)
        if "position_ids" in inspect.signature(sub.forward).parameters:
            takers.append((sub, "position_ids"))
        elif isinstance(sub, nn.Embedding) and index > 0:
            takers.append((sub, None))
    return takers


def apply_cp(module: nn.Module, graph: ModelGraph, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Route attention and positions through the cp group: the reference attention and rotary embeddings
    by their own code, other models' scaled_dot_product_attention inside each block."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if seq_len % (2 * cp):
        raise ValueError(f"sequence {seq_len} does not split into 2*cp = {2 * cp} chunks")
    positions = local_positions(seq_len, cp, rank)
    keys = torch.cat([local_positions(seq_len, cp, r) for r in range(cp)])
    reference = False
    for sub in module.modules():
        if isinstance(sub, CoreAttention):
            sub._cp_group, sub._cp_positions, sub._cp_key_positions = cp_mesh.get_group(), positions, keys
            sub.forward = types.MethodType(_attention_forward, sub)
            reference = True
        elif isinstance(sub, Rotary):
            sub._cp_positions = positions
            sub.forward = types.MethodType(_rotary_forward, sub)
    if reference:
        return
    present = {name for name, _ in module.named_modules()}
    mode = SequenceShardedAttention(cp_mesh.get_group(), positions, keys)
    for slot in graph.blocks:
        if slot.module_name in present:
            _sequence_sharded(module.get_submodule(slot.module_name), mode)
    for sub, argument in _position_takers(module, graph.embedding_modules):
        _global_positions(sub, argument, positions)
