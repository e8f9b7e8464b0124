"""A Monte Carlo of the process the goodput model (cost_models/reliability.py) takes in closed form, event by
event: train in segments of tau useful seconds plus a blocking checkpoint; interruptions of each kind arrive
at their own exponential rate; one costs the work since the last checkpoint, its detection delay (found at
checks: the first one uniformly within an interval after it, then each finding it with its chance, drawn), and
its recovery: a restart (which a hardware failure during it starts over), a repair waited for (no spares), or,
elastic, a restart on the nodes left, a run at (nodes-1)/nodes of the speed until the repair is done, a
checkpoint, and a restart at the full size. The model is checked against it (tests/test_reliability.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.reliability import Goodput, Interruption


@dataclass(frozen=True)
class Process:
    interval_s: float
    blocking_s: float
    kinds: tuple[Interruption, ...]
    hardware_per_s: float      # what restarts a restart
    elastic: bool = False
    repair_s: float = 0.0      # elastic: how long the job runs short-handed
    slower: float = 1.0        # elastic: its speed meanwhile
    regrow_s: float = 0.0      # elastic: the restart back at the full size

    @classmethod
    def of(cls, model: Goodput, repair_s: float, nodes: int) -> "Process":
        elastic = not model.recovery.spare_nodes and model.recovery.elastic
        return cls(model.interval_s, model.checkpoint_blocking_s, model.kinds, 1 / model.mtbf_s, elastic,
                   repair_s, (nodes - 1) / nodes if elastic else 1.0, model.restart_s)


class _Run:
    def __init__(self, process: Process, seed: int):
        self.p, self.rng = process, np.random.default_rng(seed)
        self.wall = 0.0
        self.rate = sum(kind.per_s for kind in process.kinds)
        self.shares = np.array([kind.per_s for kind in process.kinds]) / self.rate
        self.short_until = -1.0   # elastic: running on fewer nodes until then

    def restart(self, seconds: float) -> None:
        """A restart of `seconds` that a hardware failure sends back to its beginning."""
        while True:
            failure = self.rng.exponential(1 / self.p.hardware_per_s) if self.p.hardware_per_s else np.inf
            if failure >= seconds:
                self.wall += seconds
                return
            self.wall += failure

    def segment(self) -> float:
        """Run until a checkpoint is kept or an interruption ends the attempt; the useful seconds kept."""
        p = self.p
        speed = p.slower if self.wall < self.short_until else 1.0
        length = p.interval_s / speed + p.blocking_s
        arrival = self.rng.exponential(1 / self.rate)
        repaired = self.short_until - self.wall if speed < 1 else np.inf
        if min(arrival, repaired) >= length:
            self.wall += length
            return p.interval_s
        if repaired <= arrival:   # the node is back: checkpoint what was done, restart at the full size
            kept = min(repaired * speed, p.interval_s)
            self.wall += repaired + p.blocking_s
            self.restart(p.regrow_s)
            self.short_until = -1.0
            return kept
        kind = p.kinds[self.rng.choice(len(p.kinds), p=self.shares)]
        self.wall += arrival + self.detection(kind)
        self.recover(kind)
        return 0.0

    def detection(self, kind: Interruption) -> float:
        """How long until it is seen: at once plus its fixed delay, or at the checks that find it."""
        if not kind.checked_every_s:
            return kind.detection_s
        checks = self.rng.geometric(kind.seen_per_check)   # the first that sees it, counting from 1
        return kind.checked_every_s * (self.rng.uniform() + checks - 1)

    def recover(self, kind: Interruption) -> None:
        if not kind.waiting_s:              # spares, or a rollback in place
            self.restart(kind.restart_s)
        elif not self.p.elastic:            # wait for the repair, then restart
            self.wall += kind.waiting_s
            self.restart(kind.restart_s)
        else:                               # continue on the nodes left until the repair is done
            self.restart(kind.restart_s)
            self.short_until = max(self.short_until, self.wall + self.p.repair_s)


def simulate_ettr(process: Process, useful_s: float, seed: int = 0) -> float:
    """Useful seconds over wall seconds, until `useful_s` of training is kept."""
    if not process.kinds:
        return process.interval_s / (process.interval_s + process.blocking_s)
    run, done = _Run(process, seed), 0.0
    while done < useful_s:
        done += run.segment()
    return done / run.wall
