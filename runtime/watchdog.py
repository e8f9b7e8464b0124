"""A stopped or dead rank turns into a named failure instead of a hang.

Collectives get the launch's timeout (`init_process_group(timeout=...)`, torch's default is 30 minutes);
each rank records the step it has reached in the job's c10d store. When a collective fails or times out,
the ranks that are still alive read the store and name the ranks that never reached the failing step:
those stopped or died. One line, starting with `health:`.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

PROGRESS = "planner/progress/{rank}"
STORE_READ = timedelta(seconds=2)   # reading a dead peer's progress may not wait for the peer


class Watchdog:
    """Step progress of every rank in the default group's store."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()

    def reached(self, step: int) -> None:
        self.store.set(PROGRESS.format(rank=self.rank), str(step))

    def behind(self, step: int) -> list[int]:
        """Ranks whose last recorded step is before `step` (or that recorded none)."""
        self.store.set_timeout(STORE_READ)
        late = []
        for rank in range(self.world):
            key = PROGRESS.format(rank=rank)
            try:
                done = int(self.store.get(key)) if self.store.check([key]) else 0
            except RuntimeError:   # the store itself went with the dead rank
                done = 0
            if done < step:
                late.append(rank)
        return late

    def report(self, step: int, error: BaseException) -> str:
        late = [r for r in self.behind(step) if r != self.rank]
        who = f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}" if late else "no rank"
        cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return (f"health: rank {self.rank}: a collective of step {step} failed within the {self.timeout_s:g} s "
                f"collective timeout; {who} did not reach step {step} (stopped or dead): {cause}")
