"""Analytic goodput of a periodic checkpoint policy under random failures (pure functions, no torch).

Goodput is the share of wall-clock time that ends up as training progress. Wall time goes to useful work,
to training blocked by saves, to work redone after a failure (done since the newest usable checkpoint), and
to restarts. All times are seconds. Failures arrive at rate 1/M while the job computes (training or saving);
the restart itself (requeue, start, init, load, warm-up) is assumed not to fail, which is optimistic by a
factor of about e^{R/M} on the restart term (Daly's model lets it fail). See docs/goodput.md.

Two tiers: a *fast* node-local tier (RAM, local SSD), lost with the node, so usable only after the share
`p_fast` of failures that leave every node usable (process crash, NCCL timeout, preemption with restart on the
same nodes), and a *slow* durable tier (shared file system) that recovers every failure.
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
    """Fractions of wall time lost to blocking saves, to redone work and to restarts."""

    blocking: float
    lost_work: float
    restart: float

    @property
    def total(self) -> float:
        return self.blocking + self.lost_work + self.restart

    @property
    def goodput(self) -> float:
        return max(0.0, 1.0 - self.total)

    @property
    def dominant(self) -> str:
        parts = {"blocking": self.blocking, "lost work": self.lost_work, "restarts": self.restart}
        return max(parts, key=parts.__getitem__)


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
    tau_s = effective_interval(policy.tau_slow_s, policy.slow.write_s)
    busy = policy.slow.blocked_s / (tau_s + policy.slow.blocked_s)
    lost = tau_s / 2.0 + policy.slow.write_s
    load = policy.slow.load_s
    if policy.fast is not None and not math.isinf(policy.tau_fast_s):
        tau_f = effective_interval(policy.tau_fast_s, policy.fast.write_s)
        busy += policy.fast.blocked_s / (tau_f + policy.fast.blocked_s)
        lost_fast = tau_f / 2.0 + policy.fast.write_s
        p = failures.p_fast
        load_fast = policy.fast.load_s if lost_fast < lost else policy.slow.load_s
        lost = p * min(lost_fast, lost) + ((1.0 - p) * lost if p < 1.0 else 0.0)
        load = p * load_fast + (1.0 - p) * policy.slow.load_s
    m = failures.mtbf_s
    if math.isinf(m):
        return Loss(busy, 0.0, 0.0)
    restart = failures.restart_s + load
    cycle = m + restart
    return Loss(busy * m / cycle, lost / cycle, restart / cycle)


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
