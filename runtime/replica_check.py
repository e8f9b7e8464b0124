"""Silent data corruption in memory: the data-parallel replicas' parameters compared by a bit-exact fingerprint.

Where parameters are replicated over the data-parallel ranks (ZeRO-0/1), every replica holds the same bytes
after the optimizer step; a rank whose fingerprint (its parameters' bytes summed as 64-bit integers) differs
from the majority's is named. One all-gather of one int64 per rank over the replica group; the straggler
comparison (runtime/stragglers.py), due on the same step over the same group, rides it (its seconds as their
float64's bits), so that the step pays one all-gather and one wait for the slowest replica, not two.

Deferred (the training step's periodic check): the all-gather is started after the step and its verdict read
after the next step's loss all-reduce, when every rank has met anyway: the wait for the slowest replica and,
on an accelerator, the host's read of the result (which would stop it queueing the next step's kernels) cost
nothing there. The line names the step the parameters were fingerprinted after. A check before a checkpoint
is answered at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dims import local_shard
from .stragglers import StragglerMonitor

INTEGER_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                torch.float64: torch.int64}


def fingerprint(parameters: list[torch.Tensor]) -> int:
    """Bit-exact: the sum, modulo 2^64, of the parameters' bytes read as 64-bit integers (32-bit where a
    dtype's bytes do not fill whole words); a flipped bit k changes it by 2^k. The parameters of a dtype are
    concatenated first: one sum over the copy costs less than a sum per tensor (2.6x on the tiny model's 39)."""
    total = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in parameters:
        local = local_shard(param.detach())
        by_dtype.setdefault(local.dtype, []).append(local.reshape(-1))
    for flat in (torch.cat(views) for views in by_dtype.values()):
        words = flat.view(torch.int64) if flat.numel() * flat.element_size() % 8 == 0 \
            else flat.view(INTEGER_VIEW[flat.dtype])
        total += int(words.sum(dtype=torch.int64))
    return (total + 2 ** 63) % 2 ** 64 - 2 ** 63   # as a signed 64-bit integer, the type it is gathered in


@dataclass
class Exchange:
    """One started all-gather of every replica's [fingerprint, straggler seconds' bits?]."""
    step: int
    work: object
    gathered: list[torch.Tensor]
    stragglers: StragglerMonitor | None


class ReplicaCheck:
    def __init__(self, group, device: torch.device, report):
        self.group, self.device, self.report = group, device, report
        self.checked: tuple[int, bool] | None = None   # the last verdict: its step and whether replicas agree
        self.pending: Exchange | None = None           # a deferred check not yet read

    def check(self, step: int, parameters: list[torch.Tensor], stragglers: StragglerMonitor | None,
              deferred: bool) -> bool | None:
        """Whether the replicas agree after `step`'s update (None: deferred, read by `settle`)."""
        self.settle()
        if self.checked and self.checked[0] == step:   # checked after this step's update already
            return self.checked[1]
        riding = stragglers if stragglers is not None and stragglers.due(step) and stragglers.peers is self.group \
            else None
        exchange = self._start(step, parameters, riding)
        if deferred:
            self.pending = exchange
            return None
        return self._judge(exchange)

    def settle(self) -> None:
        """The deferred check's verdict: its all-gather waited for, its lines said (every rank calls it at the
        same point of the same step)."""
        if self.pending is not None:
            exchange, self.pending = self.pending, None
            self._judge(exchange)

    def _start(self, step: int, parameters: list[torch.Tensor], stragglers: StragglerMonitor | None) -> Exchange:
        values = [torch.tensor(fingerprint(parameters), dtype=torch.int64)]
        if stragglers is not None:   # the compute seconds as their float64's bits: one int64 tensor carries both
            values.append(torch.tensor(stragglers.stop_timing(step), dtype=torch.float64).view(torch.int64))
        mine = torch.stack(values).to(self.device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        return Exchange(step, work, gathered, stragglers)

    def _judge(self, exchange: Exchange) -> bool:
        exchange.work.wait()
        rows = torch.stack(exchange.gathered).cpu()
        if exchange.stragglers is not None:
            exchange.stragglers.judge(exchange.step, rows[:, 1].view(torch.float64).tolist())
        agree = self._agree(exchange.step, rows[:, 0].tolist())
        self.checked = (exchange.step, agree)
        return agree

    def _agree(self, step: int, values: list[int]) -> bool:
        if len(set(values)) == 1:
            return True
        ranks = dist.get_process_group_ranks(self.group)
        common = max(set(values), key=values.count)
        if values.count(common) * 2 > len(values):   # a majority agrees: the others are the corrupt ones
            odd = [rank for rank, value in zip(ranks, values) if value != common]
            line = (f"health: step {step}: parameters of rank{'s' if len(odd) > 1 else ''} "
                    f"{', '.join(map(str, odd))} differ from their data-parallel replicas (silent data "
                    f"corruption); ranks {', '.join(map(str, ranks))} compared")
        else:
            line = (f"health: step {step}: the data-parallel replicas on ranks {', '.join(map(str, ranks))} "
                    "hold different parameters (silent data corruption); no majority tells which")
        self.report(line)   # every rank of the group says it: the odd one may be rank 0
        return False
