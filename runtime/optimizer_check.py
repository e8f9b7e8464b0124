"""Silent data corruption in a sharded optimizer's update, checked by another rank.

Under ZeRO-1/2/3 each data-parallel rank alone computes the update of the shard it owns, and what it computes is
what every replica receives (ZeRO-1's broadcast) or what the shard becomes (ZeRO-2/3): the replicas agree, so
the replica fingerprint can never see a wrong update. Every `every` steps each rank records a sample of the
elements it owns around its optimizer step (parameter, gradient and per-element state before, parameter and
state after; `samples` elements of each tensor, all of them where it has fewer or `samples` is 0), the ranks
of the data-parallel group exchange the samples (one all-gather of small objects), and each recomputes its
neighbour's with a fresh optimizer of the same class and settings on the CPU. A parameter that differs from the
recomputed one by more than `ULPS` units in its last place names the owner.

What it sees: a wrong element in the sample. A corruption of q of a tensor's n elements is caught at a check
with probability 1 - (1 - q)^s for s = min(samples, n) sampled (all of them at `samples` 0); a single wrong
element of a tensor of n with s / n. Its cost is the exchange of 7 s values per tensor and one small optimizer
step per parameter group; on ZeRO-0 (every rank computes the whole update) the replica fingerprint is the check.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from .dims import local_shard

ULPS = 8   # units in the last place a recomputed parameter may differ by (foreach and fused kernels round apart)


@dataclass(frozen=True)
class OptimizerFault:
    """An injected fault (runtime/faults.py `optsdc`): after this rank's own update at `step`, before ZeRO-1's
    broadcast, one owned element comes out wrong by `relative_error` of itself."""
    step: int
    relative_error: float = 1.0


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer this rank runs over what it owns (ZeroRedundancyOptimizer's inner one)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


class OptimizerCheck:
    def __init__(self, optimizer, group, every: int = 1, samples: int = 16):
        self.optimizer, self.group, self.every, self.samples = optimizer, group, every, samples
        self.fault: OptimizerFault | None = None
        self.forced_step: int | None = None   # checked whatever the cadence: the step before a save
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def limit(self) -> str:
        """What passes unseen, said once as a note: an error within ULPS units in the last place of an element,
        and any element outside the sample."""
        local = local_optimizer(self.optimizer)
        dtypes = {local_shard(param).dtype for group in local.param_groups for param in group["params"]}
        coarsest = max(dtypes, key=lambda dtype: torch.finfo(dtype).eps) if dtypes else torch.float32
        sampled = f"{self.samples} elements of each owned tensor (one wrong element of a tensor of n is seen " \
            f"with {self.samples}/n a check)" if self.samples else "every owned element"
        return (f"optimizer updates checked every {self.every} steps by the next data-parallel rank, {sampled}: "
                f"an error under {ULPS * torch.finfo(coarsest).eps:.2g} of an element ({ULPS} units in the last "
                f"place, {str(coarsest).removeprefix('torch.')}) passes unseen")

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.forced_step) and self.size > 1

    def owned(self) -> list[tuple[int, torch.nn.Parameter]]:
        local = local_optimizer(self.optimizer)
        return [(index, param) for index, group in enumerate(local.param_groups) for param in group["params"]
                if param.grad is not None and local_shard(param).numel()]

    def _indices(self, step: int, numel: int) -> torch.Tensor:
        if not self.samples or numel <= self.samples:
            return torch.arange(numel)
        generator = torch.Generator().manual_seed(step * 1_000_003 + self.rank)
        return torch.randint(numel, (self.samples,), generator=generator)   # O(samples), repeats harmless

    def _take(self, param, indices) -> dict[str, torch.Tensor]:
        """The sampled elements of a parameter, its gradient and its per-element state, on the CPU."""
        taken = {"param": local_shard(param.detach()).reshape(-1)[indices].cpu().clone()}
        if param.grad is not None:
            taken["grad"] = local_shard(param.grad).reshape(-1)[indices].cpu().clone()
        for key, value in local_optimizer(self.optimizer).state.get(param, {}).items():
            value = local_shard(value)
            if torch.is_tensor(value) and value.numel() == local_shard(param).numel():
                taken[key] = value.reshape(-1)[indices].cpu().clone()
            elif torch.is_tensor(value):
                taken[key] = value.detach().cpu().clone()   # a per-tensor scalar (AdamW's step)
        return taken

    @contextlib.contextmanager
    def around(self, step: int):
        """Around the optimizer step: an injected fault applied, and on a checked step the sample recorded and
        verified; yields a list the verdict (the owner ranks named, or empty) is put in."""
        verdict: list[int] = []
        due = self.due(step)
        owned = self.owned() if due else []
        indices = [self._indices(step, local_shard(param).numel()) for _, param in owned]
        before = [self._take(param, index) for (_, param), index in zip(owned, indices)]
        with self._faulty(step):
            yield verdict
        if due:
            after = [self._take(param, index) for (_, param), index in zip(owned, indices)]
            verdict.extend(self._verify(owned, before, after))

    @contextlib.contextmanager
    def _faulty(self, step: int):
        """The injected fault: the local optimizer's step wrapped, so that ZeRO-1 broadcasts the wrong value."""
        if self.fault is None or self.fault.step != step:
            yield
            return
        local = local_optimizer(self.optimizer)
        original = local.step

        def wrong_step(*args, **kwargs):
            result = original(*args, **kwargs)
            param = local_shard(self.owned()[0][1].detach()).reshape(-1)
            with torch.no_grad():
                param[param.numel() // 2] *= 1 + self.fault.relative_error
            return result
        local.step = wrong_step
        try:
            yield
        finally:
            local.step = original

    def _verify(self, owned, before, after) -> list[int]:
        """Exchange the samples (one all-gather of small objects), recompute the neighbour's: the neighbour's
        global rank where its update was wrong, else nothing (`HealthMonitor.updates_right` makes it the job's)."""
        local = local_optimizer(self.optimizer)
        mine = _batched([index for index, _ in owned], before, after, local.param_groups)
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        owner = (self.rank + 1) % self.size
        if all(_recomputes(type(local), *batch) for batch in everyone[owner]):
            return []
        return [dist.get_global_rank(self.group, owner)]


def _batched(groups: list[int], before: list[dict], after: list[dict], param_groups) -> list[tuple]:
    """The samples of the tensors of one parameter group that share their per-tensor state (AdamW's step),
    concatenated: one recomputation each. (settings, before, after) per batch."""
    batches: dict[tuple, tuple[list, list]] = {}
    for group, taken, result in zip(groups, before, after):
        scalars = tuple(sorted((key, float(value)) for key, value in taken.items() if value.dim() == 0))
        batches.setdefault((group, scalars), ([], []))[0].append(taken)
        batches[(group, scalars)][1].append(result)
    joined = []
    for (group, _), (takes, results) in batches.items():
        settings = {key: value for key, value in param_groups[group].items() if key != "params"}
        joined.append((settings, _joined(takes), _joined(results)))
    return joined


def _joined(parts: list[dict]) -> dict:
    """One array per key, numpy (pickled for the exchange in microseconds, where a tensor takes milliseconds;
    bf16, which numpy lacks, as its 16-bit words), with each key's dtype."""
    joined = {}
    for key in parts[0]:
        value = parts[0][key] if parts[0][key].dim() == 0 else torch.cat([part[key] for part in parts])
        words = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
        joined[key] = (words.numpy(), str(value.dtype).removeprefix("torch."))
    return joined


def _tensor(entry) -> torch.Tensor:
    array, dtype = entry
    value = torch.from_numpy(array.copy())
    return value.view(torch.bfloat16) if dtype == "bfloat16" else value


def _recomputes(optimizer_class, settings: dict, before: dict, after: dict) -> bool:
    """Whether a fresh optimizer of the class, from `before`, gives `after`'s parameter within ULPS."""
    before = {key: _tensor(entry) for key, entry in before.items()}
    param = torch.nn.Parameter(before["param"].clone())
    param.grad = before["grad"].clone()
    optimizer = optimizer_class([param], lr=float(settings.get("lr", 1e-3)))
    group = optimizer.param_groups[0]
    for key, value in settings.items():
        if key in group and key not in ("foreach", "fused", "capturable", "differentiable"):
            group[key] = value
    group["foreach"], group["fused"] = False, None
    state = {key: value.clone() for key, value in before.items() if key not in ("param", "grad")}
    if state:
        optimizer.state[param] = state
    optimizer.step()
    expected, got = param.detach(), _tensor(after["param"])
    allowed = ULPS * torch.finfo(got.dtype).eps * torch.maximum(expected.abs(), got.abs()).clamp(
        min=torch.finfo(got.dtype).tiny)
    return bool(((expected - got).abs() <= allowed).all())
