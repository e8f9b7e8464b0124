"""Faults injected on purpose, to check that the health checks and the watchdog see them
(`python -m runtime.train --inject KIND@STEP[:RANK]`):

* `stop@S:R`   rank R stops itself (SIGSTOP) before step S: the watchdog names it;
* `kill@S:R`   rank R dies (SIGKILL) before step S;
* `node@S:R`   rank R's node is lost before step S: its launcher agent and every worker it started are
               killed (SIGKILL), as a machine that goes away;
               all three only in the job's first attempt: torchrun restarts the job (`--max-restarts`) and it
               resumes from the last complete checkpoint (`--checkpoint-dir`), on the nodes left with
               `--nnodes MIN:MAX` (and `--elastic` to plan for them);
* `nan@S:R`    one gradient element of rank R turns NaN after step S's backward: skipped on every rank;
* `spike@S`    step S's output layer runs with its weights x 64 (restored exactly after the step, 64 being
               a power of two): the loss jumps, and the spike policy skips the batch;
* `bitflip@S:R` after step S's optimizer step one bit of one parameter of rank R flips: its replicas'
               fingerprints disagree at the next check;
* `slow@S:R`   rank R's compute is slow from step S on (its first leaf module's forward takes SLOW_S longer,
               as a throttled device's kernels would): the next straggler check names it;
* `sdc@S:R`    one element of one matrix product of rank R's step S comes out wrong, by `--sdc-error` of
               itself (1: doubled, as a flipped low exponent bit), in the forward or the backward
               (`--sdc-phase`): the product check (runtime/gemm_check.py) names the rank on a checked step;
* `defect@S:R` rank R's device is defective from step S on: one product of every step from then, and of its
               self-test (runtime/exclusion.py), comes out wrong as under `sdc`;
* `optsdc@S:R` rank R's own optimizer update of step S leaves one element of the shard it owns wrong by
               `--sdc-error` of itself (under ZeRO-1 before its broadcast, so every replica takes it): the
               optimizer check (runtime/optimizer_check.py) names the rank where the element is sampled;
* `diskfull@S:R` rank R's disk is full from the first checkpoint written at or after step S: its write fails
               with ENOSPC once FULL_AFTER_BYTES of it are on disk (a partial shard left behind);
* `savekill@S:R` rank R dies (SIGKILL) in the middle of writing the first checkpoint at or after step S (only
               in the job's first attempt): the survivors' save fails in DCP's collective, and they name it.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from .dims import local_shard
from .stragglers import compute_leaves

KINDS = ("stop", "kill", "node", "nan", "spike", "bitflip", "slow", "sdc", "defect", "optsdc", "diskfull",
         "savekill")
SAVE_KINDS = ("diskfull", "savekill")
SPIKE_SCALE = 64.0   # a power of two: x 64 then / 64 is exact
FLIPPED_BIT = 1 << 22   # the highest mantissa bit of an fp32: the value changes by a quarter to a half
SLOW_S = 0.2            # well above the straggler check's 50 ms of allowed jitter
FULL_AFTER_BYTES = 4096   # what a full disk still takes of a shard before ENOSPC


@dataclass(frozen=True)
class Injection:
    kind: str
    step: int
    rank: int | None    # None: every rank (spike)
    relative_error: float = 1.0   # sdc, defect, optsdc: how wrong the element comes out
    phase: str = "forward"        # sdc, defect: in the forward or the backward


def parse_injection(text: str | None, relative_error: float = 1.0, phase: str = "forward") -> Injection | None:
    if not text:
        return None
    if not (math.isfinite(relative_error) and relative_error != 0) or phase not in ("forward", "backward"):
        raise ValueError(f"--sdc-error {relative_error:g} --sdc-phase {phase}: expected a finite, non-zero relative "
                         "error and forward or backward")
    kind, _, where = text.partition("@")
    step, _, rank = where.partition(":")
    if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()) or (kind != "spike" and not rank):
        raise ValueError(f"--inject {text}: expected KIND@STEP:RANK with KIND one of {', '.join(KINDS)} "
                         "(spike@STEP for every rank)")
    return Injection(kind, int(step), int(rank) if rank else None, relative_error, phase)


def check_reached(injection: Injection | None, last_step: int, world: int, saving: bool = True) -> None:
    """A fault that would never happen is refused before step 1: a rank outside the job, a step past the last, a
    save fault in a job that saves nothing (`saving` False)."""
    if injection is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return   # a restarted job (perhaps on fewer ranks) runs clean: its fault was the first attempt's
    if injection.rank is not None and injection.rank >= world:
        raise ValueError(f"--inject {injection.kind}@{injection.step}:{injection.rank}: rank {injection.rank} is "
                         f"outside this job's {world} ranks (0..{world - 1})")
    if injection.kind in SAVE_KINDS and not saving:
        raise ValueError(f"--inject {injection.kind}@{injection.step}:{injection.rank}: this job writes no "
                         "checkpoints (--checkpoint-dir and --save-every)")
    if not 1 <= injection.step <= last_step:
        raise ValueError(f"--inject {injection.kind}@{injection.step}: step {injection.step} is never reached "
                         f"(this run ends at step {last_step})")


def install(injection: Injection | None, parallel, rank: int) -> None:
    """Hook the fault into the ParallelModel's step callbacks (stop is the caller's: before the step)."""
    if injection is None or (injection.rank is not None and injection.rank != rank):
        return
    if injection.kind == "nan":
        def poison(pm):
            if pm.step == injection.step:
                grad = next(p.grad for p in pm.params if p.grad is not None)
                local = local_shard(grad)
                local.view(-1)[0] = float("nan")
        parallel.after_backward = poison
    elif injection.kind == "bitflip":
        def flip(pm):
            if pm.step == injection.step:
                param = pm.params[0].detach()
                local = local_shard(param)
                bits = local.view(-1)[:1].view(torch.int32)
                bits.bitwise_xor_(FLIPPED_BIT)
        parallel.after_step = flip
    elif injection.kind in ("sdc", "defect"):
        from .gemm_check import GemmFault
        from .health import InjectedProductFault
        if parallel.health is None:
            raise ValueError(f"--inject {injection.kind} needs the health checks (without --no-health)")
        parallel.health.gemm_fault = InjectedProductFault(injection.step, GemmFault(injection.phase,
                                                                                    injection.relative_error),
                                                          lasting=injection.kind == "defect")
    elif injection.kind == "optsdc":
        from .optimizer_check import OptimizerFault
        if parallel.optimizer_check is None:
            raise ValueError("--inject optsdc needs an optimizer that owns shards (ZeRO-1/2/3 over dp > 1) and its "
                             "check on (without --no-health, --optimizer-check-every > 0)")
        parallel.optimizer_check.fault = OptimizerFault(injection.step, injection.relative_error)
    elif injection.kind == "slow":
        leaf = compute_leaves(parallel.modules)[0]
        compute = leaf.forward

        def throttled(*args, **kwargs):   # the module's own compute, inside every hook around it
            if parallel.step + 1 >= injection.step:   # the step in progress (counted once it is done)
                time.sleep(SLOW_S)
            return compute(*args, **kwargs)
        leaf.forward = throttled


def install_on_saves(injection: Injection | None, checkpointer, rank: int) -> None:
    """A save fault: the checkpointer's saves at or after the injection's step write through a failing file
    system on the injection's rank (runtime.checkpointing.Checkpointer.file_system_for)."""
    if injection is None or injection.kind not in SAVE_KINDS or injection.rank != rank:
        return
    if injection.kind == "savekill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return   # the restarted job runs clean
    from .verified import HashingFileSystem
    healthy = checkpointer.file_system_for

    class Failing(HashingFileSystem):
        def stream_for(self, raw):
            return super().stream_for(_FailingFile(raw, injection.kind))
    checkpointer.file_system_for = lambda step: Failing() if step >= injection.step else healthy(step)


class _FailingFile:
    """A file being written on a full disk (ENOSPC past FULL_AFTER_BYTES, as the kernel's write says it), or by
    a rank that dies in the middle of it."""

    def __init__(self, raw, kind: str):
        self.raw, self.kind, self.bytes = raw, kind, 0

    def write(self, data) -> int:
        if self.kind == "savekill":
            os.kill(os.getpid(), signal.SIGKILL)
        view = memoryview(data).cast("B")
        room = max(FULL_AFTER_BYTES - self.bytes, 0)
        if len(view) > room:
            self.bytes += self.raw.write(view[:room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.bytes += len(view)
        return self.raw.write(view)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def stop_here(injection: Injection | None, step: int, rank: int) -> None:
    """Stop or kill this rank where the injection says (a kill only before the first restart)."""
    if not injection or injection.step != step or injection.rank != rank:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return   # the restarted job runs clean
    if injection.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif injection.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif injection.kind == "node":
        lose_this_node()


def lose_this_node() -> None:
    """SIGKILL this worker's launcher agent first (so that it restarts nothing), then the workers it started."""
    agent = os.getppid()
    workers = [pid for pid in children_of(agent) if pid != os.getpid()]
    os.kill(agent, signal.SIGKILL)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def children_of(parent: int) -> list[int]:
    """Processes whose parent is `parent` (Linux /proc: the fourth field of /proc/PID/stat)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def spike_scale(injection: Injection | None, step: int) -> float:
    return SPIKE_SCALE if injection and injection.kind == "spike" and injection.step == step else 1.0


@contextlib.contextmanager
def spiked(parallel, injection: Injection | None, step: int):
    """Step `step` with the output projection's weights multiplied by the spike's scale where the injection says
    so, restored exactly afterwards (the scale is a power of two)."""
    scale = spike_scale(injection, step)
    _scale_output_layer(parallel, scale)
    try:
        yield
    finally:
        _scale_output_layer(parallel, 1 / scale)


def _scale_output_layer(parallel, factor: float) -> None:
    if factor == 1:
        return
    with torch.no_grad():
        for module in parallel.modules:
            inner = module.module if hasattr(module, "module") else module
            present = dict(inner.named_modules())
            for name in parallel.graph.head_modules:
                if isinstance(present.get(name), torch.nn.Linear):
                    present[name].weight.mul_(factor)
