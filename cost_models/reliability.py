"""Failures, checkpoints and goodput: how much of the wall clock is useful training.

Failures are exponential with the job's rate (per-node rate x nodes). The optimal checkpoint interval
follows Young (1974) and Daly (2006); expected wall time per segment of tau useful seconds plus a
blocking checkpoint delta, with restart R, is M e^{R/M} (e^{(tau+delta)/M} - 1) (Daly 2006, exponential
failures, failures also during checkpoint and restart). ETTR = tau / that; goodput = MFU x ETTR.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hardware_profiles.schema import Cluster

SECONDS_PER_DAY = 86400.0
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


def simulate_ettr(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float,
                  useful_s: float, seed: int = 0) -> float:
    """Monte Carlo of the same process: work in segments, lose the segment on failure, restart (which
    can fail too), until `useful_s` of training is done."""
    rng = np.random.default_rng(seed)
    segment = interval_s + checkpoint_s
    segments = max(1, int(useful_s // interval_s))
    wall = 0.0
    for _ in range(segments):
        while True:
            failure = rng.exponential(mtbf_s)
            if failure >= segment:
                wall += segment
                break
            wall += failure
            while True:  # restart until one attempt survives R seconds
                again = rng.exponential(mtbf_s)
                if again >= restart_s:
                    wall += restart_s
                    break
                wall += again
    return segments * interval_s / wall


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


def goodput(cluster: Cluster, num_devices: int, total_params: float, mfu: float,
            asynchronous: bool = True) -> Goodput:
    mtbf = job_mtbf_s(cluster, num_devices)
    nbytes = total_params * CHECKPOINT_BYTES_PER_PARAM
    save = checkpoint_save_s(cluster, nbytes, num_devices)
    blocking = save * cluster.storage.async_blocking_fraction if asynchronous else save
    restart = cluster.reliability.restart_s + cluster.reliability.rewarm_s + checkpoint_load_s(cluster, nbytes,
                                                                                              num_devices)
    if math.isinf(mtbf):
        return Goodput(mtbf, 0.0, nbytes, save, blocking, float("inf"), restart, 1.0, mfu)
    interval = max(daly_interval_s(blocking, mtbf), save)  # an async save must finish before the next
    return Goodput(mtbf, SECONDS_PER_DAY / mtbf, nbytes, save, blocking, interval, restart,
                   ettr(interval, blocking, restart, mtbf), mfu)
