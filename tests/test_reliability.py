"""Goodput model: Daly's published examples, agreement with a Monte Carlo of the same process (one kind of
failure, then every kind of interruption and recovery over a grid), Llama 3's reliability."""
import math
from dataclasses import replace

import pytest

from cost_models.goodput_simulation import Process, simulate_ettr
from cost_models.reliability import (Interruption, Recovery, StepContext, daly_interval_s, ettr, goodput,
                                     job_mtbf_s, young_interval_s)
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
    process = Process(tau, delta, (Interruption("failure", 1 / mtbf, 0.0, restart),), 1 / mtbf)
    simulated = simulate_ettr(process, useful_s=2000 * mtbf, seed=7)
    assert abs(analytic - simulated) < 0.01


def _cluster(nodes: int, hang_fraction: float, repair_h: float):
    cluster = cluster_from_device("h100-sxm", nodes * 8)
    reliability = cluster.reliability.model_copy(update={"hang_fraction": hang_fraction,
                                                         "node_repair_s": repair_h * HOUR})
    return cluster.model_copy(update={"reliability": reliability})


# nodes, share of hangs, repair hours, recovery: spares / waiting for the repair / elastic, timeouts, spikes
GRID = [
    (256, 0.10, 4, Recovery()),
    (2048, 0.10, 4, Recovery()),
    (2048, 0.30, 4, Recovery(collective_timeout_s=1800)),
    (2048, 0.02, 4, Recovery(loss_spikes_per_day=6)),
    (256, 0.10, 4, Recovery(spare_nodes=False)),
    (2048, 0.10, 1, Recovery(spare_nodes=False)),
    (256, 0.10, 4, Recovery(spare_nodes=False, elastic=True)),
    (2048, 0.10, 4, Recovery(spare_nodes=False, elastic=True)),
    (2048, 0.10, 12, Recovery(spare_nodes=False, elastic=True, collective_timeout_s=1800, loss_spikes_per_day=3)),
]


@pytest.mark.parametrize("nodes,hangs,repair_h,recovery", GRID)
def test_goodput_matches_monte_carlo_within_one_point(nodes, hangs, repair_h, recovery):
    """The closed form against an event-by-event simulation of the same process: detection delays (a crash,
    a hang at the collective timeout, corruption at the next replica check), restarts that failures restart,
    repairs waited for, elastic runs on fewer nodes with regrowing, rollbacks from loss spikes."""
    cluster = _cluster(nodes, hangs, repair_h)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True)
    model = goodput(cluster, nodes * 8, 405e9, mfu=0.4, recovery=recovery, context=context)
    process = Process.of(model, cluster.reliability.node_repair_s, nodes)
    simulated = simulate_ettr(process, useful_s=10000 * model.mtbf_s, seed=3)
    checks = model.lost_s_per_day.get("replica checks", 0.0)
    without_checks = model.ettr / (1 - checks / (checks + model.ettr * 86400)) if checks else model.ettr
    assert abs(without_checks - simulated) < 0.01


def test_lost_time_parts_add_up_to_the_wall_clock():
    cluster = _cluster(2048, 0.1, 4)
    model = goodput(cluster, 16384, 405e9, mfu=0.4, recovery=Recovery(loss_spikes_per_day=2),
                    context=StepContext(step_s=8.0, check_s=0.02, replicated=True))
    assert model.ettr * 86400 + sum(model.lost_s_per_day.values()) == pytest.approx(86400, rel=1e-9)
    # a hang costs the collective timeout before anything restarts: hangs arrive while the job runs (between
    # the useful share and all of the day), each costing the 300 s timeout
    hangs_per_day = 86400 / model.mtbf_s * 0.1
    assert hangs_per_day * 300 * model.ettr < model.lost_s_per_day["detection (hang)"] < hangs_per_day * 300


def test_what_recovery_choices_cost():
    """Orderings a reader can check without the model: a longer timeout, no spares, and sharded parameters
    (corruption unseen) each move ETTR the way they must."""
    cluster = _cluster(2048, 0.1, 4)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True)
    base = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(), context=context)
    slow_timeout = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(collective_timeout_s=1800), context=context)
    waiting = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(spare_nodes=False), context=context)
    elastic = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(spare_nodes=False, elastic=True),
                      context=context)
    assert slow_timeout.ettr < base.ettr and waiting.ettr < elastic.ettr < base.ettr
    sharded = goodput(cluster, 16384, 405e9, 0.4, context=StepContext(8.0, 0.02, replicated=False))
    assert "replica checks" not in sharded.lost_s_per_day
    assert any("goes unseen" in note for note in sharded.notes)
    # a check every step costs its read over the step time
    every = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(sdc_check_every_steps=1), context=context)
    assert every.lost_s_per_day["replica checks"] / 86400 == pytest.approx(
        0.02 / 8.02 * every.ettr / (1 - 0.02 / 8.02), rel=1e-6)
    assert math.isfinite(every.interval_s)


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


def _sdc_cluster(nodes: int, sdc_fraction: float):
    """A cluster whose interruptions are `sdc_fraction` silent corruption (Llama 3: 6 of 419; raised here so
    that the corruption's share of the loss is measurable against the Monte Carlo's noise)."""
    cluster = _cluster(nodes, 0.02, 4)
    reliability = cluster.reliability.model_copy(update={"sdc_fraction": sdc_fraction})
    return cluster.model_copy(update={"reliability": reliability})


@pytest.mark.parametrize("every,seen", [(100, 1.0), (1000, 0.3), (3000, 0.05)])
def test_corruption_found_by_product_checks_matches_monte_carlo(every, seen):
    """A defective device found at the product checks every N steps, each seeing it with chance p: the closed
    form's mean delay N s (1/p - 1/2) against a simulation that draws the checks (the first uniformly within an
    interval, then each a coin of p), within one point of ETTR."""
    cluster = _sdc_cluster(2048, 0.3)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True, product_check_s=0.5)
    recovery = Recovery(product_check_every_steps=every, sdc_seen_per_check=seen)
    model = goodput(cluster, 16384, 405e9, mfu=0.4, recovery=recovery, context=context)
    kind = next(kind for kind in model.kinds if kind.name == "silent corruption")
    assert kind.detection_s == pytest.approx(every * 8.0 * (1 / seen - 0.5))
    simulated = simulate_ettr(Process.of(model, cluster.reliability.node_repair_s, 2048),
                              useful_s=10000 * model.mtbf_s, seed=5)
    checks = sum(model.lost_s_per_day.get(name, 0.0) for name in ("replica checks", "product checks"))
    without_checks = model.ettr * 86400 / (86400 - checks)   # the checks' share is charged outside the process
    assert abs(without_checks - simulated) < 0.01


@pytest.mark.parametrize("check_s,seen", [(0.5, 1.0), (2.0, 0.3), (0.05, 0.8)])
def test_the_chosen_product_check_cadence_is_the_best_of_a_brute_force_sweep(check_s, seen):
    """`gemm_every` left to the model: its cadence N s = sqrt(c / (lambda (1/p - 1/2))) gives an ETTR no
    cadence of a sweep from 1 to 100,000 steps beats by more than 1e-5."""
    cluster = _sdc_cluster(2048, 0.05)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True, product_check_s=check_s)
    chosen = goodput(cluster, 16384, 405e9, 0.4, recovery=Recovery(sdc_seen_per_check=seen), context=context)
    sweep = [round(10 ** (exponent / 20)) for exponent in range(0, 101)]
    best = max(goodput(cluster, 16384, 405e9, 0.4, context=context,
                       recovery=Recovery(product_check_every_steps=every, sdc_seen_per_check=seen)).ettr
               for every in sweep)
    assert chosen.recovery.product_check_every_steps > 0
    assert chosen.ettr > best - 1e-5


def test_without_product_checks_a_plan_says_what_finds_corruption():
    cluster = _cluster(2048, 0.1, 4)
    unpriced = goodput(cluster, 16384, 405e9, 0.4, context=StepContext(8.0, 0.02, replicated=True))
    assert unpriced.recovery.product_check_every_steps == 0 and "product checks" not in unpriced.lost_s_per_day
    assert any("replica checks, which see parameters changed in memory only" in note for note in unpriced.notes)


@pytest.mark.parametrize("every,seen,share", [(200, 1.0, 0.3), (2000, 0.2, 0.5)])
def test_corruption_in_optimizer_updates_found_by_its_checks_matches_monte_carlo(every, seen, share):
    """A share q of a defective device's corruption lands in the optimizer's update (ZeRO-1: its owner's alone),
    found by the optimizer checks every N_o steps, each seeing it with chance p_o: its mean delay
    N_o s (1/p_o - 1/2), and the closed form against a simulation that draws both kinds' checks, within a point."""
    cluster = _sdc_cluster(2048, 0.3)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True, product_check_s=0.5, optimizer_check_s=0.05)
    recovery = Recovery(product_check_every_steps=500, optimizer_check_every_steps=every,
                        optimizer_seen_per_check=seen, optimizer_sdc_share=share)
    model = goodput(cluster, 16384, 405e9, mfu=0.4, recovery=recovery, context=context)
    kinds = {kind.name: kind for kind in model.kinds}
    updates, products = kinds["silent corruption (optimizer update)"], kinds["silent corruption"]
    assert updates.detection_s == pytest.approx(every * 8.0 * (1 / seen - 0.5))
    assert updates.per_s / (updates.per_s + products.per_s) == pytest.approx(share)
    simulated = simulate_ettr(Process.of(model, cluster.reliability.node_repair_s, 2048),
                              useful_s=10000 * model.mtbf_s, seed=11)
    checks = sum(model.lost_s_per_day.get(name, 0.0) for name in ("replica checks", "product checks",
                                                                   "optimizer checks"))
    assert "optimizer checks" in model.lost_s_per_day
    assert abs(model.ettr * 86400 / (86400 - checks) - simulated) < 0.01


@pytest.mark.parametrize("check_s,seen", [(0.05, 1.0), (0.5, 0.2)])
def test_the_chosen_optimizer_check_cadence_is_the_best_of_a_brute_force_sweep(check_s, seen):
    """`opt_every` left to the model: no cadence of a sweep from 1 to 100,000 steps beats it by more than 1e-5."""
    cluster = _sdc_cluster(2048, 0.05)
    context = StepContext(step_s=8.0, check_s=0.02, replicated=True, product_check_s=0.5, optimizer_check_s=check_s)
    base = Recovery(product_check_every_steps=500, optimizer_seen_per_check=seen, optimizer_sdc_share=0.2)
    chosen = goodput(cluster, 16384, 405e9, 0.4, recovery=base, context=context)
    sweep = [round(10 ** (exponent / 20)) for exponent in range(0, 101)]
    best = max(goodput(cluster, 16384, 405e9, 0.4, context=context,
                       recovery=replace(base, optimizer_check_every_steps=every)).ettr for every in sweep)
    assert chosen.recovery.optimizer_check_every_steps > 0
    assert chosen.ettr > best - 1e-5


def test_who_finds_corruption_in_the_update_depends_on_who_computes_it():
    """ZeRO-0: every replica computes the update, and the replica check (every N_r steps, N_r s / 2 late) sees
    the defective one differ; ZeRO-1/2/3 without optimizer checks: the owner's wrong update is every replica's,
    nothing sees it, and the plan says so."""
    cluster = _sdc_cluster(2048, 0.3)
    replicated = StepContext(step_s=8.0, check_s=0.02, replicated=True, product_check_s=0.5, sharded_update=False)
    recovery = Recovery(product_check_every_steps=500, optimizer_sdc_share=0.3)
    zero0 = goodput(cluster, 16384, 405e9, 0.4, recovery=recovery, context=replicated)
    kind = next(kind for kind in zero0.kinds if kind.name == "silent corruption (optimizer update)")
    assert kind.detection_s == pytest.approx(Recovery().sdc_check_every_steps * 8.0 / 2)
    assert zero0.recovery.optimizer_check_every_steps == 0
    sharded = replace(replicated, sharded_update=True)
    unchecked = goodput(cluster, 16384, 405e9, 0.4, context=sharded,
                        recovery=replace(recovery, optimizer_check_every_steps=0))
    assert not any(kind.name == "silent corruption (optimizer update)" for kind in unchecked.kinds)
    assert any("no optimizer checks, so it goes unseen" in note for note in unchecked.notes)
