"""The Monte-Carlo simulator against the exact renewal model, and its two-tier and Weibull behaviour; the replica
groups' event replay against their model."""

from __future__ import annotations

import time

import pytest

from hpctrain.goodput.model import (
    CheckpointPolicy,
    Failures,
    Replicas,
    TierCost,
    daly_interval,
    expected_goodput,
    loss_split,
    mtbf_s,
    optimal_policy,
    replica_loss,
    replica_policy,
)
from hpctrain.goodput.model import availability as model_availability
from hpctrain.goodput.simulate import simulate, simulate_replicas

M = 3600.0
HORIZON = 400 * M

# (policy, failures, mean scheduler delay): synchronous saves; background writes with loads and node-surviving
# failures (no fast tier, so they change nothing); writes longer than the interval (skips) plus random delay
SINGLE_TIER = {
    "sync": (CheckpointPolicy(TierCost(60.0), daly_interval(60.0, M)), Failures(M, 0.0, 300.0), 0.0),
    "async": (CheckpointPolicy(TierCost(5.0, 400.0, 120.0), 600.0), Failures(M, 0.5, 300.0), 0.0),
    "skip+delay": (CheckpointPolicy(TierCost(20.0, 500.0), 200.0), Failures(M, 0.0, 200.0), 100.0),
}


@pytest.mark.parametrize("case", SINGLE_TIER)
def test_simulation_matches_exact_model_within_ci(case: str) -> None:
    policy, f, delay = SINGLE_TIER[case]
    exact = expected_goodput(policy, Failures(f.mtbf_s, f.p_fast, f.restart_s + delay))
    sim = simulate(policy, f, HORIZON, reps=100, seed=0, delay_mean_s=delay)
    assert abs(sim.goodput - exact) <= sim.ci95, (sim, exact)
    assert 0 < sim.ci95 < 0.005
    assert sim.goodput + sim.blocking + sim.lost_work + sim.restart == pytest.approx(1.0, abs=1e-9)


def test_weibull_shape_one_is_exponential() -> None:
    policy, f, _ = SINGLE_TIER["sync"]
    expo = simulate(policy, f, HORIZON, reps=100, seed=1)
    weib = simulate(policy, f, HORIZON, reps=100, seed=2, weibull_shape=1.0)
    assert abs(expo.goodput - weib.goodput) <= 1.5 * (expo.ci95 + weib.ci95)


@pytest.mark.parametrize("shape", [0.5, 1.5])
def test_weibull_keeps_the_mean_time_between_failures(shape: float) -> None:
    policy, f, _ = SINGLE_TIER["sync"]
    sim = simulate(policy, f, HORIZON, reps=50, seed=3, weibull_shape=shape)
    computing = HORIZON * (1 - sim.restart)  # failures strike only while the job computes
    assert sim.failures * M / computing == pytest.approx(1.0, abs=0.02)


def test_weibull_early_failures_lose_less_work() -> None:
    policy, f, _ = SINGLE_TIER["sync"]
    weib = simulate(policy, f, HORIZON, reps=50, seed=3, weibull_shape=0.5)
    expo = simulate(policy, f, HORIZON, reps=50, seed=3)
    assert weib.goodput - expo.goodput > 2 * (weib.ci95 + expo.ci95)  # many failures soon after a restart


def test_fast_tier_helps_in_simulation() -> None:
    f = Failures(M, 0.5, 300.0)
    both = optimal_policy(TierCost(60.0), f, TierCost(1.0))
    alone = optimal_policy(TierCost(60.0), f)
    sim_both = simulate(both, f, HORIZON, reps=100, seed=4)
    sim_alone = simulate(alone, f, HORIZON, reps=100, seed=4)
    assert sim_both.goodput - sim_alone.goodput > 0.02
    assert sim_both.goodput == pytest.approx(loss_split(both, f).goodput, abs=0.005)
    # node-losing failures only: the RAM tier never restores, so it is pure cost
    g = Failures(M, 0.0, 300.0)
    assert simulate(both, g, HORIZON, reps=100, seed=4).goodput < simulate(alone, g, HORIZON, reps=100, seed=4).goodput


def test_skipped_saves_follow_the_effective_interval() -> None:
    policy, f = CheckpointPolicy(TierCost(10.0, 150.0), 60.0), Failures(1e9, 0.0, 0.0)
    sim = simulate(policy, f, 1e6, reps=2, seed=0)
    assert sim.blocking == pytest.approx(10.0 / 190.0, rel=1e-3)  # every third due point: 180 s work + 10 s


def test_simulation_is_fast_at_scale() -> None:
    f = Failures(mtbf_s(0.001, 16384), 0.3, 300.0)
    policy = optimal_policy(TierCost(0.3, 61.0, 61.0), f, TierCost(0.3, 0.3, 0.3))
    started = time.perf_counter()
    sim = simulate(policy, f, 54 * 86400.0, reps=200, seed=0)
    assert time.perf_counter() - started < 10.0  # ~0.2 s here: 54 days, ~830 failures per run, 200 runs
    assert sim.failures == pytest.approx(54 * 86400.0 * (1 - sim.restart) / f.mtbf_s, rel=0.02)


# Replica groups at M = 1 h: spares (the group is back after 60 s, healed in 10 s); 4 groups of which a step needs
# 2, 5 min restarts; no spares (a node death keeps the group out for 30 min, until the requeue); DiLoCo, a 5 s sync
# every 20 steps. Saves are costly (20 s blocked) so that the checkpoint's part is visible.
REPLICAS = {
    "spares": Replicas(2, 5.0, 1.0, 60.0, 10.0),
    "4 groups, 2 needed": Replicas(4, 5.0, 2.0, 300.0, 20.0, min_replicas=2),
    "no spare": Replicas(2, 5.0, 1.0, 60.0, 10.0, p_spare=0.0, requeue_s=1800.0),
    "diloco": Replicas(2, 5.0, 1.0, 60.0, 10.0, sync_every=20, sync_s=5.0),
}


@pytest.mark.parametrize("case", REPLICAS)
def test_replica_simulation_matches_the_model(case: str) -> None:
    r, f = REPLICAS[case], Failures(M, 0.3, 300.0)
    policy = replica_policy(TierCost(20.0, 60.0, 60.0), f, r, TierCost(1.0, 1.0, 1.0))
    model = replica_loss(policy, f, r)
    sim = simulate_replicas(policy, f, r, HORIZON, reps=60, seed=0)
    assert 0 < sim.ci95 < 0.003
    if case == "no spare":  # the model takes the outages as exponential: a little pessimistic (8 seeds: +1.2..2.9 ci)
        assert 0 <= sim.goodput - model.goodput <= 4 * sim.ci95, (sim, model)
    else:
        assert abs(sim.goodput - model.goodput) <= 2 * sim.ci95, (sim, model)
    parts = ("blocking", "overhead", "stall", "out", "lost_work", "restart")
    assert sim.goodput + sum(getattr(sim, p) for p in parts) == pytest.approx(1.0, abs=1e-9)
    for p in ("stall", "out", "blocking"):
        assert getattr(sim, p) == pytest.approx(getattr(model, p), rel=0.1, abs=5e-4), p
    assert sim.failures * M / (HORIZON * (1 - sim.restart - sim.stall)) == pytest.approx(
        model_availability(r, f), rel=0.03
    )  # failures strike the groups in while the job runs


def test_replica_groups_beat_restarts_in_simulation() -> None:
    f = Failures(M, 0.3, 300.0)
    restart = optimal_policy(TierCost(20.0, 60.0, 60.0), f, TierCost(1.0, 1.0, 1.0))
    r = REPLICAS["spares"]
    groups = simulate_replicas(replica_policy(restart.slow, f, r, restart.fast), f, r, HORIZON, reps=30, seed=1)
    restarts = simulate(restart, f, HORIZON, reps=30, seed=1)
    assert groups.goodput - restarts.goodput > 0.1  # 300 s restarts and redone work every hour, against 1 group out
