"""Monte-Carlo replay of a checkpoint policy under random failures: the check on the analytic model.

The job computes until the next failure (exponential or Weibull time, drawn afresh after every restart, with
mean M), pays the restart (fixed cost, optionally an exponential scheduler delay, plus the load of the tier
restored from) and resumes from the newest usable committed checkpoint. Saves follow the policy as hpctrain
runs them: each tier is due every tau of work since the (re)start, blocks training for its staging cost,
commits write_s later, and is skipped when its previous write still runs. A failure is of the fast kind
(every node survives: fast and durable checkpoints usable) with probability p_fast, else it loses a node
(only the durable tier is usable; the durable position may then lie before the position restarted from).

Repetitions run in lockstep as numpy arrays, one failure per iteration; the timeline of saves after a restart
is the same every time, so it is computed once and looked up (np.interp, searchsorted).

`simulate_replicas` replays replica groups (recovery=replicas|diloco) event by event: each group fails after an
exponential running time of mean R M, is out for its restart (or until the requeue without a spare), and
rejoins; the live groups pause at each failure and heal; the loss of the last group in requeues the job from
its newest checkpoint. It checks `model.replica_loss`, whose independence of the groups it does not assume.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from hpctrain.goodput.model import CheckpointPolicy, Failures, Replicas, TierCost, replica_overhead


@dataclass(frozen=True)
class SimResult:
    """Mean goodput over repetitions with the half-width of its 95% confidence interval, and the loss split."""

    goodput: float
    ci95: float
    blocking: float
    lost_work: float
    restart: float
    failures: float  # mean number of failures per run
    reps: int
    overhead: float = 0.0  # replica groups: quorum and sync
    stall: float = 0.0  # replica groups: the live groups' pauses
    out: float = 0.0  # replica groups: groups out


@dataclass(frozen=True)
class _Timeline:
    """The timeline of saves after a restart, against wall time since the restart, up to `until`."""

    until: float
    wall: np.ndarray  # breakpoints of work(wall): flat while a save blocks training
    work: np.ndarray
    commits: tuple[np.ndarray, np.ndarray]  # commit wall times of the fast, slow tier (increasing)
    positions: tuple[np.ndarray, np.ndarray]  # work positions of those checkpoints

    def work_at(self, t: np.ndarray) -> np.ndarray:
        return np.interp(t, self.wall, self.work)

    def newest(self, tier: int, t: np.ndarray) -> np.ndarray:
        """Work position of the tier's newest checkpoint committed by t; -inf where there is none."""
        commits, positions = self.commits[tier], self.positions[tier]
        if commits.size == 0:
            return np.full(t.shape, -np.inf)
        i = np.searchsorted(commits, t, side="right") - 1
        return np.where(i >= 0, positions[np.maximum(i, 0)], -np.inf)


def _timeline(policy: CheckpointPolicy, until: float) -> _Timeline:
    taus = (policy.tau_fast_s if policy.fast is not None else math.inf, policy.tau_slow_s)
    costs = (policy.fast or TierCost(0.0), policy.slow)
    k = [1, 1]
    busy = [-math.inf, -math.inf]
    commits: tuple[list[float], list[float]] = ([], [])
    positions: tuple[list[float], list[float]] = ([], [])
    wall_bp, work_bp = [0.0], [0.0]
    shift = 0.0  # wall time blocked so far
    while True:
        due = (k[0] * taus[0], k[1] * taus[1])
        w = min(due)
        if math.isinf(w) or w + shift > until:
            break
        start, block = w + shift, 0.0
        for i in (0, 1):  # at a common due point the fast tier stages first
            if due[i] != w:
                continue
            k[i] += 1
            if busy[i] <= start + block + 1e-6:  # else the previous write still runs: skip
                block += costs[i].blocked_s
                busy[i] = start + block + costs[i].write_s
                commits[i].append(busy[i])
                positions[i].append(w)
        if block > 0.0:
            wall_bp += [start, start + block]
            work_bp += [w, w]
        shift += block
    end = max(until, wall_bp[-1]) + 1.0
    wall_bp.append(end)
    work_bp.append(work_bp[-1] + end - wall_bp[-2])
    return _Timeline(
        until,
        np.array(wall_bp),
        np.array(work_bp),
        (np.array(commits[0]), np.array(commits[1])),
        (np.array(positions[0]), np.array(positions[1])),
    )


def _draw(rng: np.random.Generator, mean: float, shape: float | None, n: int) -> np.ndarray:
    """Times to the next failure with the given mean; Weibull shape < 1 gives early failures after a restart."""
    if math.isinf(mean):
        return np.full(n, np.inf)
    if shape is None:
        return rng.exponential(mean, n)
    return mean / math.gamma(1.0 + 1.0 / shape) * rng.weibull(shape, n)


def simulate(
    policy: CheckpointPolicy,
    failures: Failures,
    horizon_s: float,
    reps: int = 200,
    seed: int = 0,
    weibull_shape: float | None = None,
    delay_mean_s: float = 0.0,
) -> SimResult:
    """Goodput of `reps` runs of horizon_s wall time each; progress at the horizon counts even if uncommitted."""
    rng = np.random.default_rng(seed)
    fast, slow = 0, 1
    load = (policy.fast.load_s if policy.fast is not None else 0.0, policy.slow.load_s)
    t = np.zeros(reps)  # wall time used
    base = np.zeros(reps)  # position the current cycle started from
    durable = np.zeros(reps)  # newest durable position
    base_fast = np.zeros(reps, bool)  # the current cycle started from the fast tier
    final = np.zeros(reps)
    blocked, lost, restart = np.zeros(reps), np.zeros(reps), np.zeros(reps)
    n_fail = np.zeros(reps)
    active = np.ones(reps, bool)
    tl = _timeline(policy, min(horizon_s, 10.0 * failures.mtbf_s))
    while active.any():
        x = _draw(rng, failures.mtbf_s, weibull_shape, reps)
        delay = rng.exponential(delay_mean_s, reps) if delay_mean_s > 0 else np.zeros(reps)
        kind_fast = rng.random(reps) < failures.p_fast
        remaining = horizon_s - t
        ends = active & (x >= remaining)
        fails = active & ~ends
        run = np.where(active, np.minimum(x, remaining), 0.0)
        if run.max() > tl.until:
            tl = _timeline(policy, min(horizon_s, max(run.max(), 2.0 * tl.until)))
        w = tl.work_at(run)
        blocked += run - w
        final = np.where(ends, base + w, final)

        f_pos, s_pos = base + tl.newest(fast, run), base + tl.newest(slow, run)
        durable = np.where(fails, np.maximum(durable, s_pos), durable)
        newest_fast = np.maximum(base, np.maximum(f_pos, s_pos))
        restore = np.where(kind_fast, newest_fast, durable)
        from_fast = kind_fast & ((f_pos >= s_pos) & (f_pos > -np.inf) | (base_fast & (newest_fast == base)))
        pause = failures.restart_s + delay + np.where(from_fast, load[fast], load[slow])
        pause = np.minimum(pause, remaining - run)
        lost += np.where(fails, base + w - restore, 0.0)
        restart += np.where(fails, pause, 0.0)
        n_fail += fails
        final = np.where(fails, restore, final)  # overwritten if the run continues
        base = np.where(fails, restore, base)
        base_fast = np.where(fails, from_fast, base_fast)
        t = np.where(active, t + run + np.where(fails, pause, 0.0), t)
        active &= fails & (t < horizon_s)
    g = final / horizon_s
    ci = 1.96 * g.std(ddof=1) / math.sqrt(reps) if reps > 1 else math.inf
    return SimResult(
        float(g.mean()),
        float(ci),
        float(blocked.mean() / horizon_s),
        float(lost.mean() / horizon_s),
        float(restart.mean() / horizon_s),
        float(n_fail.mean()),
        reps,
    )


class _Saves:
    """The timeline of saves as plain lists for one-at-a-time lookups (bisect), for the event-driven replay."""

    def __init__(self, tl: _Timeline) -> None:
        self.wall, self.work = tl.wall.tolist(), tl.work.tolist()
        self.commits = (tl.commits[0].tolist(), tl.commits[1].tolist())
        self.positions = (tl.positions[0].tolist(), tl.positions[1].tolist())

    def work_at(self, t: float) -> float:
        i = min(max(bisect.bisect_right(self.wall, t) - 1, 0), len(self.wall) - 2)
        w0, w1 = self.wall[i], self.wall[i + 1]
        return self.work[i] + (self.work[i + 1] - self.work[i]) * (t - w0) / (w1 - w0)

    def newest(self, tier: int, t: float) -> float:
        i = bisect.bisect_right(self.commits[tier], t) - 1
        return self.positions[tier][i] if i >= 0 else -math.inf


def simulate_replicas(
    policy: CheckpointPolicy,
    failures: Failures,
    replicas: Replicas,
    horizon_s: float,
    reps: int = 100,
    seed: int = 0,
) -> SimResult:
    """Goodput of `reps` runs of horizon_s wall time each with R replica groups; progress counts in job time
    (k groups in train at k/R), uncommitted progress at the horizon included. The rules are `replica_loss`'s:
    failures strike running groups only, a pause (detection, the step in flight, a heal, a requeue) stops every
    group and no timer; saves follow the policy in running time since the job's (re)start."""
    rng = np.random.default_rng(seed)
    saves = _Saves(_timeline(policy, horizon_s))
    parts = np.zeros((reps, 7))  # progress, blocking, overhead, stall, out, lost, restart
    n_fail = np.zeros(reps)
    for rep in range(reps):
        parts[rep], n_fail[rep] = _replica_run(rng, saves, policy, failures, replicas, horizon_s)
    g = parts[:, 0] / horizon_s
    ci = 1.96 * g.std(ddof=1) / math.sqrt(reps) if reps > 1 else math.inf
    mean = parts.mean(axis=0) / horizon_s
    return SimResult(
        float(g.mean()),
        float(ci),
        float(mean[1]),
        float(mean[5]),
        float(mean[6]),
        float(n_fail.mean()),
        reps,
        overhead=float(mean[2]),
        stall=float(mean[3]),
        out=float(mean[4]),
    )


def _replica_run(
    rng: np.random.Generator,
    saves: _Saves,
    policy: CheckpointPolicy,
    f: Failures,
    r: Replicas,
    horizon: float,
) -> tuple[np.ndarray, int]:
    """One run: its time split (progress, blocking, overhead, stall, out, lost, restart) and its failures."""
    q = replica_overhead(r)
    per_step = r.sync_every == 1
    mean_up = r.groups * f.mtbf_s
    load = (policy.fast.load_s if policy.fast is not None else policy.slow.load_s, policy.slow.load_s)
    blocking = overhead = stall = out = lost = restart = 0.0
    wall, base, durable, n = 0.0, 0.0, 0.0, 0
    while wall < horizon:  # one stretch from the job's (re)start to the loss of every group
        c, w, prog = 0.0, 0.0, 0.0  # running clock, unblocked work, progress since the (re)start
        marks = [(0.0, 0.0, 1.0 - q)]  # (work, progress, rate) from each event on: the progress at a save
        fail_at = [rng.exponential(mean_up) if math.isfinite(mean_up) else math.inf for _ in range(r.groups)]
        back_at = [math.inf] * r.groups
        heals = [False] * r.groups
        k = r.groups
        while True:
            nominal = k / r.groups if k >= r.min_replicas else 0.0
            i_fail = min(range(r.groups), key=fail_at.__getitem__)
            i_back = min(range(r.groups), key=back_at.__getitem__)
            t = min(fail_at[i_fail], back_at[i_back])
            end = t >= c + horizon - wall
            t = min(t, c + horizon - wall)
            w1 = saves.work_at(t)
            prog += nominal * (1.0 - q) * (w1 - w)
            blocking += nominal * ((t - c) - (w1 - w))
            overhead += nominal * q * (w1 - w)
            out += (1.0 - nominal) * (t - c)
            wall += t - c
            c, w = t, w1
            if end:
                return np.array([base + prog, blocking, overhead, stall, out, lost, restart]), n
            if back_at[i_back] <= fail_at[i_fail]:  # a group rejoins, healed from a live peer
                back_at[i_back], k = math.inf, k + 1
                fail_at[i_back] = c + rng.exponential(mean_up)
                if heals[i_back]:
                    pause = min(r.heal_s, horizon - wall)
                    stall, wall = stall + pause, wall + pause
            else:
                n += 1
                fail_at[i_fail], k = math.inf, k - 1
                kind_fast = rng.random() < f.p_fast
                if k == 0:  # no live peer left: requeue from the newest checkpoint
                    f_pos, s_pos = _progress_at(marks, saves.newest(0, c)), _progress_at(marks, saves.newest(1, c))
                    durable = max(durable, base + s_pos)
                    from_fast = kind_fast and f_pos >= s_pos and f_pos > -math.inf
                    restore = max(base, base + f_pos, base + s_pos) if kind_fast else durable
                    lost += base + prog - restore
                    base = restore
                    pause = min(f.restart_s + load[0 if from_fast else 1], horizon - wall)
                    restart, wall = restart + pause, wall + pause
                    break
                comes_back = kind_fast or rng.random() < r.p_spare  # a spare takes a dead node's place
                back_at[i_fail] = c + (r.group_restart_s if comes_back else r.requeue_s)
                heals[i_fail] = comes_back
                pause = r.detect_s + (rng.uniform(0.0, r.step_s) if per_step else 0.0)
                pause = min(pause, horizon - wall)
                stall, wall = stall + pause, wall + pause
                if not per_step:  # DiLoCo: the group's steps since the last sync are lost
                    gone = min(prog, rng.uniform(0.0, r.sync_every * r.step_s) / r.groups * (1.0 - q))
                    prog, lost = prog - gone, lost + gone
            marks.append((w, prog, (k / r.groups if k >= r.min_replicas else 0.0) * (1.0 - q)))
    return np.array([base, blocking, overhead, stall, out, lost, restart]), n


def _progress_at(marks: list[tuple[float, float, float]], position: float) -> float:
    """Progress when the unblocked work stood at `position` (a save's), from the marks; -inf before any save."""
    if position == -math.inf:
        return -math.inf
    i = bisect.bisect_right(marks, (position, math.inf, math.inf)) - 1
    w, prog, rate = marks[max(i, 0)]
    return prog + rate * (position - w)
