"""What a stack's fused kernels keep for backward, as autograd functions run on meta tensors.

Capture measures saved tensors by running the graph under saved_tensors_hooks; where the device runs
one fused kernel (flash attention, a fused norm or activation) instead of the ops the code spells out,
these stand in for it, so that what is kept is what the kernel keeps. The MoE stand-in runs a
container whose code reads its routing with balanced routing instead.
"""
from __future__ import annotations

import torch
from torch import nn

from .expert_structure import router_topk
from .module_kinds import may_be_activation


class FlashAttention(torch.autograd.Function):
    """SDPA measured as a fused flash kernel: saves q, k, v, the output and the fp32 log-sum-exp,
    never the s x s matrix (on meta SDPA would take the math path and save it). The output is laid
    out [b, s, heads, d] and returned transposed, as CUDA's flash kernel returns it, so the usual
    transpose-and-reshape into the output projection is a view that shares its storage (measured on
    an H200: one h-wide tensor per layer less than a [b, heads, s, d] output; docs/gpu-validation.md)."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, heads, s = q.shape[:-1]
        out = q.new_empty(b, s, heads, v.shape[-1]).transpose(1, 2)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class FusedNorm(torch.autograd.Function):
    """A norm as one fused kernel (Apex / Transformer Engine / torch's fused rms_norm): keeps its input
    and fp32 per-row statistics (mean and rstd for LayerNorm, rstd for RMSNorm), nothing in between."""

    @staticmethod
    def forward(ctx, x, statistics: int):
        rows = x.shape[:-1]
        ctx.save_for_backward(x, torch.empty(*rows, statistics, dtype=torch.float32, device=x.device))
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad), None


class FusedActivation(torch.autograd.Function):
    """An activation function as one kernel: keeps its input only (as F.gelu or F.silu do)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def balanced_experts(container: nn.Module, found, x: torch.Tensor) -> torch.Tensor:
    """A MoE whose code routes by the router's values, run as balanced routing would run it: the router
    on every token, each expert module on its tokens x k / E dispatched copies (what it keeps for
    backward is measured), the combine, and any other child (shared experts) on every token."""
    tokens = x.reshape(-1, x.shape[-1])
    topk = router_topk(container) or 1
    per_expert = max(1, tokens.shape[0] * topk // found.count)
    out = torch.zeros_like(tokens)
    for child in container.children():
        if child is found.module_list:
            for expert in child:
                out = out + expert(tokens[:per_expert].clone()).sum() * 0
        elif isinstance(child, nn.Linear):
            out = out + child(tokens)[:, :1] * 0
        elif list(child.parameters()):
            out = out + child(tokens)
    return out.reshape(x.shape)


def bhsd(layout: str, tensors):
    return tuple(t.transpose(1, 2) for t in tensors) if layout == "bshd" else tuple(tensors)


def attention_core(layout: str, args):
    """An attention kernel module recorded from its q, k, v: a fused kernel, in the module's layout."""
    q, k, v = bhsd(layout, args[:3])
    out = FlashAttention.apply(q, k, v)
    return out.transpose(1, 2) if layout == "bshd" else out


def is_activation(module: nn.Module, args) -> bool:
    """An activation module called on one floating tensor (what the recording folded into one node)."""
    return may_be_activation(module) and len(args) == 1 and isinstance(args[0], torch.Tensor) \
        and args[0].is_floating_point()


def norm_statistics(module: nn.Module) -> int:
    """LayerNorm-type norms (with a bias, or torch's LayerNorm) keep mean and rstd; RMSNorm keeps rstd."""
    return 2 if isinstance(module, nn.LayerNorm) or getattr(module, "bias", None) is not None else 1
