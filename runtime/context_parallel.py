"""Context parallelism on functional collectives (torch's `context_parallel()` needs CUDA kernels).

The sequence is cut into 2 * cp chunks and rank r keeps chunks r and 2cp-1-r, so every rank holds as
much causal work as any other (Llama 3's load balancing). Attention all-gathers K and V over the cp
group with autograd (its backward reduce-scatters their gradients) and masks by global positions;
rotary embeddings use each token's global position. Applies to the reference attention
(`planner.reference_model.CoreAttention` and `Rotary`).
"""
from __future__ import annotations

import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.capture.reference_model import CoreAttention, Rotary, rotate_half


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


def apply_cp(module: nn.Module, cp_mesh: DeviceMesh, seq_len: int) -> None:
    """Route the reference attention and rotary embeddings through the cp group."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if seq_len % (2 * cp):
        raise ValueError(f"sequence {seq_len} does not split into 2*cp = {2 * cp} chunks")
    positions = local_positions(seq_len, cp, rank)
    keys = torch.cat([local_positions(seq_len, cp, r) for r in range(cp)])
    found = False
    for sub in module.modules():
        if isinstance(sub, CoreAttention):
            sub._cp_group, sub._cp_positions, sub._cp_key_positions = cp_mesh.get_group(), positions, keys
            sub.forward = types.MethodType(_attention_forward, sub)
            found = True
        elif isinstance(sub, Rotary):
            sub._cp_positions = positions
            sub.forward = types.MethodType(_rotary_forward, sub)
    if not found:
        raise ValueError("context parallelism needs the reference attention (planner.reference_model.CoreAttention)")
