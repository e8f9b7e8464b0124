"""Goodput model: Daly's published examples, agreement with a Monte Carlo, Llama 3's reliability."""
import pytest

from cost_models.reliability import (daly_interval_s, ettr, goodput, job_mtbf_s, simulate_ettr,
                                     young_interval_s)
from hardware_profiles import cluster_from_device

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize("mtbf,expected_min", [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MIN, 9.1)])
def test_daly_worked_examples(mtbf, expected_min):
    # Daly 2006 abstract: delta = 5 min, R = 10 min
    assert daly_interval_s(5 * MIN, mtbf) / MIN == pytest.approx(expected_min, abs=0.5 if expected_min > 10 else 0.1)


def test_young_is_first_order_daly():
    assert young_interval_s(5 * MIN, 24 * HOUR) == pytest.approx((2 * 5 * MIN * 24 * HOUR) ** 0.5)
    assert daly_interval_s(5 * MIN, 24 * HOUR) < young_interval_s(5 * MIN, 24 * HOUR) * 1.05


@pytest.mark.parametrize("mtbf_h,delta_min,restart_min", [
    (3.1, 1, 10), (3.1, 5, 10), (24, 5, 10), (6, 5, 10), (1, 2, 5), (12, 10, 30), (0.5, 0.5, 2),
])
def test_ettr_matches_monte_carlo_within_one_point(mtbf_h, delta_min, restart_min):
    mtbf, delta, restart = mtbf_h * HOUR, delta_min * MIN, restart_min * MIN
    tau = daly_interval_s(delta, mtbf)
    analytic = ettr(tau, delta, restart, mtbf)
    simulated = simulate_ettr(tau, delta, restart, mtbf, useful_s=2000 * mtbf, seed=7)
    assert abs(analytic - simulated) < 0.01


def test_llama3_reliability():
    # 16,384 H100; 419 unexpected interruptions in 54 days (HF Table 3) -> ~3.1 h between them
    cluster = cluster_from_device("h100-sxm", 16384)
    mtbf = job_mtbf_s(cluster, 16384)
    assert mtbf / HOUR == pytest.approx(54 * 24 / 419, rel=0.02)
    # checkpoint: 405B parameters of states to Tectonic at 2 TB/s sustained (HF [^25]); restart 10 min (Daly R)
    storage = cluster.storage.model_copy(update={"checkpoint_write_gbytes_per_s": 2000})
    reliability = cluster.reliability.model_copy(update={"restart_s": 600, "rewarm_s": 0})
    meta = cluster.model_copy(update={"storage": storage, "reliability": reliability})
    result = goodput(meta, 16384, 405e9, mfu=0.40, asynchronous=False)
    assert result.ettr > 0.90
    assert result.goodput == pytest.approx(0.40 * result.ettr)
    assert result.interruptions_per_day == pytest.approx(419 / 54, rel=0.02)


def test_restart_reads_the_checkpoint_back():
    """A restart pays its fixed time plus reading the last checkpoint at the storage's read bandwidth
    (profile field checkpoint_read_gbytes_per_s), every rank its shard."""
    cluster = cluster_from_device("h100-sxm", 1024)
    storage = cluster.storage.model_copy(update={"checkpoint_read_gbytes_per_s": 100.0})
    slow = cluster.model_copy(update={"storage": storage})
    result = goodput(slow, 1024, 70e9, mfu=0.4)
    fixed = cluster.reliability.restart_s + cluster.reliability.rewarm_s
    assert result.restart_s == pytest.approx(fixed + result.checkpoint_bytes / 100e9, rel=1e-12)
    assert goodput(cluster, 1024, 70e9, mfu=0.4).restart_s < result.restart_s
