"""A stopped or dead rank turns into a named failure instead of a hang.

Collectives get the launch's timeout (`init_process_group(timeout=...)`, torch's default is 30 minutes);
each rank records the step it has reached in the job's c10d store. Two ways reveal a lost peer, and both
end in one line starting with `health:` that names the ranks behind:

* a collective fails or times out on a live rank (gloo sees a dead peer's socket close at once; a stopped
  peer at the collective timeout): the live rank reads the store and names the ranks that never reached
  the failing step;
* the launcher ends the live ranks because a peer died (torchrun notices a dead worker within its 0.1 s
  monitor interval and sends SIGTERM to the others, killing them 30 s later): the SIGTERM is caught, the
  ranks still alive run on into the collective that waits for the dead one, and after `SETTLE_S` the ranks
  behind the most advanced one are named. Without this the launcher usually wins the race against the
  failing collective and the job ends saying nothing of who was lost.

A live rank whose own collective failed marks itself first: it is named as failing too, not as lost.
A rank found stopped (SIGSTOP, process state T) on the reporting rank's own node is killed there and said
so: it can take no other signal, and torchrun's restart path waits a fixed 30 s for it otherwise.
A rank that dies inside a step (after recording it) is behind no one; the survivors then say that no rank
was behind, and torchrun's own error report names the worker and its exit signal.

Either way the rank also writes torch's flight record (its last collectives per process group, with their
sequence numbers and state) and names the file in the line, so that the collective each rank was stuck in
can be compared afterwards (`torch.distributed.flight_recorder`'s analyser reads it). NCCL records every
group; gloo in torch 2.13 records the default group's collectives only (a DeviceMesh's split groups are
not), so on CPU the record shows start-up, not the step.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .dims import error_line

PROGRESS = "planner/progress/{rank}"
FAILED = "planner/failed/{rank}"     # a live rank whose own collective failed: it is not the one lost
WHERE = "planner/where/{rank}"       # host:pid, so that a peer on the same node can tell a stopped rank
FLIGHT_RECORDER_ENTRIES = 2000      # collectives each rank remembers (torch's default is 0: off)
STORE_READ = timedelta(seconds=2)   # reading a dead peer's progress may not wait for the peer
SETTLE_S = 1.0                      # live ranks run on this long after a SIGTERM, into the blocked collective
TERMINATED_EXIT = 128 + signal.SIGTERM


def enable_flight_recorder(entries: int = FLIGHT_RECORDER_ENTRIES) -> None:
    """Before init_process_group: torch's flight recorder on, unless the user sized it already."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)



# what a failed collective says: torch's distributed errors, or the backends' own (gloo's transport raises
# a plain RuntimeError naming its source file; NCCL/HCCL name themselves)
BACKEND_WORDS = ("gloo/", "nccl", "hccl", "connection closed by peer", "connection reset", "timed out")


def is_collective_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(word in text for word in BACKEND_WORDS)

class Watchdog:
    """Step progress of every rank in the default group's store, and one report when the job is lost."""

    def __init__(self, timeout_s: float, record_dir: str | None = None):
        self.timeout_s = timeout_s
        self.record_dir = Path(record_dir) if record_dir else None   # None: a private directory made when needed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.step = 0
        self._reporting = threading.Lock()   # one report per process, whichever path comes first
        self.store.set(WHERE.format(rank=self.rank), f"{socket.gethostname()}:{os.getpid()}")

    def reached(self, step: int) -> None:
        self.step = step
        self.store.set(PROGRESS.format(rank=self.rank), str(step))

    def progress(self) -> dict[int, int]:
        """Each rank's last recorded step (0: none recorded, or the store went with the dead rank)."""
        self.store.set_timeout(STORE_READ)
        done = {}
        for rank in range(self.world):
            key = PROGRESS.format(rank=rank)
            try:
                done[rank] = int(self.store.get(key)) if self.store.check([key]) else 0
            except RuntimeError:
                done[rank] = 0
        return done

    def failing(self) -> set[int]:
        """Ranks that said their own collective failed: alive, whatever step they were at."""
        found = set()
        for rank in range(self.world):
            try:
                if self.store.check([FAILED.format(rank=rank)]):
                    found.add(rank)
            except RuntimeError:
                pass
        return found

    def late(self, step: int) -> tuple[list[int], set[int]]:
        """The ranks that never reached `step` (stopped or dead), and the peers that failed beside this one."""
        failing = self.failing() - {self.rank}
        return [rank for rank, done in self.progress().items()
                if done < step and rank != self.rank and rank not in failing], failing

    def report(self, step: int, error: BaseException, late: list[int], failing: set[int], ended: list[int]) -> str:
        """The line for a collective of `step` that failed on this rank: `late` and `failing` as `late(step)`
        found them, `ended` the stopped ranks it killed."""
        cause = error_line(error)
        also = (f"; rank{'s' if len(failing) > 1 else ''} {', '.join(map(str, sorted(failing)))} failed too"
                if failing else "")
        killed = (f"; rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))} stopped (SIGSTOP) on this "
                  "node: killed, so that the launcher restarts the job now, not after its 30 s grace") if ended else ""
        return (f"health: rank {self.rank}: a collective of step {step} failed within the {self.timeout_s:g} s "
                f"collective timeout; {_behind(late, step)}{also}{killed}: {cause}")

    def end_stopped(self, ranks: list[int]) -> list[int]:
        """Kill the ranks among `ranks` that sit stopped (state T) on this node: a stopped process can take no
        signal but SIGKILL, and torchrun waits 30 s for it before it restarts the group."""
        ended = []
        self.store.set_timeout(STORE_READ)
        for rank in ranks:
            try:
                host, pid = self.store.get(WHERE.format(rank=rank)).decode().rsplit(":", 1)
            except (RuntimeError, ValueError):
                continue
            if host == socket.gethostname() and _process_state(int(pid)) == "T":
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    ended.append(rank)
                except OSError:
                    pass
        return ended

    def fail(self, step: int, error: BaseException) -> None:
        """Say which ranks were lost and end this process (a group with a peer gone cannot be torn down).
        Every failing rank first marks itself, then waits a moment: the peers failing beside it are then
        told apart from the ranks that stopped or died. An error of this rank's own code (not of a
        collective) is said as such, with its traceback: the peers then name this rank."""
        with self._reporting:
            try:
                self.store.set(FAILED.format(rank=self.rank), str(step))
            except RuntimeError:
                pass
            if not is_collective_failure(error):
                traceback.print_exception(error, file=sys.stderr)
                print(f"error (rank {self.rank}): step {step} failed in this rank's own computation, not in a "
                      f"collective: {type(error).__name__}: {error_line(error)}", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(SETTLE_S / 2)
            late, failing = self.late(step)
            ended = self.end_stopped(late)
            print(self.report(step, error, late, failing, ended) + self.flight_record(), file=sys.stderr, flush=True)
            os._exit(3)

    def fail_in_save(self, step: int, error: BaseException) -> None:
        """The checkpoint after `step` failed in one of DCP's collectives: every rank had finished the step, so
        the ranks lost are those that did not say their own save failed (each live one marks itself, then waits
        for its peers to do so). Says them and ends this process, as `fail` does."""
        with self._reporting:
            try:
                self.store.set(FAILED.format(rank=self.rank), str(step))
            except RuntimeError:
                pass
            time.sleep(SETTLE_S / 2)
            failing = self.failing() | {self.rank}
            lost = [rank for rank in range(self.world) if rank not in failing]
            who = (f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost during it (stopped or dead)"
                   if lost else "no rank was lost (the collective itself failed)")
            print(f"health: rank {self.rank}: the checkpoint after step {step} failed in a collective; {who}; the "
                  f"last verified checkpoint stays latest: {error_line(error)}" + self.flight_record(),
                  file=sys.stderr, flush=True)
            os._exit(3)

    def flight_record(self) -> str:
        """Write this rank's flight record (JSON) and say where, or why there is none."""
        from torch._C._distributed_c10d import _dump_fr_trace_json
        try:
            if self.record_dir is None:   # never a predictable name in the shared temp directory
                self.record_dir = Path(tempfile.mkdtemp(prefix=f"flight-record-rank{self.rank}-"))
            self.record_dir.mkdir(parents=True, exist_ok=True)
            path = self.record_dir / f"flight-record-rank{self.rank}.json"
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
            with os.fdopen(os.open(path, flags, 0o600), "wb") as handle:   # a planted link or FIFO fails
                handle.write(_dump_fr_trace_json(True, False))
        except (OSError, RuntimeError) as exc:
            return f"; no flight record ({exc})"
        return f"; flight record: {path}"

    # -- the launcher's SIGTERM ---------------------------------------------------------------------
    def report_termination(self) -> str:
        """The line for a SIGTERM: the ranks behind the most advanced one."""
        done = self.progress()
        ahead = max(done.values())
        late = [rank for rank, step in done.items() if step < ahead]
        return (f"health: rank {self.rank}: terminated by the launcher (SIGTERM) at step {self.step}; "
                f"{_behind(late, ahead)}")

    def report_on_termination(self) -> None:
        """From now on a SIGTERM prints `report_termination()` and ends the process (exit 143).

        Python runs signal handlers only between bytecodes of the main thread, which is blocked inside the
        collective; the wakeup fd is written by the C-level handler at once, and a thread reads it."""
        if threading.current_thread() is not threading.main_thread():
            return
        readable, writable = os.pipe()
        os.set_blocking(writable, False)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)   # the thread below does the work
        signal.set_wakeup_fd(writable)

        def on_signal():
            while os.read(readable, 1) != bytes([signal.SIGTERM]):
                pass
            time.sleep(SETTLE_S)
            with self._reporting:
                print(self.report_termination() + self.flight_record(), file=sys.stderr, flush=True)
                os._exit(TERMINATED_EXIT)
        threading.Thread(target=on_signal, name="planner-sigterm", daemon=True).start()


def _process_state(pid: int) -> str:
    """The state letter of a process of this node (R, S, D, T, ...), or "" where there is none to read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]


def _behind(late: list[int], step: int) -> str:
    if not late:
        return f"no rank was behind step {step}"
    return f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not reach step {step} (stopped or dead)"
