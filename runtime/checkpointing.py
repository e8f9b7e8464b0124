"""When and how a job checkpoints into a directory: every N steps, or at the interval the goodput model
finds best (Daly's, from the cluster's mean time between failures and the blocking time this job
measures); synchronously, or with `dcp.async_save` on a gloo group of its own (so its background writes
never interleave with training's collectives). A checkpoint becomes `latest` only once every rank finished
writing it and its manifest of checksums is written (runtime/verified.py), and none is written while the
data-parallel replicas disagree (runtime/health.py): a restart or a rollback loads the newest checkpoint that
verifies, and a save that fails stops training (CheckpointFailed) instead of going on past it.

What is saved is any state with `save(path, step, asynchronous, process_group, writer)`, `load(path) -> step` and
`params`: the driver's `ParallelModel`, or a user loop's `runtime.checkpoint.LoopState` (its laid-out model,
optimizer, LR scheduler and data loader):

    checkpointer = Checkpointer("ckpt", Cadence(100))
    start = (checkpointer.restore(state) or 0) + 1
    for step in range(start, last + 1):
        ...
        checkpointer.maybe_save(step, state, step_s)
    checkpointer.finish()
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from cost_models.reliability import daly_interval_s

from . import checkpoint, verified

LATEST = checkpoint.LATEST
SAVE_ERRORS = (Exception, CheckpointException)   # DCP's is a BaseException


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
    identity: object             # runtime.verified.Identity of the state saved
    writer: verified.HashingWriter   # what this rank wrote, hashed as written


class Checkpointer:
    def __init__(self, directory: str, cadence: Cadence = Cadence(0), asynchronous: bool = False, health=None):
        """`health`: a `runtime.health.HealthMonitor` whose replica check guards every save (None: unguarded)."""
        self.directory, self.cadence, self.asynchronous, self.health = Path(directory), cadence, asynchronous, health
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        # where the ranks agree that an asynchronous write has ended everywhere (not `group`: the write's own
        # collectives run on it from DCP's thread)
        self.poll_group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending: _Pending | None = None
        self.next_step: int | None = None    # Daly: when the next save is due
        self.rank = dist.get_rank()
        self.restored: Path | None = None    # the checkpoint the last restore loaded
        # the file system each save writes through (runtime/faults.py puts a failing one here)
        self.file_system_for: Callable[[int], verified.HashingFileSystem] = lambda step: verified.HashingFileSystem()

    # -- the directory ---------------------------------------------------------------------------
    def latest(self) -> Path | None:
        return checkpoint.latest(str(self.directory))

    def restore(self, state) -> int | None:
        """Load the newest checkpoint that verifies (runtime/verified.py) into `state`, after finishing one still
        being written; its step, or None when the directory holds none. Each refused one is said in a line;
        a directory of checkpoints none of which can be resumed raises CheckpointRefused."""
        self.finish()
        self.restored = None
        if not self.directory.is_dir():
            return None
        name = checkpoint.latest_name(self.directory)
        if name is None and (self.directory / LATEST).exists():
            self._say(f"health: {self.directory / LATEST} names no checkpoint of {self.directory}; the newest "
                      "that verifies is used")
        target = verified.newest_usable(self.directory, name, state.identity(), self._say)
        if target is None:
            return None
        self.restored = target
        return state.load(str(target))

    # -- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if self.cadence.every_steps is not None:
            return self.cadence.every_steps > 0 and step % self.cadence.every_steps == 0
        return self.next_step is None or step >= self.next_step   # Daly: the first save measures the blocking

    def maybe_save(self, step: int, state, step_s: float = 0.0) -> float:
        """Save `state` after `step` if due; the seconds training was blocked by it (0 when nothing was due).
        `step_s`, the step's measured time, sets Daly's interval in steps."""
        if not self.due(step):
            return 0.0
        if self.health and not self.health.clean_for_saving(step, state.params):
            self.health.say(f"health: step {step}: no checkpoint written while replicas disagree; "
                            f"the last clean one stays latest")
            return 0.0
        blocking = self._save(step, state)
        if self.cadence.every_steps is None:
            self._schedule(step, step_s, blocking)
        return blocking

    def _save(self, step: int, state) -> float:
        """Write `step`; returns the seconds training waited for it (the previous async write included). A save
        that fails on any rank raises CheckpointFailed on every rank: training never goes on past it."""
        started = time.perf_counter()
        self.finish()
        target = self.directory / f"step-{step:06d}"
        if self.rank == 0:   # a step written again (after a rollback) is unverified until its new manifest
            with contextlib.suppress(OSError):   # a path that cannot hold one fails the save itself, collectively
                (target / verified.MANIFEST).unlink(missing_ok=True)
        writer = verified.HashingWriter(target, self.file_system_for(step))
        try:
            if self.asynchronous:
                future = state.save(str(target), step, asynchronous=True, process_group=self.group, writer=writer)
                self.pending = _Pending(target, step, future, time.perf_counter(), state.identity(), writer)
            else:
                state.save(str(target), step, writer=writer)
        except SAVE_ERRORS as exc:   # DCP gathers every rank's failure into one CheckpointException
            raise _failed(target, step, exc) from None
        if not self.asynchronous:
            self._mark_latest(target, step, state.identity(), writer)
        return time.perf_counter() - started

    def poll(self) -> None:
        """Where an asynchronous write has ended on every rank, make it latest now (a failure is CheckpointFailed
        at the first step after it is known, not at the next save). The ranks agree first (one small gloo
        all-reduce per step while a write is in flight): one rank going on to train while another stops at
        the failure would leave the first waiting in the step's collective."""
        if self.pending is None:
            return
        ended = torch.tensor([float(self.pending.future.done())])
        dist.all_reduce(ended, op=dist.ReduceOp.MIN, group=self.poll_group)
        if ended.item():
            self.finish()

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
        """Wait for a write still in flight and make it `latest` once every rank has finished and verified it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except SAVE_ERRORS as exc:
            raise _failed(pending.target, pending.step, exc) from None
        self._mark_latest(pending.target, pending.step, pending.identity, pending.writer)

    def _mark_latest(self, target: Path, step: int, identity, writer: verified.HashingWriter) -> None:
        """The manifest of what every rank wrote, then `latest`: a checkpoint is never latest unverified."""
        checks = self.health.verdict(step) if self.health else {}
        verified.write_manifest(target, step, identity, writer.written(), checks)
        dist.barrier()
        if self.rank == 0:
            marker = self.directory / f".{LATEST}.tmp"
            marker.write_text(target.name)
            os.replace(marker, self.directory / LATEST)
        dist.barrier()

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, file=sys.stderr, flush=True)


def _failed(target: Path, step: int, exc: BaseException) -> verified.CheckpointFailed:
    rank, error = _first_failure(exc)
    return verified.CheckpointFailed(f"checkpoint {target.name} failed: rank {rank}: {type(error).__name__}: "
                                     f"{error}", error, step)


def _first_failure(exc: BaseException) -> tuple[int, BaseException]:
    """The first failing rank and its own error, from DCP's CheckpointException (or this rank and the error)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (error, _) = sorted(failures.items())[0]
        return rank, error
    return dist.get_rank(), exc
