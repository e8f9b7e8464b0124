"""When and how a job checkpoints into a directory: every N steps, or at the interval the goodput model
finds best (Daly's, from the cluster's mean time between failures and the blocking time this job
measures); synchronously, or with `dcp.async_save` on a gloo group of its own (so its background writes
never interleave with training's collectives). A checkpoint becomes `latest` only once every rank finished
writing it, and none is written while the data-parallel replicas disagree (runtime/health.py): a restart or
a rollback always finds a complete, clean one.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from cost_models.reliability import daly_interval_s

from . import checkpoint

LATEST = checkpoint.LATEST


@dataclass(frozen=True)
class Cadence:
    every_steps: int | None      # a fixed interval; None: Daly's, from the mean time between failures
    mtbf_s: float = math.inf     # the job's (cost_models.reliability.job_mtbf_s), for Daly's interval


@dataclass
class _Pending:
    target: Path
    step: int
    future: object               # dcp.async_save's
    started: float


class Checkpointer:
    def __init__(self, parallel, directory: str, cadence: Cadence, asynchronous: bool = False):
        self.parallel, self.directory, self.cadence = parallel, Path(directory), cadence
        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending: _Pending | None = None
        self.next_step: int | None = None    # Daly: when the next save is due
        self.rank = dist.get_rank()

    # -- the directory ---------------------------------------------------------------------------
    def latest(self) -> Path | None:
        return checkpoint.latest(str(self.directory))

    def restore(self) -> int | None:
        """Load the last complete checkpoint (after finishing one still being written); its step, or None."""
        self.finish()
        latest = self.latest()
        return None if latest is None else self.parallel.load(str(latest)).step

    # -- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if self.cadence.every_steps is not None:
            return self.cadence.every_steps > 0 and step % self.cadence.every_steps == 0
        return self.next_step is None or step >= self.next_step   # Daly: the first save measures the blocking

    def after_step(self, step: int, step_s: float) -> float:
        """Save if due; the seconds training was blocked by it (0 when nothing was due)."""
        if not self.due(step):
            return 0.0
        health = self.parallel.health
        if health and not health.clean_for_saving(step, self.parallel.params):
            health.say(f"health: step {step}: no checkpoint written while replicas disagree; "
                       f"the last clean one stays latest")
            return 0.0
        blocking = self._save(step)
        if self.cadence.every_steps is None:
            self._schedule(step, step_s, blocking)
        return blocking

    def _save(self, step: int) -> float:
        """Write `step`; returns the seconds training waited for it (the previous async write included)."""
        started = time.perf_counter()
        self.finish()
        target = self.directory / f"step-{step:06d}"
        if self.asynchronous:
            future = self.parallel.save(str(target), step, asynchronous=True, process_group=self.group)
            self.pending = _Pending(target, step, future, time.perf_counter())
        else:
            self.parallel.save(str(target), step)
            self._mark_latest(target)
        return time.perf_counter() - started

    def _schedule(self, step: int, step_s: float, blocking_s: float) -> None:
        """Daly's interval for the blocking just measured, in whole steps of the time just measured."""
        interval_s = daly_interval_s(blocking_s, self.cadence.mtbf_s)
        steps = math.inf if math.isinf(interval_s) else max(1, round(interval_s / max(step_s, 1e-9)))
        self.next_step = math.inf if math.isinf(steps) else step + steps
        if self.rank == 0:
            every = "no further saves (no failures expected)" if math.isinf(steps) else f"next every {steps} steps"
            print(f"checkpoint: step {step} blocked {blocking_s:.4f} s; {every} (Daly: MTBF "
                  f"{self.cadence.mtbf_s:g} s, step {step_s:.4f} s, interval {interval_s:.3f} s)",
                  file=sys.stderr, flush=True)

    def finish(self) -> None:
        """Wait for a write still in flight and make it `latest` once every rank has finished it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.future.result()
        self._mark_latest(pending.target)

    def _mark_latest(self, target: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            marker = self.directory / f".{LATEST}.tmp"
            marker.write_text(target.name)
            os.replace(marker, self.directory / LATEST)
        dist.barrier()
