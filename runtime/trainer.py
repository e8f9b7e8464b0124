"""The Trainer: a `ParallelModel` trained from its first step to its last with what keeps a job up: the in-step
health checks (the model's `HealthPolicy`), checkpoints into a directory at a fixed or Daly's cadence,
synchronously or asynchronously (`runtime/checkpointing.py`), resume after a restart, rollback on a loss
spike, the watchdog that names a lost peer (`runtime/watchdog.py`), telemetry (`runtime/telemetry.py`) and
injected faults (`runtime/faults.py`). Each part is usable on its own from a user's own loop
(`HealthMonitor.check`, `Checkpointer.maybe_save`/`restore` with a `LoopState`, `Watchdog.reached`/`fail`);
the Trainer is them composed, as the driver (`python -m runtime.train`, `planner-train`) runs them:

    parallel = apply_plan(model, graph, plan, optimizer="adamw", lr=3e-4)
    config = TrainerConfig(steps=1000, checkpoint_dir="ckpt", cadence=Cadence(None, mtbf_s=6 * 3600))
    Trainer(parallel, batches, config).fit()      # batches(step) -> (tokens, targets), the global batch

A job that checkpoints into a directory trains steps 1..`steps` as a whole, across its restarts: started
again (by torchrun after a failure), it resumes after the directory's last complete checkpoint.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import faults
from .checkpointing import Cadence, Checkpointer
from .verified import CheckpointFailed, CheckpointRefused, HashingWriter, problem_of, write_manifest
from .exclusion import Exclude, exclude
from .health import HealthStop, Rollback
from .telemetry import TelemetryHeader, TelemetryWriter
from .watchdog import Watchdog, is_collective_failure

STOPPED = 4   # the exit status of a job the health policy stopped
CHECKPOINT_ERROR = 5   # a save that failed, or a checkpoint that cannot be resumed: said in one line


@dataclass(frozen=True)
class TrainerConfig:
    steps: int                                 # steps to train (with checkpoint_dir: steps 1..steps, restarts included)
    last_step: int | None = None               # train up to this step instead
    checkpoint_dir: str | None = None          # saves at `cadence`; a start resumes after its last complete one
    cadence: Cadence = Cadence(0)              # every N steps (0: never), or Daly's from the job's MTBF
    async_save: bool = False                   # dcp.async_save on a gloo group of its own
    rollback_skip: int = 1                     # batches a rollback skips, ending at the spike's
    skip_steps: frozenset[int] = frozenset()   # batches not trained at all
    save_at: int | None = None                 # a one-off checkpoint after this step...
    save_to: str | None = None                 # ...into this directory
    resume_from: str | None = None             # a checkpoint to continue after (under any layout)
    drop_optimizer_state: bool = False         # with resume_from: as a model-only checkpoint would
    injection: faults.Injection | None = None  # a fault the checks must name (runtime/faults.py)
    telemetry_dir: str | None = None           # each rank's rank-R.jsonl: measured parts beside predicted ones
    telemetry_comm_every: int = 10             # steps per exposed-communication measurement (0: never)
    log_prefix: str = ""                       # before each `step K loss X` line (a case of a multi-case launch)


class Trainer:
    def __init__(self, parallel, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], config: TrainerConfig,
                 watchdog: Watchdog | None = None, telemetry_header: TelemetryHeader | None = None):
        """`parallel`: a `runtime.ParallelModel`; `batches(step)`: that step's global batch (tokens, targets),
        the same on every rank; `watchdog`: names a lost peer when a step's collective fails (None: the error
        propagates)."""
        self.parallel, self.batches, self.config, self.watchdog = parallel, batches, config, watchdog
        parallel.deferred_checks = True   # settled after the last step (_run)
        self.rank = dist.get_rank()
        self.skip_steps = set(config.skip_steps)
        self.losses: dict[int, float] = {}   # each trained step's loss (a step trained again after a rollback: its last)
        if parallel.health and parallel.health.policy.on_spike == "rollback" and not (
                config.checkpoint_dir and config.cadence.every_steps != 0):
            raise ValueError("a rollback on spikes (--on-spike rollback) needs checkpoints to roll back to: a "
                             "checkpoint directory and a cadence that saves (--checkpoint-dir, --save-every)")
        self.checkpointer = Checkpointer(config.checkpoint_dir, config.cadence, config.async_save,
                                         parallel.health) if config.checkpoint_dir else None
        self.telemetry = TelemetryWriter(config.telemetry_dir, self.rank, telemetry_header or TelemetryHeader(
            "", "", "", dist.get_world_size(), "", None, {})) if config.telemetry_dir else None
        if self.telemetry and config.telemetry_comm_every > 0:
            parallel.record_communication(config.telemetry_comm_every)
        faults.install(config.injection, parallel, self.rank)
        if self.checkpointer:
            faults.install_on_saves(config.injection, self.checkpointer, self.rank)

    def first_step(self) -> int:
        """After the directory's last complete checkpoint (as after a torchrun restart), or after
        `resume_from`, else 1."""
        start = 1
        restored = self.checkpointer.restore(self.parallel) if self.checkpointer else None
        if restored is not None:
            start = restored + 1
            self._say(f"resumed from {self.checkpointer.restored.name} "
                      f"(restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")
        if self.config.resume_from:
            problem = problem_of(Path(self.config.resume_from), self.parallel.identity(),
                                 with_optimizer=not self.config.drop_optimizer_state)
            if problem:
                raise CheckpointRefused(f"--resume {self.config.resume_from}: {problem}")
            start = self.parallel.load(self.config.resume_from) + 1
            if self.config.drop_optimizer_state:
                self.parallel.forget_optimizer_state()
        return start

    def fit(self) -> int:
        """Train to the last step; 0, `STOPPED` where the health policy stopped the job, or `CHECKPOINT_ERROR`
        where a save failed or no checkpoint can be resumed (on every rank; rank 0 says why in one line)."""
        config = self.config
        try:
            first = self.first_step()
            last = config.last_step if config.last_step is not None else (
                config.steps if config.checkpoint_dir else first + config.steps - 1)
            try:
                faults.check_reached(config.injection, last, dist.get_world_size(),
                                     saving=self.checkpointer is not None)
            except ValueError as exc:   # refused alike on every rank, before any step
                self._say(f"error: {exc}")
                return 2
            return self._run(range(first, last + 1))
        except (CheckpointFailed, CheckpointRefused) as exc:
            if isinstance(exc, CheckpointFailed) and self.watchdog and exc.error is not None \
                    and is_collective_failure(exc.error):   # a rank lost during the save: named, this process ends
                self.watchdog.fail_in_save(exc.step, exc.error)
            latest = self.checkpointer.latest() if self.checkpointer else None
            after = f"; {latest.name} stays the latest, training stopped" if isinstance(exc, CheckpointFailed) \
                and latest else "; training stopped"
            self._say(f"error: {exc}{after}")
            self.parallel.settle()   # every rank stops here alike: a replica check in flight is read first
            return CHECKPOINT_ERROR
        finally:
            if self.telemetry:
                self.telemetry.close()

    def _run(self, steps: range) -> int:
        pending = None
        step = steps.start
        while step < steps.stop:
            faults.stop_here(self.config.injection, step, self.rank)
            if self.watchdog:
                self.watchdog.reached(step)
            if step in self.skip_steps:   # this batch is not trained at all
                self.parallel.step += 1
                step += 1
                continue
            if self.checkpointer and self.checkpointer.due(step):   # each checkpoint after a clean check
                self.parallel.check_at(step)
            started = time.perf_counter()
            try:
                loss = self._train(step)
            except (Rollback, Exclude) as found:
                if isinstance(found, Exclude) and not self._exclude(found):
                    return self._stopped()   # no node left to go on with
                if self.checkpointer is None:   # nothing to undo the update with
                    self._say(f"error: step {found.step}: {found.reason}, and no checkpoints to roll back to "
                              "(--checkpoint-dir, --save-every): training stopped")
                    return self._stopped()
                step = self.roll_back(found.step)
                continue
            except HealthStop as exc:
                print(f"error (rank {self.rank}): stopped by the health policy: {exc}", file=sys.stderr, flush=True)
                return self._stopped()
            step_s = time.perf_counter() - started
            self.losses[step] = loss
            if self.rank == 0:
                print(f"{self.config.log_prefix}step {step} loss {loss:.10f}", flush=True)
            if self.config.save_at == step and self.config.save_to:
                pending = self._save_once(step)
            if self.checkpointer:
                self.checkpointer.poll()
            blocking = self.checkpointer.maybe_save(step, self.parallel, step_s) if self.checkpointer else 0.0
            if self.telemetry:
                self.telemetry.write(step, self.parallel.timing, blocking)
            step += 1
        self.parallel.settle()
        if pending is not None:
            pending()   # the asynchronous write finishes before the job ends
        if self.checkpointer:
            self.checkpointer.finish()
        return 0

    def _save_once(self, step: int) -> Callable[[], None] | None:
        """The one checkpoint `save_at` asks for and its manifest (what a later --resume verifies); written
        asynchronously, what finishes it before the job ends."""
        writer = HashingWriter(self.config.save_to)
        future = self.parallel.save(self.config.save_to, step, asynchronous=self.config.async_save, writer=writer)

        def finish() -> None:
            if future is not None:
                future.result()
            write_manifest(Path(self.config.save_to), step, self.parallel.identity(), writer.written())
        if future is None:
            finish()
            return None
        return finish

    def _train(self, step: int) -> float:
        tokens, targets = self.batches(step)
        try:
            with faults.spiked(self.parallel, self.config.injection, step):
                return self.parallel.train_step(tokens, targets)
        except (Rollback, HealthStop, Exclude):
            raise
        except (RuntimeError, dist.DistError) as exc:   # a peer lost mid-collective, or this rank failed
            if self.watchdog is None:
                raise
            self.watchdog.fail(step, exc)   # names the ranks lost and ends this process
            raise

    def _stopped(self) -> int:
        """STOPPED, after the replica check still in flight is read (every rank stops at the same step: the health
        policy's findings are the job's), so that no collective is left pending as the process ends."""
        self.parallel.settle()
        return STOPPED

    def _exclude(self, found: Exclude) -> bool:
        """The suspected node leaves (this process ends) or, its self-test passed and no finding before, is kept:
        True, the job rolls back; False where no node would be left."""
        health = self.parallel.health
        return exclude(found, self.parallel.device, self.config.checkpoint_dir,
                       health.injected_defect(found.step) if health else None)

    def roll_back(self, spike_step: int) -> int:
        """Reload the last complete checkpoint, skip the batches that end at the spike; the step to go on from."""
        health = self.parallel.health
        back = self.checkpointer.restore(self.parallel)
        if back is None:   # nothing to roll back to yet: the batch is skipped instead, and that is said
            health.say(f"health: step {spike_step}: no complete checkpoint to roll back to; batch "
                       f"{spike_step} skipped instead")
            self.skip_steps.add(spike_step)
            return spike_step + 1
        skipped = list(range(max(back + 1, spike_step - self.config.rollback_skip + 1), spike_step + 1))
        self.skip_steps.update(skipped)
        health.forget_after(back)
        health.say(f"health: step {spike_step}: rolled back to step {back} (its checkpoint); batch"
                   f"{'es' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))} skipped")
        return back + 1

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, file=sys.stderr, flush=True)
