"""Analytic goodput of a periodic checkpoint policy under random failures (pure functions, no torch).

Goodput is the share of wall-clock time that ends up as training progress. Wall time goes to useful work,
to training blocked by saves, to work redone after a failure (done since the newest usable checkpoint), and
to restarts. All times are seconds. Failures arrive at rate 1/M while the job computes (training or saving);
the restart itself (requeue, start, init, load, warm-up) is assumed not to fail, which is optimistic by a
factor of about e^{R/M} on the restart term (Daly's model lets it fail). See docs/goodput.md.

Two tiers: a *fast* node-local tier (RAM, local SSD), lost with the node, so usable only after the share
`p_fast` of failures that leave every node usable (process crash, NCCL timeout, preemption with restart on the
same nodes), and a *slow* durable tier (shared file system) that recovers every failure.

Two recovery modes (cfg.recovery.mode). restart: a failure restarts every rank and redoes the work since the
newest usable checkpoint (`loss_split`, `expected_goodput`). replicas and diloco: the job is R replica groups
under torchft; a failure takes one group out while the others train on, and the group rejoins healed from a
live peer (`Replicas`, `replica_loss`); only the loss of every group at once goes back to a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TierCost:
    """What one save of a tier costs.

    blocked_s: time training stops per save (DCP staging into host memory; the whole write if synchronous).
    write_s: background write after staging until the checkpoint is committed (0 for a synchronous save).
    load_s: time to read it back at a restart (added to the restart cost when this tier is restored).
    """

    blocked_s: float
    write_s: float = 0.0
    load_s: float = 0.0


@dataclass(frozen=True)
class Failures:
    """The failure environment of a job: mean time between failures, their kind, the restart cost."""

    mtbf_s: float
    p_fast: float = 0.0  # share of failures after which the fast (node-local) tier is still usable
    restart_s: float = 0.0  # requeue delay + start + init + warm-up, without the checkpoint load


@dataclass(frozen=True)
class CheckpointPolicy:
    """A checkpoint policy: the durable tier every tau_slow_s of work, optionally a fast tier every tau_fast_s."""

    slow: TierCost
    tau_slow_s: float
    fast: TierCost | None = None
    tau_fast_s: float = math.inf


@dataclass(frozen=True)
class Loss:
    """Fractions of wall time lost to blocking saves, to redone work and to restarts; with replica groups also
    to the per-step quorum (and DiLoCo's outer sync), to the live groups' pauses after a failure (detection, the
    step in flight, a rejoining group's heal) and to groups being out (the job trains at k/R of its rate)."""

    blocking: float
    lost_work: float
    restart: float
    overhead: float = 0.0
    stall: float = 0.0
    out: float = 0.0

    @property
    def total(self) -> float:
        return self.blocking + self.lost_work + self.restart + self.overhead + self.stall + self.out

    @property
    def goodput(self) -> float:
        return max(0.0, 1.0 - self.total)

    @property
    def dominant(self) -> str:
        parts = {
            "blocking": self.blocking,
            "lost work": self.lost_work,
            "restarts": self.restart,
            "quorum/sync": self.overhead,
            "stalls": self.stall,
            "groups out": self.out,
        }
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True)
class Replicas:
    """Recovery across R replica groups (recovery=replicas|diloco, torchft): what one group's failure costs.

    A failure takes one group out; the live groups pause for `detect_s` (their quorum drops the group after the
    lighthouse's heartbeat timeout, or a collective's timeout where a dead node's connections do not reset) and,
    with a per-step sync, redo the step in flight (half a step on average). The group restarts in the allocation
    (`group_restart_s`: start, init, warm-up; no checkpoint load) while the others train on, then rejoins: its
    state comes from a live peer (`heal_s`) and the live groups' step waits for that transfer. A node-losing
    failure needs a spare node (`p_spare` of them find one); a group that finds none stays out for `requeue_s`,
    until the job's next requeue. With DiLoCo (`sync_every` H > 1) the groups sync every H steps: a failure
    loses the group's own steps since the last sync (H/2 on average), not a step of every group. Each sync costs
    `quorum_s` (torchft's quorum round trip) and `sync_s`, its exposed all-reduce across the groups: DiLoCo's
    outer step, or with a per-step sync the part of the gradients' all-reduce across groups that does not hide
    behind the backward pass (0 on one cluster's fabric; seconds between sites, which is what DiLoCo is for).
    """

    groups: int
    step_s: float
    detect_s: float = 1.0
    group_restart_s: float = 10.0
    heal_s: float = 0.0
    quorum_s: float = 0.002
    min_replicas: int = 1
    p_spare: float = 1.0
    requeue_s: float = 21600.0
    sync_every: int = 1
    sync_s: float = 0.0


def mtbf_s(rate_per_gpu_day: float, n_gpus: int) -> float:
    """Job MTBF with independent exponential GPU failures: any GPU failing stops the job, so rates add."""
    if rate_per_gpu_day <= 0:
        return math.inf
    return SECONDS_PER_DAY / (rate_per_gpu_day * n_gpus)


def restart_cost(
    resubmit_s: float, queue_wait_s: float = 0.0, p_stay: float = 0.0, in_allocation_s: float = 0.0
) -> float:
    """Mean restart cost R when a share `p_stay` of failures is recovered inside the allocation
    (`in_allocation_s` each: the agents restart the workers) and the rest leave it: a resubmission
    (`resubmit_s`) that waits `queue_wait_s` in the queue first. On a busy cluster the queue wait, not the
    checkpoint, decides the goodput of a job that leaves its allocation on every failure."""
    return p_stay * in_allocation_s + (1.0 - p_stay) * (resubmit_s + queue_wait_s)


def young_interval(c: float, m: float) -> float:
    """Young (1974): tau = sqrt(2 C M), the exact minimiser of the first-order waste C/tau + tau/(2M)."""
    return math.sqrt(2.0 * c * m)


def daly_interval(c: float, m: float) -> float:
    """Daly (2006) higher-order optimum of the exponential model, accurate up to C ~ M; M itself for C >= 2M."""
    if math.isinf(m):
        return math.inf
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def effective_interval(tau: float, write_s: float) -> float:
    """The interval that happens: a save whose background write still runs at the next due point is skipped,
    so saves start every ceil(W / tau) due points."""
    if write_s <= tau or math.isinf(tau):
        return tau
    return tau * math.ceil(write_s / tau - 1e-12)


def goodput_first_order(tau: float, c: float, m: float, r: float, w: float = 0.0) -> float:
    """1 - [C/tau + (tau/2 + W + R)/M]: each failure redoes half an interval on average plus the commit lag W
    (a failure during a background write falls back one more checkpoint), then pays the restart."""
    tau = effective_interval(tau, w)
    return max(0.0, 1.0 - c / tau - (tau / 2.0 + w + r) / m)


def goodput_exact(tau: float, c: float, m: float, r: float, w: float = 0.0) -> float:
    """Renewal-reward goodput for exponential failures: tau e^{-W/M} / ((M + R)(e^{(tau + C)/M} - 1)).

    Between restarts the job runs an exponential time X (mean M), then pays R. Checkpoint k is committed at
    k (tau + C) + W, so a cycle keeps tau * #{k >= 1 : k (tau + C) + W <= X}, whose mean is
    tau e^{-W/M} / (e^{(tau + C)/M} - 1); a cycle lasts M + R on average. With W = 0 this is the expected
    time (M + R)(e^{(tau + C)/M} - 1) to get one segment tau + C through, divided into tau.
    """
    tau = effective_interval(tau, w)
    if math.isinf(tau):
        return 0.0
    if math.isinf(m):
        return tau / (tau + c)
    return tau * math.exp(-w / m) / ((m + r) * math.expm1((tau + c) / m))


def loss_split(policy: CheckpointPolicy, failures: Failures) -> Loss:
    """Loss split of a one- or two-tier policy, first order in tau/M, counted per failure cycle.

    A cycle is M of computing (failures strike only then) plus the restart R' = R + load, so the fractions
    are per M + R' of wall time rather than per M as in `goodput_first_order`; both agree to first order, but
    this one stays close to the exact renewal form when R is not small against M (restarts dominate at scale).
    Blocking: a share C/(tau + C) of computing time per tier. A failure the fast tier survives redoes the age
    of the newest committed checkpoint of either tier, ~ min(tau_f/2 + W_f, tau_s/2 + W_s); any other redoes
    ~ tau_s/2 + W_s. Restart: R plus the load of the tier restored from.
    """
    busy, lost, load = _policy_costs(policy, failures.p_fast)
    m = failures.mtbf_s
    if math.isinf(m):
        return Loss(busy, 0.0, 0.0)
    restart = failures.restart_s + load
    cycle = m + restart
    return Loss(busy * m / cycle, lost / cycle, restart / cycle)


def _policy_costs(policy: CheckpointPolicy, p_fast: float) -> tuple[float, float, float]:
    """A policy's blocked share of computing time, and the work redone and the load paid by a restart from it."""
    tau_s = effective_interval(policy.tau_slow_s, policy.slow.write_s)
    busy = policy.slow.blocked_s / (tau_s + policy.slow.blocked_s)
    lost = tau_s / 2.0 + policy.slow.write_s
    load = policy.slow.load_s
    if policy.fast is not None and not math.isinf(policy.tau_fast_s):
        tau_f = effective_interval(policy.tau_fast_s, policy.fast.write_s)
        busy += policy.fast.blocked_s / (tau_f + policy.fast.blocked_s)
        lost_fast = tau_f / 2.0 + policy.fast.write_s
        load_fast = policy.fast.load_s if lost_fast < lost else policy.slow.load_s
        lost = p_fast * min(lost_fast, lost) + ((1.0 - p_fast) * lost if p_fast < 1.0 else 0.0)
        load = p_fast * load_fast + (1.0 - p_fast) * policy.slow.load_s
    return busy, lost, load


def expected_goodput(policy: CheckpointPolicy, failures: Failures) -> float:
    """Exact renewal-reward goodput for a one-tier policy; `loss_split` for two tiers, which have no simple exact
    form (after a fast restart the durable position lags behind, so cycles are not independent)."""
    if policy.fast is None or math.isinf(policy.tau_fast_s):
        return goodput_exact(
            policy.tau_slow_s,
            policy.slow.blocked_s,
            failures.mtbf_s,
            failures.restart_s + policy.slow.load_s,
            policy.slow.write_s,
        )
    return loss_split(policy, failures).goodput


IntervalRule = Callable[[float, float], float]


def optimal_policy(
    slow: TierCost, failures: Failures, fast: TierCost | None = None, rule: IntervalRule = daly_interval
) -> CheckpointPolicy:
    """Intervals per tier in closed form, each tier covering the failures only it can recover.

    The first-order two-tier waste C_f/tau_f + p tau_f/(2M) + C_s/tau_s + (1-p) tau_s/(2M) + const separates,
    so tau_f = rule(C_f, M/p) and tau_s = rule(C_s, M/(1-p)) (Young exactly; Daly as its higher-order
    extension). An interval shorter than the tier's write time would only skip saves, so it is raised to W.
    The fast tier is kept only if it lowers the waste (`loss_split`) against the durable tier alone (tuned with
    all failures, M): with equal blocking costs the durable tier saved more often is as good.
    """
    m = failures.mtbf_s
    alone = CheckpointPolicy(slow, max(rule(slow.blocked_s, m), slow.write_s))
    p = failures.p_fast
    if fast is None or p <= 0.0:
        return alone
    m_slow = m / (1.0 - p) if p < 1.0 else math.inf
    both = CheckpointPolicy(
        slow, max(rule(slow.blocked_s, m_slow), slow.write_s), fast, max(rule(fast.blocked_s, m / p), fast.write_s)
    )
    return both if loss_split(both, failures).total < loss_split(alone, failures).total else alone


def back_share(replicas: Replicas, failures: Failures) -> float:
    """The share of failures after which the group comes back in the allocation: its nodes survived (p_fast) or
    a spare node took the dead one's place."""
    return failures.p_fast + (1.0 - failures.p_fast) * replicas.p_spare


def group_outage_s(replicas: Replicas, failures: Failures) -> float:
    """Mean time a failed group is out: its restart in the allocation, or until the requeue without a spare.

    The requeue bound is an upper bound: the loss of every group requeues the job sooner (`groups_in`)."""
    back = back_share(replicas, failures)
    return back * replicas.group_restart_s + ((1.0 - back) * replicas.requeue_s if back < 1.0 else 0.0)


def groups_in(replicas: Replicas, failures: Failures) -> list[float]:
    """P(k groups in) over running time, k = 0..R (0 has none: the job is then restarting, not running).

    A chain over k: each group in fails at 1/(R M) (the job's GPUs are split among R groups), each group out
    comes back at 1/outage (the outage taken as exponential with its mean), and the loss of the last group in
    brings every group back with the job's restart. Its cut equations (flow from {1..j} up = flow down) give
    p[j+1] (j+1) lam = p[j] (R - j) mu + p[1] lam, solved from p[1] and normalised.
    """
    r, m = replicas.groups, failures.mtbf_s
    outage = group_outage_s(replicas, failures)
    if math.isinf(m) or outage <= 0.0:
        return [0.0] * r + [1.0]
    lam, mu = 1.0 / (r * m), 1.0 / outage
    p = [0.0, 1.0]
    for j in range(1, r):
        p.append((p[j] * (r - j) * mu + p[1] * lam) / ((j + 1) * lam))
    total = sum(p)
    return [x / total for x in p]


def availability(replicas: Replicas, failures: Failures) -> float:
    """Mean share of the groups in while the job runs."""
    return sum(p * k for k, p in enumerate(groups_in(replicas, failures))) / replicas.groups


def replica_throughput(replicas: Replicas, failures: Failures) -> float:
    """Mean share of the job's rate while it runs: k of R groups train at k/R, and none when fewer than
    min_replicas are in (the quorum waits)."""
    r = replicas.groups
    return sum(p * k / r for k, p in enumerate(groups_in(replicas, failures)) if k >= replicas.min_replicas)


def all_out_mtbf_s(replicas: Replicas, failures: Failures) -> float:
    """Mean running time between losses of every group (the last one in fails): no live peer is left to heal
    from, so the job requeues and goes back to a checkpoint. This, not M, is what the checkpoints are for."""
    if math.isinf(failures.mtbf_s):
        return math.inf
    rate = groups_in(replicas, failures)[1] / (replicas.groups * failures.mtbf_s)
    return math.inf if rate <= 0.0 else 1.0 / rate


def replica_overhead(replicas: Replicas) -> float:
    """Share of the training time in the quorum round trip and DiLoCo's outer sync, once per H steps."""
    per_sync = replicas.quorum_s + replicas.sync_s
    return per_sync / (replicas.sync_every * replicas.step_s + per_sync)


def replica_loss(policy: CheckpointPolicy, failures: Failures, replicas: Replicas) -> Loss:
    """Loss split with replica groups, per unit of running time (the job's pauses excluded), first order in the
    pauses; failures.restart_s is the job's restart after every group is lost.

    Running, the job trains at `replica_throughput` (the rest is `out`), less the blocked saves and the quorum
    and sync overhead. Failures come at availability / M. Every `all_out_mtbf_s` one of them takes the last
    group in: the job restarts (restart_s + load) and redoes the work since its newest checkpoint, as a restart
    would. Each other failure pauses the live groups for detect_s, half a step with a per-step sync, and the
    heal of the groups that come back in the allocation (a group back at a requeue restarts with the job); with
    DiLoCo it also loses the group's steps since the last sync, H/2 steps of 1/R of the job. Pauses add wall
    time: the denominator is 1 + pauses per unit of running time.
    """
    busy, lost_ckpt, load = _policy_costs(policy, failures.p_fast)
    thru = replica_throughput(replicas, failures)
    q = replica_overhead(replicas)
    m = failures.mtbf_s
    if math.isinf(m):
        return Loss(thru * busy, 0.0, 0.0, thru * (1.0 - busy) * q, 0.0, 1.0 - thru)
    rate = availability(replicas, failures) / m
    per_step = replicas.sync_every == 1
    pause = replicas.detect_s + back_share(replicas, failures) * replicas.heal_s
    pause += replicas.step_s / 2.0 if per_step else 0.0
    group_lost = 0.0 if per_step else replicas.sync_every * replicas.step_s / 2.0 / replicas.groups
    m_all = all_out_mtbf_s(replicas, failures)
    all_rate = 0.0 if math.isinf(m_all) else 1.0 / m_all
    partial = rate - all_rate  # failures that leave a live group: the others pause, the group rejoins
    restart = failures.restart_s + load
    denom = 1.0 + partial * pause + all_rate * restart
    lost = (all_rate * lost_ckpt if all_rate else 0.0) + partial * group_lost * (1.0 - busy) * (1.0 - q)
    return Loss(
        blocking=thru * busy / denom,
        lost_work=lost / denom,
        restart=all_rate * restart / denom,
        overhead=thru * (1.0 - busy) * q / denom,
        stall=partial * pause / denom,
        out=(1.0 - thru) / denom,
    )


def replica_policy(
    slow: TierCost,
    failures: Failures,
    replicas: Replicas,
    fast: TierCost | None = None,
    rule: IntervalRule = daly_interval,
) -> CheckpointPolicy:
    """`optimal_policy` against the failures a checkpoint recovers with replica groups: the loss of every group
    (`all_out_mtbf_s`), far rarer than one failure, so the intervals are longer and the saves cost less."""
    m_all = all_out_mtbf_s(replicas, failures)
    return optimal_policy(slow, Failures(m_all, failures.p_fast, failures.restart_s), fast, rule)
