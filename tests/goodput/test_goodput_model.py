"""The analytic model against hand-computed cases, Young/Daly, and numeric minimisation; replica groups."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import numpy as np
import pytest

from hpctrain.goodput.model import (
    CheckpointPolicy,
    Failures,
    Replicas,
    TierCost,
    all_out_mtbf_s,
    availability,
    back_share,
    daly_interval,
    effective_interval,
    expected_goodput,
    goodput_exact,
    goodput_first_order,
    group_outage_s,
    groups_in,
    loss_split,
    mtbf_s,
    optimal_policy,
    replica_loss,
    replica_overhead,
    replica_policy,
    replica_throughput,
    young_interval,
)


def test_mtbf_hand_computed() -> None:
    assert mtbf_s(0.001, 16384) == pytest.approx(5273.4375)  # 86400 / 16.384: Llama 3 reports ~1.8 h
    assert mtbf_s(0.01, 1) == pytest.approx(8.64e6)  # one failure per 100 days
    assert math.isinf(mtbf_s(0.0, 1024))


def test_young_and_daly_hand_computed() -> None:
    assert young_interval(60, 3600) == pytest.approx(657.267, rel=1e-5)  # sqrt(432000)
    # sqrt(432000) * (1 + sqrt(1/120)/3 + 60/64800) - 60
    assert daly_interval(60, 3600) == pytest.approx(617.876, rel=1e-5)
    assert daly_interval(8000, 3600) == 3600  # C >= 2M: checkpoint once per MTBF


def test_exact_form_hand_computed() -> None:
    # 600 / (3900 * (e^(660/3600) - 1)) = 600 / (3900 * 0.2012147)
    assert goodput_exact(600, 60, 3600, 300) == pytest.approx(0.764587, rel=1e-5)
    # a background write of 360 s multiplies by e^(-0.1)
    assert goodput_exact(600, 60, 3600, 300, 360) == pytest.approx(0.764587 * 0.904837, rel=1e-5)
    assert goodput_first_order(600, 60, 3600, 300) == pytest.approx(1 - 0.1 - 600 / 3600, rel=1e-9)


@pytest.mark.parametrize("c, tau, m, r", [(0.1, 100.0, 1e6, 10.0), (1.0, 600.0, 1e7, 120.0), (0.5, 30.0, 1e6, 0.0)])
def test_exact_and_first_order_agree_when_small(c: float, tau: float, m: float, r: float) -> None:
    exact, first = goodput_exact(tau, c, m, r), goodput_first_order(tau, c, m, r)
    assert abs(exact - first) < 2 * (c / tau) ** 2 + 2 * ((tau + c + r) / m) ** 2
    assert 1 - exact > 0.5 * c / tau  # the loss is there, not a trivial 1 == 1


def test_first_order_and_exact_differ_when_not_small() -> None:
    assert goodput_exact(1800, 60, 3600, 300) - goodput_first_order(1800, 60, 3600, 300) > 0.04


def _argmax(f, lo: float, hi: float) -> float:
    taus = np.geomspace(lo, hi, 20001)
    return float(taus[int(np.argmax([f(t) for t in taus]))])


@pytest.mark.parametrize("c, m", [(60.0, 3600.0), (10.0, 20000.0), (600.0, 3600.0)])
def test_intervals_minimise_the_waste(c: float, m: float) -> None:
    # Young minimises the first-order waste, Daly the exact one (closer than Young as C/M grows)
    assert _argmax(lambda t: goodput_first_order(t, c, m, 300), 1, 10 * m) == pytest.approx(
        young_interval(c, m), rel=1e-3
    )
    best = _argmax(lambda t: goodput_exact(t, c, m, 300), 1, 10 * m)
    assert daly_interval(c, m) == pytest.approx(best, rel=2e-3)
    assert abs(daly_interval(c, m) - best) < abs(young_interval(c, m) - best)


def test_effective_interval_skips_busy_saves() -> None:
    assert effective_interval(600, 400) == 600
    assert effective_interval(60, 150) == 180  # saves at due points 1, 4, 7, ...
    assert goodput_exact(60, 1, 3600, 0, 150) == goodput_exact(180, 1, 3600, 0, 150)


def test_two_tier_closed_form_matches_numeric_minimum() -> None:
    slow, fast, f = TierCost(30.0), TierCost(2.0), Failures(1e5, 0.3, 0.0)
    taus = np.geomspace(100, 20000, 300)
    _, tau_f, tau_s = min(
        (loss_split(CheckpointPolicy(slow, ts, fast, tf), f).total, tf, ts) for tf in taus for ts in taus
    )
    policy = optimal_policy(slow, f, fast, young_interval)
    assert policy.tau_fast_s == pytest.approx(math.sqrt(2 * 2.0 * 1e5 / 0.3))  # Young with M_f = M / p
    assert policy.tau_slow_s == pytest.approx(math.sqrt(2 * 30.0 * 1e5 / 0.7))  # Young with M_s = M / (1 - p)
    step = taus[1] / taus[0]
    assert policy.tau_fast_s == pytest.approx(tau_f, rel=2 * (step - 1))
    assert policy.tau_slow_s == pytest.approx(tau_s, rel=2 * (step - 1))


def test_fast_tier_kept_only_when_it_pays() -> None:
    f = Failures(3600.0, 0.5, 300.0)
    cheap = optimal_policy(TierCost(60.0), f, TierCost(1.0))
    assert cheap.fast is not None and cheap.tau_fast_s < cheap.tau_slow_s
    alone = optimal_policy(TierCost(60.0), f)
    assert loss_split(cheap, f).total < loss_split(alone, f).total - 0.02
    # same blocking cost and no write: the durable tier saved more often is as good, so no fast tier
    assert optimal_policy(TierCost(1.0), f, TierCost(1.0)).fast is None
    assert optimal_policy(TierCost(60.0), Failures(3600.0, 0.0, 300.0), TierCost(1.0)).fast is None


def test_loss_split_is_close_to_exact_for_one_tier() -> None:
    policy, f = CheckpointPolicy(TierCost(60.0), 618.0), Failures(3600.0, 0.0, 300.0)
    loss = loss_split(policy, f)
    assert loss.goodput == pytest.approx(expected_goodput(policy, f), abs=0.005)
    assert loss.goodput - goodput_first_order(618.0, 60.0, 3600.0, 300.0) > 0.02  # per cycle, not per M
    assert loss.dominant in ("blocking", "lost work", "restarts")


def test_the_queue_wait_is_paid_only_by_failures_that_leave_the_allocation() -> None:
    from hpctrain.goodput.model import goodput_exact, restart_cost

    assert restart_cost(300.0) == 300.0
    assert restart_cost(300.0, 3600.0) == 3900.0
    assert restart_cost(300.0, 3600.0, p_stay=1.0, in_allocation_s=10.0) == 10.0
    assert abs(restart_cost(300.0, 3600.0, p_stay=0.3, in_allocation_s=10.0) - (3.0 + 0.7 * 3900.0)) < 1e-9
    # 16,384 GPUs at 0.1%/GPU/day (MTBF 1.46 h), a 1 min interval, 2 s blocked per save: a 1 h queue wait on
    # every failure costs over a third of the run; recovering inside the allocation keeps it above 95%.
    m = 86400 / (0.001 * 16384)
    queued = goodput_exact(60.0, 2.0, m, restart_cost(300.0, 3600.0))
    stays = goodput_exact(60.0, 2.0, m, restart_cost(300.0, 3600.0, p_stay=1.0, in_allocation_s=10.0))
    assert queued < 0.6 < 0.95 < stays


# Replica groups (recovery=replicas|diloco): R = 2 groups at M = 3600 s, so each fails at lam = 1/7200; an outage
# of 720 s (mu = 10 lam). The chain: P2 2 lam = P1 (mu + lam), so P1 : P2 = 2 : 11.
ONE_TIER = CheckpointPolicy(TierCost(0.0), 600.0)  # free saves every 10 min: a restart redoes 300 s
TWO_GROUPS = Replicas(groups=2, step_s=4.0, detect_s=1.0, group_restart_s=720.0, heal_s=10.0, quorum_s=0.0)
AT_SCALE = Failures(3600.0, 0.0, 300.0)


def test_groups_in_hand_computed() -> None:
    assert groups_in(TWO_GROUPS, AT_SCALE) == pytest.approx([0.0, 2 / 13, 11 / 13])
    assert replica_throughput(TWO_GROUPS, AT_SCALE) == pytest.approx(12 / 13)  # P2 + P1 / 2
    assert availability(TWO_GROUPS, AT_SCALE) == pytest.approx(12 / 13)
    assert all_out_mtbf_s(TWO_GROUPS, AT_SCALE) == pytest.approx(46800.0)  # 1 / (P1 lam)
    # a step needs both groups: only P2 trains
    assert replica_throughput(replace(TWO_GROUPS, min_replicas=2), AT_SCALE) == pytest.approx(11 / 13)
    # no failures: every group always in
    assert groups_in(TWO_GROUPS, Failures(math.inf)) == [0.0, 0.0, 1.0]


def test_replica_loss_hand_computed() -> None:
    # per 46,800 s of running time: 12 failures, 1 of them the last group in (a restart of 300 s, 300 s redone),
    # 11 pausing the other group for 1 s detection + 2 s (half a step) + 10 s heal; 1/13 of the time a group is out
    loss = replica_loss(ONE_TIER, AT_SCALE, TWO_GROUPS)
    denom = 46800 + 11 * 13 + 300
    assert loss.goodput == pytest.approx((43200 - 300) / denom)
    assert (loss.out, loss.stall, loss.restart, loss.lost_work) == pytest.approx(
        (3600 / denom, 143 / denom, 300 / denom, 300 / denom)
    )
    assert loss.blocking == loss.overhead == 0.0 and loss.dominant == "groups out"
    assert loss.goodput + loss.total == pytest.approx(1.0)


def test_one_group_is_a_restart() -> None:
    """One replica group: every failure loses the last group in, so replica_loss is loss_split."""
    policy = CheckpointPolicy(TierCost(60.0, 30.0, 20.0), 618.0, TierCost(1.0, 1.0, 1.0), 120.0)
    f = Failures(3600.0, 0.3, 300.0)
    one = Replicas(groups=1, step_s=4.0, detect_s=5.0, heal_s=50.0, quorum_s=0.0)
    assert asdict(replica_loss(policy, f, one)) == pytest.approx(asdict(loss_split(policy, f)))


def test_overheads_and_diloco_hand_computed() -> None:
    quorum = replace(TWO_GROUPS, quorum_s=0.004, sync_s=0.996)  # 1 s per 4 s step
    assert replica_overhead(quorum) == pytest.approx(0.2)
    diloco = replace(TWO_GROUPS, sync_every=20, sync_s=1.0, quorum_s=0.0)
    assert replica_overhead(diloco) == pytest.approx(1 / 81)
    # no failures: only the overhead is lost
    assert replica_loss(ONE_TIER, Failures(math.inf), diloco).goodput == pytest.approx(80 / 81)
    # DiLoCo: no half step of every group per failure, but the failed group's 40 s since the last sync, of 1/2
    loss = replica_loss(ONE_TIER, AT_SCALE, diloco)
    denom = 46800 + 11 * 11 + 300
    assert loss.stall == pytest.approx(11 * 11 / denom)
    assert loss.lost_work == pytest.approx((300 + 11 * 20 * 80 / 81) / denom)


def test_a_group_without_a_spare_is_out_until_the_requeue() -> None:
    no_spare = replace(TWO_GROUPS, p_spare=0.0, requeue_s=7200.0)
    assert group_outage_s(no_spare, Failures(3600.0, 0.25, 300.0)) == pytest.approx(0.25 * 720 + 0.75 * 7200)
    assert back_share(no_spare, Failures(3600.0, 0.25, 300.0)) == 0.25  # only failures that left the nodes usable
    # p_fast = 0: out for 7200 s, mu = lam, so P1 = P2 = 1/2 and the job runs at 3/4; per 14,400 s of running time
    # 3 failures, 1 losing both groups (300 s restart, 300 s redone), 2 pausing the other for 1 s + 2 s, no heal
    worse = replica_loss(ONE_TIER, AT_SCALE, no_spare)
    denom = 14400 + 2 * 3 + 300
    assert (worse.out, worse.stall, worse.restart, worse.lost_work) == pytest.approx(
        (3600 / denom, 6 / denom, 300 / denom, 300 / denom)
    )


def test_checkpoints_for_replica_groups_cover_only_the_loss_of_every_group() -> None:
    slow, f = TierCost(1.2, 61.0, 61.0), Failures(mtbf_s(0.001, 16384), 0.3, 300.0)
    groups = Replicas(groups=2, step_s=5.0, group_restart_s=10.0, heal_s=0.5)
    mine, restart = replica_policy(slow, f, groups), optimal_policy(slow, f)
    assert mine.tau_slow_s == pytest.approx(daly_interval(1.2, all_out_mtbf_s(groups, f)))
    assert mine.tau_slow_s > 30 * restart.tau_slow_s
    # 16,384 GPUs, a failure every 1.46 h, 300 s restarts: restart mode loses 8 points, replicas under 1
    assert loss_split(restart, f).goodput < 0.93 < 0.99 < replica_loss(mine, f, groups).goodput
