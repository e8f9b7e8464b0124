"""A node the checks found computing wrong, taken out of the job (`--on-sdc exclude`).

Every rank learns of the finding at the same step (the product or the optimizer check's verdict is the job's),
before anything wrong is saved: every checkpoint follows a clean check of its own step. The suspected ranks run
a self-test (a matrix product whose result is known exactly) and say what it found; rank 0 names the node(s)
and records them in `excluded-nodes.json` beside the checkpoints (what a scheduler excludes: Slurm's
`--exclude`). Then the suspected node leaves the job as a lost node does (its launcher agent and its workers
end, so that it never rejoins), and the others end with `EXCLUDED`: torchrun (`--max-restarts`, `--nnodes
MIN:MAX`) restarts them on the nodes left, `--elastic` plans again for the ranks there are, and training resumes
from the newest checkpoint. A job of one node has nothing to go on with: it stops, saying so. The node hosting
torchrun's c10d rendezvous store cannot leave without ending the job (torchrun's own limit), and then too the
job stops.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
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


def self_test(device: torch.device) -> bool:
    """A product of integer matrices, exact in fp32, against the CPU's int64 result, several times: False where
    any element differs (the device computes wrong now); True says only that this test did not reproduce it."""
    generator = torch.Generator().manual_seed(20261204)
    left = torch.randint(-8, 9, (SELF_TEST_SIZE, SELF_TEST_SIZE), generator=generator)
    right = torch.randint(-8, 9, (SELF_TEST_SIZE, SELF_TEST_SIZE), generator=generator)
    exact = left @ right
    a, b = left.to(device, torch.float32), right.to(device, torch.float32)
    return all(torch.equal((a @ b).cpu().to(torch.int64), exact) for _ in range(SELF_TEST_REPEATS))


def exclude(found: Exclude, device: torch.device, record_dir: str | None) -> None:
    """Every rank: the self-test on the suspected ones, the lines, the record, then the node leaves and the
    others end with EXCLUDED; returns only where no node would be left (the caller stops)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list = [None] * world   # each rank's node: torchrun's node rank (GROUP_RANK) and host name
    dist.all_gather_object(hosts, f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})")
    suspected = sorted({hosts[r] for r in found.ranks})
    if rank in found.ranks:
        verdict = "passed (a transient error, or a defect it does not reproduce)" if self_test(device) else \
            "FAILED (the device computes wrong)"
        print(f"health: rank {rank} on {hosts[rank]}: self-test, a product of known result {SELF_TEST_REPEATS} "
              f"times: {verdict}", file=sys.stderr, flush=True)
    left = sorted(set(hosts) - set(suspected))
    going_on = bool(left) and hosts[0] not in suspected
    if rank == 0:
        _record(record_dir, found, suspected)
        then = f"the job restarts on {', '.join(left)} from its newest checkpoint" if going_on else \
            "no node can go on (the job ran on it alone, or it hosts the rendezvous): stopped"
        print(f"health: step {found.step}: {found.what} on rank{'s' if len(found.ranks) > 1 else ''} "
              f"{', '.join(map(str, found.ranks))}: {', '.join(suspected)} excluded (policy exclude); {then}",
              file=sys.stderr, flush=True)
    dist.barrier()
    if not going_on:
        return
    if hosts[rank] in suspected:
        from .faults import lose_this_node   # the agent first, so that it restarts nothing
        lose_this_node()
    time.sleep(SETTLE_S)
    os._exit(EXCLUDED)


def _record(record_dir: str | None, found: Exclude, suspected: list[str]) -> None:
    """Append the excluded nodes to `excluded-nodes.json` (a list), for the scheduler."""
    if not record_dir:
        return
    path = Path(record_dir) / "excluded-nodes.json"
    try:
        entries = json.loads(path.read_text()) if path.is_file() else []
        entries = entries if isinstance(entries, list) else []
    except (OSError, ValueError):
        entries = []
    entries.append({"nodes": suspected, "ranks": found.ranks, "step": found.step, "found": found.what,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(entries, indent=1))
        temporary.replace(path)
    except OSError as exc:
        print(f"note: {path} not written ({exc})", file=sys.stderr, flush=True)
