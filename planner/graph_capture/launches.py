"""The kernels a graph node launches when it runs eagerly, counted on meta tensors as capture runs it.

A host issues a model's forward one kernel at a time; what it spends is set by how many it issues
(cost_models/host_time.py). Counted at the aten level, where every op that is not a view, an allocation or
a metadata read is a kernel on a GPU. GEMMs are counted apart (a stack weighs a GEMM module's call on its
own), and so are the kernels inside a routed expert module run in a loop, which a rank issues only for its
own experts. The fused kernels capture stands in (flash attention, a fused norm or activation) are one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .graph_analysis import while_running

_aten = torch.ops.aten
# ops that allocate, alias or read metadata: no kernel
NOT_KERNELS = frozenset({_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided, _aten.new_empty_strided,
                         _aten._local_scalar_dense, _aten.lift_fresh, _aten.sym_size, _aten.sym_stride,
                         _aten.sym_numel, _aten.sym_storage_offset, _aten.is_same_size, _aten._unsafe_view})
GEMM_OPS = frozenset({_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._grouped_mm, _aten._scaled_mm,
                      _aten._scaled_grouped_mm})


@dataclass
class Launches:
    """Kernels a node launched beside its GEMMs: outside routed expert modules, and inside them (all experts)."""
    other: int = 0
    in_experts: int = 0


class LaunchCounter(TorchDispatchMode):
    """Counts the kernels launched while it is active, and which of them ran inside a routed expert module."""

    def __init__(self):
        super().__init__()
        self.counted = Launches()
        self.expert_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if not func.is_view and packet not in NOT_KERNELS and packet not in GEMM_OPS:
            if self.expert_depth:
                self.counted.in_experts += 1
            else:
                self.counted.other += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def inside(self, expert_modules: nn.ModuleList | None):
        """While an expert container runs: kernels its routed expert modules launch are counted apart."""
        if expert_modules is None:
            yield
            return

        def enter(*_):
            self.expert_depth += 1

        def leave(*_):
            self.expert_depth -= 1

        with while_running([(expert, enter) for expert in expert_modules], leave):
            yield
