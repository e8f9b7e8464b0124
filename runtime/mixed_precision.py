"""The plan's precision, applied with torch's own mechanisms or refused before the first step.

bf16: parameters stay fp32 and are the master weights (what the optimizer steps); where FSDP2 shards,
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=...)` casts them per use and reduces gradients in
the plan's `grad_reduce` dtype; elsewhere (DDP / ZeRO-1 / TP without FSDP, pipeline stages) the forward
runs under `torch.autocast(dtype=bfloat16)` and gradients are reduced in fp32, as torchtitan does without
FSDP. fp32 (numerical checks only, asked for explicitly): no casts. fp8 and a bf16 reduction without FSDP2
are refused: this runtime does not apply them, and it never trains otherwise than the plan says.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from cost_models.layout import GradReduce, Layout

from .dims import ParallelDims, PlanError

PRECISIONS = ("bf16", "fp32", "fp8")


def check(precision: str, layout: Layout, dims: ParallelDims) -> str:
    """The precision to train in, or a PlanError naming what this runtime cannot apply."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if precision == "fp8":
        raise PlanError("precision fp8: this runtime does not apply FP8 training (torchao's float8 is not among "
                        "its dependencies, and CPUs have no FP8 matrix units); plan with --precision bf16, or "
                        "train with a stack that has it (planner export --to megatron)")
    if precision == "bf16" and layout.grad_reduce == GradReduce.bf16 and dims.zero < 2:
        raise PlanError("grad_reduce=bf16 with ZeRO-0/1: this runtime reduces in bf16 only through FSDP2's "
                        "MixedPrecisionPolicy (ZeRO-2/3); plan with grad_reduce=fp32 or zero=2")
    return precision


def fsdp_policy(precision: str, layout: Layout) -> MixedPrecisionPolicy | None:
    if precision != "bf16":
        return None
    reduce = torch.bfloat16 if layout.grad_reduce == GradReduce.bf16 else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def autocast(precision: str, device_type: str, sharded_by_fsdp: bool):
    """The context the forward runs in: autocast to bf16 where FSDP2's policy does not cast."""
    if precision == "bf16" and not sharded_by_fsdp:
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
