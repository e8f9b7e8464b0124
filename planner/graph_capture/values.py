"""Where a recorded call's tensors live: meta wherever a parameter's data flows, real CPU values elsewhere.

Model code branches on tensors no parameter feeds (token positions, packed-sequence ids); those are
small and cheap, so the recording computes them for real, as a device would. Everything a weight
touches stays on meta (shapes only). Also here: attention's q, k, v recognised by shape, and the
corrections torch's meta kernels need to shape outputs as the device does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .graph_analysis import is_varlen_attention


# Tensors that no parameter feeds (token positions, packed-sequence ids, small index tables) are computed
# for real on the CPU, as a device would: model code branches on them ("is this batch packed?") and
# would read a meta tensor's value otherwise. Above this size a tensor is a mask or table nobody branches
# on (an s x s mask at long context would cost gigabytes), and it stays on meta.
REAL_VALUE_MAX_ELEMENTS = 1 << 22


class TableOverrun(Exception):
    """An embedding looked up past its table: on a device, an index-out-of-range assert."""


def check_lookup(func, args) -> None:
    if func not in (F.embedding, torch.embedding) or len(args) < 2:
        return
    indices, weight = (args[0], args[1]) if func is F.embedding else (args[1], args[0])
    if isinstance(indices, torch.Tensor) and not indices.is_meta and indices.numel() \
            and int(indices.max()) >= weight.shape[0]:
        raise TableOverrun(f"index {int(indices.max()):,} looked up in an embedding table of {weight.shape[0]:,} "
                           "rows (a sequence longer than the learned position embeddings?)")


def on_one_device(args, kwargs, module: nn.Module | None = None):
    """Real-valued tensors moved to meta where they meet a meta tensor (or a module with meta weights):
    what a parameter's data touches is shapes only."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    weights_on_meta = module is not None and any(p.is_meta for p in module.parameters(recurse=False))
    if (weights_on_meta or any(t.is_meta for t in tensors)) and not all(t.is_meta for t in tensors):
        return tree_map(to_meta, (args, kwargs))
    return args, kwargs


def with_value_width(func, args, out):
    """torch 2.13's meta kernel for varlen attention shapes its output like q; the kernel's output has v's
    head size (they differ in MLA: 192 against 128). Output and log-sum-exp as the device makes them."""
    if not is_varlen_attention(func) or not isinstance(out, tuple) or len(args) < 3:
        return out
    v = args[2]
    if out[0].shape[-1] == v.shape[-1]:
        return out
    # autograd must see the op: keep its output's graph edge and give it v's width
    fixed = out[0][..., :v.shape[-1]] if out[0].shape[-1] > v.shape[-1] else out[0]
    return (fixed, *out[1:])


def run_call(func, args, kwargs):
    """Call func with meta tensors wherever a parameter's data flows, real CPU values elsewhere."""
    check_lookup(func, args)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(t.is_meta for t in tensors):
        args, kwargs = on_one_device(args, kwargs)
        args, kwargs = tree_map(cpu_to_meta, (args, kwargs))   # a large mask moved .to(a real tensor's device)
        if isinstance(kwargs.get("device"), str) and kwargs["device"] == "cpu":
            kwargs = {**kwargs, "device": "meta"}
        return with_value_width(func, args, func(*args, **kwargs))
    device = kwargs.get("device")
    if tensors:
        try:  # the output's size, learnt without computing it
            on_meta = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except (RuntimeError, NotImplementedError):  # reads a value (bool(), .item(), nonzero): read it
            return func(*args, **kwargs)
    elif device is not None and torch.device(device).type == "meta":   # a factory: arange, zeros, full...
        on_meta = func(*args, **kwargs)
        kwargs = {**kwargs, "device": "cpu"}
    else:
        return func(*args, **kwargs)
    shapes = [t for t in tree_flatten(on_meta)[0] if isinstance(t, torch.Tensor)]
    if sum(t.numel() for t in shapes) > REAL_VALUE_MAX_ELEMENTS or any(t.is_floating_point() and t.requires_grad
                                                                         for t in shapes):
        return on_meta
    return func(*args, **kwargs)


def cpu_to_meta(value):
    return torch.device("meta") if isinstance(value, torch.device) and value.type == "cpu" else value


def to_meta(value):
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to("meta")
    return value


def query_key_value(args) -> tuple | None:
    """The first three arguments, if they are attention's q, k, v: 4-D [b, heads, s, d] floating tensors
    with one batch, q and k of one head size, k and v of one length, q's heads a multiple of k's."""
    if len(args) < 3 or not all(isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point()
                                for a in args[:3]):
        return None
    q, k, v = args[:3]
    same = q.shape[0] == k.shape[0] == v.shape[0] and q.shape[-1] == k.shape[-1]
    return (q, k, v) if same else None


def attention_layout(qkv: tuple, seq_len: int | None) -> str | None:
    """Where the sequence sits in q, k, v: [b, heads, s, d] ("bhsd", SDPA's) or [b, s, heads, d]."""
    q, k, v = qkv
    if seq_len is None:
        return None
    if q.shape[2] == k.shape[2] == seq_len and q.shape[1] % k.shape[1] == 0:
        return "bhsd"
    if q.shape[1] == k.shape[1] == v.shape[1] == seq_len and q.shape[2] % k.shape[2] == 0:
        return "bshd"
    return None
