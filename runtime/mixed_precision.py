"""The plan's precision, applied with torch's own mechanisms (and torchao's float8 training) or refused
before the first step.

bf16: parameters stay fp32 and are the master weights (what the optimizer steps); where FSDP2's machinery
wraps them (ZeRO-2/3, and ZeRO-0 over dp > 1 through torch's replicate built on it),
`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=...)` casts them per use and reduces gradients in
the plan's `grad_reduce` dtype; elsewhere (ZeRO-1's DDP, one data-parallel rank, pipeline stages) the
forward runs under `torch.autocast(dtype=bfloat16)` and gradients are reduced in fp32, as torchtitan does
without FSDP. fp8: all of bf16, and the blocks' linear layers train through torchao's `Float8Linear` with the
tensorwise (current, dynamic) scaling recipe, as torchtitan's float8 converter does: the embedding and
the output layer stay bf16 (as Transformer Engine keeps them), and layers whose widths are not multiples
of 16 (the FP8 GEMM's tile) too; under tensor parallelism torchao's Float8Colwise/RowwiseParallel shard
them. Refused before the first step: fp8 without torchao installed (`pip install 'parallel-planner[fp8]'`),
on a device whose `torch._scaled_mm` does not run e4m3 (probed), or with another recipe (delayed scaling
is gone from torchao); a bf16 reduction under ZeRO-1. fp32 (numerical checks only, asked for
explicitly): no casts. It never trains otherwise than the plan says.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from cost_models.layout import Fp8Recipe, GradReduce, Layout
from planner.graph_capture.graph import ModelGraph

from .dims import PlanError, error_line

PRECISIONS = ("bf16", "fp32", "fp8")
MIXED = ("bf16", "fp8")      # bf16 compute over fp32 master weights (fp8: and FP8 GEMMs besides)
FP8_GEMM_MULTIPLE = 16       # torch._scaled_mm takes matrices whose dimensions are multiples of 16


def check(precision: str, layout: Layout, device_type: str = "cpu") -> str:
    """The precision to train in, or a PlanError naming what this runtime cannot apply."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if precision == "fp8":
        _check_fp8(layout, device_type)
        if layout.tp > 1 and device_type == "cpu":
            raise PlanError("precision fp8 with tp > 1 on cpu: torchao's float8 tensor parallelism moves FP8 tensors "
                            "through collectives, which gloo cannot carry (NCCL and HCCL can); run fp8 with tp=1 "
                            "on CPUs, or bf16")
    if precision in MIXED and layout.grad_reduce == GradReduce.bf16 and layout.zero == 1:
        raise PlanError("grad_reduce=bf16 with ZeRO-1: this runtime reduces in bf16 only through FSDP2's "
                        "MixedPrecisionPolicy (ZeRO-0's replicate, ZeRO-2/3); plan with grad_reduce=fp32, zero=0 "
                        "or zero=2")
    return precision


def _check_fp8(layout: Layout, device_type: str) -> None:
    if layout.fp8_recipe != Fp8Recipe.tensorwise:
        raise PlanError(f"fp8_recipe={layout.fp8_recipe}: this runtime trains FP8 with torchao's tensorwise (current) "
                        "scaling only; plan with fp8_recipe=tensorwise")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise PlanError("precision fp8: this runtime trains FP8 through torchao's float8, which is not installed "
                        "(pip install 'parallel-planner[fp8]'); or plan with --precision bf16") from None
    device = torch.device(device_type)
    try:   # the FP8 GEMM torchao calls, on one smallest tile of this device
        ones = torch.ones(FP8_GEMM_MULTIPLE, FP8_GEMM_MULTIPLE, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones((), device=device)
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        raise PlanError(f"precision fp8: this {device_type} device does not run FP8 matrix products "
                        f"(torch._scaled_mm: {error_line(exc, 120)}); plan with --precision bf16") from None


def fp8_linears(module: nn.Module, graph: ModelGraph) -> None:
    """The blocks' linear layers as torchao Float8Linear (tensorwise scaling), before tensor parallelism
    shards them; routed experts stay as they are (torchao's float8 converts nn.Linear only)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    blocks = tuple(slot.module_name + "." for slot in graph.blocks)

    def chosen(sub: nn.Module, name: str) -> bool:
        return (isinstance(sub, nn.Linear) and name.startswith(blocks)
                and sub.in_features % FP8_GEMM_MULTIPLE == 0 and sub.out_features % FP8_GEMM_MULTIPLE == 0)
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=chosen)


def fp8_parallel_styles():
    """torchao's tensor-parallel styles for Float8Linear (the plain ones would shard them as bf16)."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    return Float8ColwiseParallel, Float8RowwiseParallel


def fsdp_policy(precision: str, layout: Layout) -> MixedPrecisionPolicy | None:
    if precision not in MIXED:
        return None
    reduce = torch.bfloat16 if layout.grad_reduce == GradReduce.bf16 else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def autocast(precision: str, device_type: str, cast_by_fsdp: bool):
    """The context the forward runs in: autocast to bf16 where FSDP2's policy does not cast."""
    if precision in MIXED and not cast_by_fsdp:
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
