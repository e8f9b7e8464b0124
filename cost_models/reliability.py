"""Failures, checkpoints and goodput: how much of the wall clock is useful training.

Interruptions are exponential with the job's rate (per-node rate x nodes), split by what reveals them
(a dead process, a hang found at the collective timeout, corruption found at a replica check) plus loss
spikes the job rolls back from. The optimal checkpoint interval follows Young (1974) and Daly (2006).
Wall time per segment of tau useful seconds and a blocking checkpoint delta, with a total rate Lambda of
interruptions, each costing its detection delay D_k and recovery C_k:

    E[T] = (e^{Lambda (tau + delta)} - 1) (1/Lambda + sum_k p_k (D_k + C_k))

(a renewal argument; with one kind, D = 0 and C = M (e^{R/M} - 1), a restart that failures restart, it is
Daly's M e^{R/M} (e^{(tau+delta)/M} - 1)). The downtime factors out, so Daly's tau stays optimal for any
D and C. ETTR = tau / E[T] x (1 - the checks' share of a step); goodput = MFU x ETTR.

Silent corruption from a defective device is found by the check of matrix products (runtime/gemm_check.py) run
every N steps of s seconds, each seeing the device's error with probability p: the first check after the
defect is on average N s / 2 later, then each misses with 1 - p, so D = N s (1/p - 1/2). A checked step costs c
more; the checks' share of the time is c / (N s), the corruption's loss per second lambda_sdc D: their sum is
least at N s = sqrt(c / (lambda_sdc (1/p - 1/2))) (as Young's interval balances saving against losing work),
the cadence the model chooses unless one is given. Without product checks corruption is found by the replica
fingerprint every N_r steps (D = N_r s / 2), which sees parameters changed in memory only. A share q of the
corruption lands in the optimizer's update instead (by default the update's share of the step's time): where
each shard's update is its owner's alone (ZeRO-1/2/3) the optimizer check (runtime/optimizer_check.py), a sample
recomputed by another rank every N_o steps, finds it the same way (its own c_o, p_o and cadence); under ZeRO-0
the replicas compute it apart and the replica fingerprint sees the one that differs.
`cost_models/goodput_simulation.py` simulates the same process event by event.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hardware_profiles.schema import Cluster

SECONDS_PER_DAY = 86400.0
PRODUCT_CHECK_EVERY_MAX = 1_000_000   # steps: a cadence past this checks nothing a run would see
CHECKPOINT_BYTES_PER_PARAM = 14  # bf16 weights 2 + fp32 master 4 + Adam moments 8 (optimizer state to resume)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    # Young (1974): tau = sqrt(2 delta M)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    # Daly (2006): tau = sqrt(2 delta M) [1 + sqrt(delta/(2M))/3 + (delta/(2M))/9] - delta, for delta < 2M
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def expected_segment_s(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    # Daly (2006): expected wall time to complete tau + delta under exponential failures with restart R
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s)


def ettr(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Effective training time ratio: useful seconds over wall seconds."""
    return interval_s / expected_segment_s(interval_s, checkpoint_s, restart_s, mtbf_s)


@dataclass(frozen=True)
class Recovery:
    """How the job watches and recovers itself: the runtime's settings (runtime/health.py, runtime/watchdog.py,
    runtime/train.py), which the goodput model charges for."""
    collective_timeout_s: float = 300.0   # a hang costs this before the watchdog names it (torch's own: 1800 s)
    spare_nodes: bool = True              # a failed node is swapped at once; else its repair is waited for
    elastic: bool = False                 # without spares: continue re-planned on the nodes left until the repair
    sdc_check_every_steps: int = 10       # replica fingerprints (0: none; sharded parameters have no replicas)
    loss_spikes_per_day: float = 0.0      # spikes rolled back from (the model's and data's, not the hardware's)
    product_check_every_steps: int | None = None   # matrix products checked (0: never; None: the model chooses)
    sdc_seen_per_check: float = 1.0       # chance a checked step shows a defective device's error (assumed)
    # a sample of each sharded optimizer update recomputed by another rank (runtime/optimizer_check.py; 0: never;
    # None: the model chooses); the chance a checked update's sample holds a defective device's wrong element
    # (assumed; a defect that spoils one element of n, s of them sampled: s/n); the share of a defective device's
    # corruption that lands in the optimizer's update rather than in matrix products (None: the update's share of
    # the step's device time, as a defect errs in what it computes in proportion to its time computing it)
    optimizer_check_every_steps: int | None = None
    optimizer_samples: int = 16           # elements of each owned tensor sampled
    optimizer_seen_per_check: float = 1.0
    optimizer_sdc_share: float | None = None

    def assumptions(self) -> str:
        spares = "spare nodes kept" if self.spare_nodes else (
            "no spare nodes, continue on the nodes left" if self.elastic else "no spare nodes, wait for the repair")
        checks = f"replica check every {self.sdc_check_every_steps} steps" if self.sdc_check_every_steps else \
            "no replica checks"
        products = "matrix products checked at the cadence the model chooses" \
            if self.product_check_every_steps is None else \
            f"matrix products checked every {self.product_check_every_steps} steps" \
            if self.product_check_every_steps else "no product checks"
        updates = "optimizer updates sampled at the cadence the model chooses" \
            if self.optimizer_check_every_steps is None else \
            f"optimizer updates sampled every {self.optimizer_check_every_steps} steps" \
            if self.optimizer_check_every_steps else "no optimizer checks"
        return (f"collective timeout {self.collective_timeout_s:g} s, {spares}, {checks}, {products} (a defect "
                f"seen by {self.sdc_seen_per_check:.0%} of checked steps), {updates} (by "
                f"{self.optimizer_seen_per_check:.0%} of checked updates), {self.loss_spikes_per_day:g} loss "
                "spikes/day")


@dataclass(frozen=True)
class Interruption:
    """One kind of interruption: how often, how long until the job sees it, and what recovering costs."""
    name: str
    per_s: float
    detection_s: float
    restart_s: float        # one restart: failures during it restart it
    restarts: float = 1.0   # restarts per interruption (an elastic job shrinks, then grows back)
    waiting_s: float = 0.0  # the job down or slowed with nothing to fail (a repair waited for, a slower run)
    waiting_part: str = "repair wait"
    checked_every_s: float = 0.0   # found at checks this far apart (0: detection_s after it happens)...
    seen_per_check: float = 1.0    # ...each finding it with this chance (detection_s is then the mean delay)


@dataclass(frozen=True)
class StepContext:
    """What the replica checks cost and how often they run: from the plan."""
    step_s: float
    check_s: float          # one fingerprint: the rank's parameters read once
    replicated: bool        # parameters replicated over data-parallel ranks (ZeRO-0/1/2), so checkable
    product_check_s: float = 0.0   # what checking a step's matrix products adds to it
    optimizer_check_s: float = 0.0   # what checking a sample of the rank's optimizer update adds to a step
    optimizer_share: float = 0.0     # the optimizer update's share of the step's time
    sharded_update: bool = True      # each shard's update computed by its owner alone (ZeRO-1/2/3)


@dataclass(frozen=True)
class Goodput:
    mtbf_s: float
    interruptions_per_day: float
    checkpoint_bytes: float
    checkpoint_save_s: float
    checkpoint_blocking_s: float
    interval_s: float
    restart_s: float
    ettr: float
    mfu: float
    recovery: Recovery = field(default_factory=Recovery)
    kinds: tuple[Interruption, ...] = ()
    lost_s_per_day: dict = field(default_factory=dict)   # wall seconds a day lost to each named part
    notes: tuple[str, ...] = ()

    @property
    def goodput(self) -> float:
        return self.mfu * self.ettr


def job_mtbf_s(cluster: Cluster, num_devices: int) -> float:
    nodes = math.ceil(num_devices / cluster.devices_per_node)
    per_day = cluster.reliability.node_failures_per_1000_node_days / 1000 * nodes
    return SECONDS_PER_DAY / per_day if per_day > 0 else float("inf")


def checkpoint_save_s(cluster: Cluster, nbytes: float, writers: int) -> float:
    """Every rank writes its shard (DCP); the storage's aggregate bandwidth caps the total."""
    storage = cluster.storage
    bandwidth = min(storage.checkpoint_write_gbytes_per_s, writers * storage.per_writer_gbytes_per_s) * 1e9
    return nbytes / bandwidth


def checkpoint_load_s(cluster: Cluster, nbytes: float, readers: int) -> float:
    """A restart reads the last checkpoint back, every rank its shard, at the storage's read bandwidth."""
    storage = cluster.storage
    bandwidth = min(storage.checkpoint_read_gbytes_per_s, readers * storage.per_writer_gbytes_per_s) * 1e9
    return nbytes / bandwidth


def inflated_restart_s(restart_s: float, failures_per_s: float) -> float:
    # Daly (2006): a restart that a failure (rate 1/M) restarts takes M (e^{R/M} - 1) on average
    return _expm1(restart_s * failures_per_s) / failures_per_s if failures_per_s > 0 else restart_s


def _expm1(x: float) -> float:
    """e^x - 1, infinite where it leaves floating point (interruptions far faster than a segment or a restart)."""
    return math.expm1(x) if x < 700 else math.inf


def interruption_kinds(cluster: Cluster, num_devices: int, restart_s: float, load_s: float, blocking_s: float,
                       recovery: Recovery, context: StepContext | None) -> tuple[Interruption, ...]:
    """Crashes, hangs and silent corruption (each costs a node), and loss spikes (a rollback in place)."""
    reliability = cluster.reliability
    hardware_per_s = 1 / job_mtbf_s(cluster, num_devices)
    nodes = math.ceil(num_devices / cluster.devices_per_node)
    restarts, waiting, waiting_part = 1.0, 0.0, "repair wait"
    if not recovery.spare_nodes and recovery.elastic:
        # shrink, run at (nodes-1)/nodes of the speed until the repair (first order: per-device speed unchanged,
        # global batch kept), checkpoint and regrow. A failure within the repair time of the last one extends the
        # short-handed time instead: regrowing follows with probability e^{-lambda r}, and the short time a
        # failure adds is E[min(r, next failure)] = (1 - e^{-lambda r}) / lambda (Poisson failures)
        repair = reliability.node_repair_s
        regrow = math.exp(-hardware_per_s * repair)
        short_s = -math.expm1(-hardware_per_s * repair) / hardware_per_s if hardware_per_s else repair
        restarts, waiting, waiting_part = 1 + regrow, regrow * blocking_s + short_s / max(nodes, 1), "fewer nodes"
    elif not recovery.spare_nodes:
        waiting = reliability.node_repair_s

    def losing_a_node(name: str, share: float, detection_s: float) -> Interruption:
        return Interruption(name, hardware_per_s * share, detection_s, restart_s, restarts, waiting, waiting_part)

    kinds = [losing_a_node("crash", 1 - reliability.hang_fraction - reliability.sdc_fraction,
                           reliability.crash_detection_s),
             losing_a_node("hang", reliability.hang_fraction, recovery.collective_timeout_s)]
    kinds += corruption_kinds(losing_a_node, reliability.sdc_fraction, recovery, context)
    if recovery.loss_spikes_per_day:
        kinds.append(Interruption("loss spike", recovery.loss_spikes_per_day / SECONDS_PER_DAY, 0.0, load_s))
    return tuple(kind for kind in kinds if kind.per_s > 0)


def corruption_kinds(losing_a_node, share: float, recovery: Recovery, context: StepContext | None
                     ) -> list[Interruption]:
    """Silent corruption from a defective device, split by where its error lands: in matrix products (found by
    the product checks; without them counted as found by the replica checks) and, a share q of it, in the
    optimizer's update (found by the optimizer check where each shard's update is its owner's alone; under ZeRO-0
    every replica computes it, and the replica check sees the defective one differ). `losing_a_node(name,
    share, detection_s)`: an interruption that costs a node, at `share` of the hardware's rate."""
    if context is None:   # no plan to say how often checks run: corruption counted as found at once
        return [losing_a_node("silent corruption", share, 0.0)]
    in_updates = optimizer_sdc_share(recovery, context)
    kinds = []
    in_products = share * (1 - in_updates)
    if recovery.product_check_every_steps:   # a defective device's products, at the checks that see it
        kinds.append(_checked(losing_a_node, "silent corruption", in_products, recovery.product_check_every_steps,
                              recovery.sdc_seen_per_check, context))
    elif context.replicated and recovery.sdc_check_every_steps:   # found at the next check, half an interval on
        kinds.append(_checked(losing_a_node, "silent corruption", in_products, recovery.sdc_check_every_steps, 1.0,
                              context))
    updates = "silent corruption (optimizer update)"
    if context.sharded_update and recovery.optimizer_check_every_steps:
        kinds.append(_checked(losing_a_node, updates, share * in_updates, recovery.optimizer_check_every_steps,
                              recovery.optimizer_seen_per_check, context))
    elif not context.sharded_update and context.replicated and recovery.sdc_check_every_steps:
        kinds.append(_checked(losing_a_node, updates, share * in_updates, recovery.sdc_check_every_steps, 1.0,
                              context))
    return kinds


def _checked(losing_a_node, name: str, share: float, every_steps: int, seen: float, context: StepContext
             ) -> Interruption:
    # found at checks every N steps of s seconds, each seeing it with chance p: the first check after it on
    # average N s / 2 later, then each misses with 1 - p: D = N s (1/p - 1/2)
    every_s = every_steps * context.step_s
    return replace(losing_a_node(name, share, every_s * (1 / seen - 0.5)), checked_every_s=every_s,
                   seen_per_check=seen)


def optimizer_sdc_share(recovery: Recovery, context: StepContext) -> float:
    """The share of a defective device's corruption in the optimizer's update: as given, else the update's share
    of the step's time."""
    return recovery.optimizer_sdc_share if recovery.optimizer_sdc_share is not None else context.optimizer_share


def segment_parts_s(interval_s: float, blocking_s: float, kinds: tuple[Interruption, ...],
                    hardware_per_s: float) -> dict[str, float]:
    """Expected wall seconds of one segment (tau useful + delta blocking), as named parts that add up to E[T]."""
    total_per_s = sum(kind.per_s for kind in kinds)
    segment = interval_s + blocking_s
    if total_per_s == 0:
        return {"training": interval_s, "checkpoint blocking": blocking_s}
    count = _expm1(total_per_s * segment)          # expected interruptions per segment
    parts = {"training": interval_s, "checkpoint blocking": blocking_s,
             "lost work": count / total_per_s - segment}   # attempts last count/Lambda in all, segment of it kept
    for kind in kinds:
        share = count * kind.per_s / total_per_s
        parts[f"detection ({kind.name})"] = share * kind.detection_s
        parts[f"restart ({kind.name})"] = share * kind.restarts * inflated_restart_s(kind.restart_s, hardware_per_s)
        if kind.waiting_s:
            parts[f"{kind.waiting_part} ({kind.name})"] = share * kind.waiting_s
    return parts


def product_check_every_steps(cluster: Cluster, num_devices: int, recovery: Recovery, context: StepContext) -> int:
    """The cadence of product checks that loses least (0, never, where no corruption is expected in products or
    the context prices no product check)."""
    sdc_per_s = cluster.reliability.sdc_fraction / job_mtbf_s(cluster, num_devices)
    in_products = sdc_per_s * (1 - optimizer_sdc_share(recovery, context))
    return check_every_steps(context.product_check_s, in_products, recovery.sdc_seen_per_check, context.step_s)


def optimizer_check_every_steps(cluster: Cluster, num_devices: int, recovery: Recovery, context: StepContext
                                ) -> int:
    """The cadence of optimizer checks that loses least (0, never, where updates are not sharded, no corruption
    is expected in them, or the context prices no optimizer check)."""
    if not context.sharded_update:
        return 0
    sdc_per_s = cluster.reliability.sdc_fraction / job_mtbf_s(cluster, num_devices)
    in_updates = sdc_per_s * optimizer_sdc_share(recovery, context)
    return check_every_steps(context.optimizer_check_s, in_updates, recovery.optimizer_seen_per_check,
                             context.step_s)


def check_every_steps(check_s: float, corruption_per_s: float, seen: float, step_s: float) -> int:
    """Steps between checks that cost `check_s` each and find corruption arriving at `corruption_per_s` with
    chance `seen` per check: N s = sqrt(c / (lambda (1/p - 1/2))), the checks' share c / (N s) balancing the
    corruption's loss lambda N s (1/p - 1/2) (as Young's interval balances saving against losing work); in
    whole steps, 0 (never) where nothing is expected or the check is not priced."""
    if corruption_per_s <= 0 or step_s <= 0 or check_s <= 0:
        return 0
    every_s = math.sqrt(check_s / (corruption_per_s * (1 / seen - 0.5)))
    return min(max(1, round(every_s / step_s)), PRODUCT_CHECK_EVERY_MAX)


def goodput(cluster: Cluster, num_devices: int, total_params: float, mfu: float, asynchronous: bool = True,
            recovery: Recovery | None = None, context: StepContext | None = None) -> Goodput:
    recovery = recovery or Recovery()
    if recovery.product_check_every_steps is None:
        chosen = product_check_every_steps(cluster, num_devices, recovery, context) if context else 0
        recovery = replace(recovery, product_check_every_steps=chosen)
    if recovery.optimizer_check_every_steps is None:
        chosen = optimizer_check_every_steps(cluster, num_devices, recovery, context) if context else 0
        recovery = replace(recovery, optimizer_check_every_steps=chosen)
    mtbf = job_mtbf_s(cluster, num_devices)
    nbytes = total_params * CHECKPOINT_BYTES_PER_PARAM
    save = checkpoint_save_s(cluster, nbytes, num_devices)
    blocking = save * cluster.storage.async_blocking_fraction if asynchronous else save
    load = checkpoint_load_s(cluster, nbytes, num_devices)
    restart = cluster.reliability.restart_s + cluster.reliability.rewarm_s + load
    kinds = interruption_kinds(cluster, num_devices, restart, load, blocking, recovery, context)
    check_share = check_overhead_share(recovery, context)
    notes = _notes(recovery, context)
    total_per_s = sum(kind.per_s for kind in kinds)
    if total_per_s == 0:
        return Goodput(mtbf, 0.0, nbytes, save, blocking, float("inf"), restart, 1 - check_share, mfu, recovery,
                       kinds, {}, notes)
    interval = max(daly_interval_s(blocking, 1 / total_per_s), save)  # an async save must finish before the next
    parts = segment_parts_s(interval, blocking, kinds, 1 / mtbf if math.isfinite(mtbf) else 0.0)
    wall = sum(parts.values())
    if not math.isfinite(wall):   # interruptions come faster than a segment or a restart completes
        return Goodput(mtbf, total_per_s * SECONDS_PER_DAY, nbytes, save, blocking, interval, restart, 0.0, mfu,
                       recovery, kinds, {"lost work": SECONDS_PER_DAY},
                       (*notes, "interruptions come faster than the job can restart and save: it makes no progress"))
    lost = {name: seconds / wall * SECONDS_PER_DAY for name, seconds in parts.items() if name != "training"}
    for name, share in check_shares(recovery, context).items():
        lost[name] = share * interval / wall * SECONDS_PER_DAY
    return Goodput(mtbf, total_per_s * SECONDS_PER_DAY, nbytes, save, blocking, interval, restart,
                   interval / wall * (1 - check_share), mfu, recovery, kinds, lost, notes)


def check_shares(recovery: Recovery, context: StepContext | None) -> dict[str, float]:
    """Each check's share of training time: the replica fingerprint, one read of the parameters every N_r steps;
    the product check, c more every N steps; the optimizer check, c_o more every N_o steps."""
    shares = {}
    if context and context.replicated and recovery.sdc_check_every_steps:
        every = recovery.sdc_check_every_steps * context.step_s
        shares["replica checks"] = context.check_s / (every + context.check_s)
    if context and recovery.product_check_every_steps and context.product_check_s:
        every = recovery.product_check_every_steps * context.step_s
        shares["product checks"] = context.product_check_s / (every + context.product_check_s)
    if context and context.sharded_update and recovery.optimizer_check_every_steps and context.optimizer_check_s:
        every = recovery.optimizer_check_every_steps * context.step_s
        shares["optimizer checks"] = context.optimizer_check_s / (every + context.optimizer_check_s)
    return shares


def check_overhead_share(recovery: Recovery, context: StepContext | None) -> float:
    return sum(check_shares(recovery, context).values())


def _notes(recovery: Recovery, context: StepContext | None) -> tuple[str, ...]:
    notes = [f"recovery assumed: {recovery.assumptions()}"]
    if context is None:
        notes.append("no plan given: replica checks not charged, silent corruption counted as found at once")
    elif recovery.product_check_every_steps:
        notes.append(f"silent corruption found by the product checks every {recovery.product_check_every_steps} "
                     f"steps (each {context.product_check_s * 1e3:.3g} ms): {recovery.sdc_seen_per_check:.0%} of "
                     "checked steps assumed to show a defective device's error")
    elif not context.replicated or not recovery.sdc_check_every_steps:
        why = "parameters are sharded (ZeRO-3), no replicas to compare" if not context.replicated else \
            "replica checks are off"
        notes.append(f"{why} and no product checks: silent corruption goes unseen (trains on, not counted as an "
                     "interruption)")
    else:
        notes.append("no product checks: silent corruption counted as found by the replica checks, which see "
                     "parameters changed in memory only, not a defective device's computation")
    if context is not None:
        notes.append(_optimizer_note(recovery, context))
    return tuple(notes)


def _optimizer_note(recovery: Recovery, context: StepContext) -> str:
    share = optimizer_sdc_share(recovery, context)
    where = f"{share * 100:.2g}% of silent corruption assumed to land in the optimizer's update" + \
        (" (its share of the step's time)" if recovery.optimizer_sdc_share is None else "")
    if not context.sharded_update:
        return f"{where}: ZeRO-0 computes it on every replica, and the replica checks see the one that differs"
    if recovery.optimizer_check_every_steps and context.optimizer_check_s:
        return (f"{where}: found by the optimizer checks every {recovery.optimizer_check_every_steps} steps (each "
                f"{context.optimizer_check_s * 1e3:.3g} ms), {recovery.optimizer_seen_per_check:.0%} of checked "
                "updates assumed to show it")
    return f"{where}: no optimizer checks, so it goes unseen (each shard's update is its owner's alone)"
