"""A node the checks found computing wrong, taken out of the job (`--on-sdc exclude`).

Every rank learns of the finding at the same step (the product or the optimizer check's verdict is the job's),
before anything wrong is saved: every checkpoint follows a clean check of its own step. The suspected ranks run
a self-test (a matrix product whose result is known exactly) and every rank learns its verdict. A node is
excluded where its self-test failed (the device computes wrong now) or where it was suspected before (a defect
the test does not reproduce, found twice: `suspected-nodes.json`); otherwise the error is taken for a transient
one: the node is kept, its suspicion recorded, and the job rolls back to the newest checkpoint and skips the
batch (as `--on-sdc rollback`), so that a second finding excludes it.

An excluded node is named and recorded in `excluded-nodes.json` beside the checkpoints (what a scheduler
excludes: Slurm's `--exclude`). Then it leaves the job as a lost node does (its launcher agent and its workers
end, so that it never rejoins), and the others end with `EXCLUDED`: torchrun (`--max-restarts`, `--nnodes
MIN:MAX`) restarts them on the nodes left, `--elastic` plans again for the ranks there are, and training resumes
from the newest checkpoint. A job of one node has nothing to go on with: it stops, saying so. The node hosting
torchrun's c10d rendezvous store cannot leave without ending the job (torchrun's own limit), and then too the
job stops.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

EXCLUDED = 6          # the exit status of a rank whose job goes on without a node
SETTLE_S = 2.0        # the others wait this long for the suspected node to be gone before they end
SELF_TEST_SIZE = 256  # integers in [-8, 8]: every product and partial sum below 2^24, exact in fp32
SELF_TEST_REPEATS = 8


class Exclude(RuntimeError):
    """Raised on every rank alike: the ranks of `ranks` computed wrong at `step` (`what` says where)."""

    def __init__(self, step: int, ranks: list[int], what: str):
        super().__init__(f"{what} at step {step} on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}")
        self.step, self.ranks, self.what = step, ranks, what

    @property
    def reason(self) -> str:   # what Rollback calls it: the Trainer handles both alike
        return self.what


def self_test(device: torch.device, fault=None) -> bool:
    """A product of integer matrices, exact in fp32, against the CPU's int64 result, several times: False where
    any element differs (the device computes wrong now); True says only that this test did not reproduce it.
    `fault`: an injected defect of this device (runtime/faults.py `defect`), which its products meet here too."""
    from .gemm_check import GemmCheck
    generator = torch.Generator().manual_seed(20261204)
    left = torch.randint(-8, 9, (SELF_TEST_SIZE, SELF_TEST_SIZE), generator=generator)
    right = torch.randint(-8, 9, (SELF_TEST_SIZE, SELF_TEST_SIZE), generator=generator)
    exact = left @ right
    a, b = left.to(device, torch.float32), right.to(device, torch.float32)
    with GemmCheck(check=False).watching(fault) if fault else contextlib.nullcontext():
        return all(torch.equal((a @ b).cpu().to(torch.int64), exact) for _ in range(SELF_TEST_REPEATS))


@dataclass(frozen=True)
class Decision:
    """What becomes of the suspected nodes: those excluded, with why, and those kept (their error taken for a
    transient one: the job rolls back)."""
    excluded: dict[str, str]
    kept: tuple[str, ...]


def decide(self_test_passed: dict[str, bool], suspected_before: set[str]) -> Decision:
    """Each suspected node (its self-test passed on every suspected rank of it, or not): excluded where its
    self-test failed or it was suspected before, else kept."""
    excluded, kept = {}, []
    for node, passed in sorted(self_test_passed.items()):
        if not passed:
            excluded[node] = "its self-test failed"
        elif node in suspected_before:
            excluded[node] = "found computing wrong before (its self-test passes: a defect it does not reproduce)"
        else:
            kept.append(node)
    return Decision(excluded, tuple(kept))


def exclude(found: Exclude, device: torch.device, record_dir: str | None, fault=None) -> bool:
    """Every rank: the self-test on the suspected ones, the decision, the lines and records; then an excluded
    node leaves and the others end with EXCLUDED. Returns True where every suspected node is kept (the caller
    rolls back), False where none would be left to go on (the caller stops). `fault`: this device's injected
    defect, if any."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list = [None] * world   # each rank's node: torchrun's node rank (GROUP_RANK) and host name
    dist.all_gather_object(hosts, f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})")
    passed = self_test(device, fault) if rank in found.ranks else True
    if rank in found.ranks:
        verdict = "passed (a transient error, or a defect it does not reproduce)" if passed else \
            "FAILED (the device computes wrong)"
        print(f"health: rank {rank} on {hosts[rank]}: self-test, a product of known result {SELF_TEST_REPEATS} "
              f"times: {verdict}", file=sys.stderr, flush=True)
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, passed)
    suspects = {hosts[r] for r in found.ranks}
    decided = [None]   # rank 0 reads the records and decides, before it writes them: every rank acts alike
    if rank == 0:
        decided = [decide({node: all(verdicts[r] for r in found.ranks if hosts[r] == node) for node in suspects},
                          _recorded(record_dir, SUSPECTED))]
    dist.broadcast_object_list(decided, src=0)
    decision = decided[0]
    if not decision.excluded:
        if rank == 0:
            _append(record_dir, SUSPECTED, {"nodes": list(decision.kept), "ranks": found.ranks, "step": found.step,
                                            "found": found.what})
            print(f"health: step {found.step}: {found.what} on {', '.join(decision.kept)}: kept, its self-test "
                  "passed and it was not suspected before (a second finding excludes it); rolling back",
                  file=sys.stderr, flush=True)
        return True
    left = sorted(set(hosts) - set(decision.excluded))
    going_on = bool(left) and hosts[0] not in decision.excluded
    if rank == 0:
        _append(record_dir, EXCLUDED_RECORD, {"nodes": sorted(decision.excluded), "ranks": found.ranks,
                                              "step": found.step, "found": found.what,
                                              "why": [decision.excluded[node] for node in sorted(decision.excluded)]})
        then = f"the job restarts on {', '.join(left)} from its newest checkpoint" if going_on else \
            "no node can go on (the job ran on it alone, or it hosts the rendezvous): stopped"
        named = ", ".join(f"{node} ({why})" for node, why in sorted(decision.excluded.items()))
        print(f"health: step {found.step}: {found.what} on rank{'s' if len(found.ranks) > 1 else ''} "
              f"{', '.join(map(str, found.ranks))}: {named} excluded (policy exclude); {then}",
              file=sys.stderr, flush=True)
    dist.barrier()
    if not going_on:
        return False
    if hosts[rank] in decision.excluded:
        from .faults import lose_this_node   # the agent first, so that it restarts nothing
        lose_this_node()
    time.sleep(SETTLE_S)
    os._exit(EXCLUDED)


EXCLUDED_RECORD = "excluded-nodes.json"   # the nodes taken out, for the scheduler
SUSPECTED = "suspected-nodes.json"        # the nodes kept after a finding: a second one excludes them


def _recorded(record_dir: str | None, name: str) -> set[str]:
    """The nodes a record names (none where it is missing or unreadable)."""
    return {node for entry in _entries(record_dir, name) if isinstance(entry, dict)
            for node in entry.get("nodes", []) if isinstance(node, str)}


def _entries(record_dir: str | None, name: str) -> list:
    if not record_dir:
        return []
    try:
        entries = json.loads((Path(record_dir) / name).read_text())
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def _append(record_dir: str | None, name: str, entry: dict) -> None:
    """Append an entry (and the time) to the record `name` (a list), written whole and renamed into place."""
    if not record_dir:
        return
    path = Path(record_dir) / name
    entries = _entries(record_dir, name) + [{**entry, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    try:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(entries, indent=1))
        temporary.replace(path)
    except OSError as exc:
        print(f"note: {path} not written ({exc})", file=sys.stderr, flush=True)
