"""Silent data corruption in computation, caught on the rank that computed it: on a checked step every matrix
product of the forward and the backward is verified by its checksums (algorithm-based fault tolerance, Huang
and Abraham, IEEE Trans. Computers 1984), before any gradient reaches the optimizer.

For C = A B (A: m x k, B: k x n; batched, with a bias added or not) the column sums of C equal (1^T A) B in exact
arithmetic. As a device computes them they differ by rounding only: the products accumulate in fp32 (bf16 and
fp16 inputs too), column j by about u32 sqrt(k) s_j at most, with s_j = (1^T |A|) |B|_j the sum of the
magnitudes of the products that column adds up, and each element is then rounded to the result's dtype, by
u_out |c_ij|. The check takes both sides in float64 (the column sums of C as the device returned it, and
(1^T A) B from the same inputs) and allows `TOLERANCE` x (u32 sqrt(k) s_j + u_out sum_i |c_ij|); a column
beyond it marks the product as wrong. What the check costs is O(mk + kn + mn) beside the product's O(mkn).

What it sees: a wrong element of a GEMM's result (a defective core's multiply or accumulate), whatever the layout:
it runs below DTensor and FSDP2 as a TorchDispatchMode, on the local products each rank computes (tensor-parallel
shards, pipeline stages, FSDP2's unsharded weights). The smallest error it sees in one element is its column's
allowance: relative to the product's largest element about 1e-4 in fp32 on the tiny model (the run says its own at
the first check), and only errors of the element's own size in bf16, whose rounding (u_out = 2^-9) dominates. What
it does not see: FP8 products (torch._scaled_mm: scaled operands, their allowance not derived), fused attention
kernels (scaled_dot_product_attention's products stay inside the kernel), elementwise operations and reductions,
and communication (the replica fingerprint and the optimizer check cover what is replicated or sharded after it).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
ACCUMULATE_UNIT = 2.0 ** -24   # fp32's unit roundoff: GEMMs accumulate in fp32 (bf16/fp16 inputs too)
TOLERANCE = 2.0   # x the rounding allowance: clean steps reach 0.15 of it in bf16, 0.015 in fp32 (tiny model)


@dataclass(frozen=True)
class GemmFault:
    """An injected fault (runtime/faults.py `sdc`): the `index`-th matrix product of `phase` ("forward" or
    "backward") on this rank has its largest element multiplied by 1 + `relative_error`."""
    phase: str
    relative_error: float
    index: int = 1


@dataclass(frozen=True)
class GemmVerdict:
    """The worst product of a checked step on this rank: its checksum discrepancy over the tolerance (> 1: wrong)."""
    ratio: float
    shape: str          # "m x k x n" (batched: "b x m x k x n")
    dtype: str
    phase: str
    products: int       # products checked this step
    limit: float = 0.0  # the step's least sensitive product: errors below this share of its largest element pass

    @property
    def wrong(self) -> bool:
        return self.ratio > 1

    def describe(self) -> str:
        return (f"a {self.phase} product ({self.dtype}, {self.shape}) whose column sums are off by {self.ratio:.3g}x "
                f"the tolerance ({self.products} products checked)")


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _column_check(result: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias, beta,
                  alpha) -> tuple[torch.Tensor, torch.Tensor]:
    """max_j |colsum(C)_j - ref_j| / allowed_j (float64, a 0-d tensor: not read here, so that a device never
    waits on it), and each column's allowance (for the limit of detection)."""
    a, b, c = left.detach().double(), right.detach().double(), result.detach()
    reference = alpha * (a.sum(-2, keepdim=True) @ b)              # (1^T A) B, one row (per batch)
    magnitude = abs(alpha) * (a.abs().sum(-2, keepdim=True) @ b.abs())
    if bias is not None and beta != 0:
        full = torch.broadcast_to(bias.detach(), c.shape)
        reference = reference + beta * full.sum(-2, keepdim=True, dtype=torch.float64)
        magnitude = magnitude + abs(beta) * full.abs().sum(-2, keepdim=True, dtype=torch.float64)
    accumulated = ACCUMULATE_UNIT * math.sqrt(max(left.shape[-1], 1)) * magnitude
    rounded = (torch.finfo(result.dtype).eps / 2) * c.abs().sum(-2, keepdim=True, dtype=torch.float64)
    allowed = accumulated + rounded + torch.finfo(torch.float64).tiny   # the result stored in its dtype, above
    return ((c.sum(-2, keepdim=True, dtype=torch.float64) - reference).abs() / allowed).amax(), allowed


def _limit(result: torch.Tensor, allowed: torch.Tensor) -> float:
    """The smallest error, relative to the product's largest element, that its column's allowance lets pass."""
    n = result.shape[-1]
    flat = result.detach().abs().reshape(-1, result.shape[-2] * n)
    batch, index = divmod(int(flat.argmax()), result.shape[-2] * n)
    largest = float(flat[batch, index])
    return float(allowed.reshape(-1, n)[batch, index % n]) / largest if largest else math.inf


def _operands(func, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float, float]:
    """(A, B, bias, beta, alpha) of mm/bmm (no bias) or addmm/baddbmm(bias, A, B, beta=, alpha=)."""
    if func in (aten.mm.default, aten.bmm.default):
        return args[0], args[1], None, 0.0, 1.0
    return args[1], args[2], args[0], 1.0, 1.0


class GemmCheck(TorchDispatchMode):
    """Checks (and, with a `GemmFault`, first corrupts) the matrix products run while it is entered. Each
    product's discrepancy stays a device tensor until the step's verdict reads them all at once."""

    def __init__(self, tolerance: float = TOLERANCE, check: bool = True):
        """`check` False: only a fault is applied (a step not due for checking still meets its fault)."""
        super().__init__()
        self.tolerance, self.check = tolerance, check
        self.fault: GemmFault | None = None
        self.with_limit = False        # measure the limit of detection too (costs a read per product)
        self._reset()

    def _reset(self) -> None:
        self.ratios: list[torch.Tensor] = []
        self.described: list[tuple[str, str, str]] = []   # (shape, dtype, phase) of each product checked
        self.limit = 0.0
        self.counts = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented   # DTensor's own dispatch runs the local product, which comes back through here
        result = func(*args, **kwargs)
        if func in GEMMS and not isinstance(result, FakeTensor) and result.numel() and result.is_floating_point():
            self._check(func, args, kwargs, result)
        return result

    def _check(self, func, args, kwargs, result: torch.Tensor) -> None:
        phase = _phase()
        self.counts[phase] += 1
        if self.fault and self.fault.phase == phase and self.fault.index == self.counts[phase]:
            _corrupt(result, self.fault.relative_error)
        if not self.check:
            return
        left, right, bias, beta, alpha = _operands(func, args)
        beta, alpha = float(kwargs.get("beta", beta)), float(kwargs.get("alpha", alpha))
        ratio, allowed = _column_check(result, left, right, bias, beta, alpha)
        self.ratios.append(ratio)
        dims = [*left.shape[:-1], right.shape[-2], right.shape[-1]]
        self.described.append((" x ".join(map(str, dims)), str(result.dtype).removeprefix("torch."), phase))
        if self.with_limit:
            self.limit = max(self.limit, _limit(result, allowed) * self.tolerance)

    def verdict(self) -> GemmVerdict | None:
        """The step's worst product (ratio > 1: wrong), with the number of products checked: one read."""
        if not self.ratios:
            return None
        ratios = torch.stack(self.ratios).cpu()
        worst = int(ratios.argmax())
        shape, dtype, phase = self.described[worst]
        return GemmVerdict(float(ratios[worst]) / self.tolerance, shape, dtype, phase, len(self.ratios), self.limit)

    @contextlib.contextmanager
    def watching(self, fault: GemmFault | None = None, on_verdict=None, with_limit: bool = False):
        """Check the products run inside (forward and backward alike: autograd runs the backward's under the
        mode that was active when it was called), `fault` applied first; `on_verdict(verdict())` at the end."""
        self._reset()
        self.fault, self.with_limit = fault, with_limit
        try:
            with self:
                yield self
        finally:
            self.fault = None
            if on_verdict is not None:
                on_verdict(self.verdict())


@torch.no_grad()
def _corrupt(result: torch.Tensor, relative_error: float) -> None:
    """One element, the largest in magnitude, made wrong by `relative_error` of itself (a flipped low exponent
    bit doubles it: 1.0)."""
    flat = result.view(-1)
    index = int(flat.abs().argmax())
    flat[index] = flat[index] * (1 + relative_error)
