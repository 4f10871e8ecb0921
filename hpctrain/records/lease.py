"""One live attempt per run: a fencing token in the run directory.

A run can be started twice at once: the supervisor resubmits a failed job while Slurm requeues the same job
for NODE_FAIL, or a user starts a run that is still alive. Both would train into the same run directory,
commit the same checkpoints and write the same metrics. So every attempt takes the lease when it starts (the
token goes up by one under an exclusive lock, the file is replaced atomically) and the newest attempt holds
the run. The older one learns it has lost within `run.lease_check_s` seconds (rank 0's `LeaseWatch` thread
re-reads the token; the answer rides on the step's one all-reduce, so every rank stops at the same step
boundary) and ends without writing anything more: no checkpoint, no metrics, no failure record, exit status 0
so that nobody resubmits it; the supervisor of a job that no longer holds the lease does nothing either.

The token is not read on the step's path: on a cluster the run directory is on a shared file system, where a
read is a metadata operation (milliseconds, seconds when the metadata server is loaded) that every rank would
wait for in the step's all-reduce.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.records.paths import RunPaths

log = logging.getLogger(__name__)


class StaleAttempt(RuntimeError):
    """A newer attempt of this run took the lease: this one stops without writing."""


@dataclass(frozen=True)
class Lease:
    token: int
    job_id: str
    previous_job: str | None = None  # who held the run when this attempt took it (None: nobody, or not known)

    def displaced_another_job(self) -> bool:
        """Another job held the run: it may still be training (a run started twice) until its watch reads the
        token. An earlier attempt of this job (a restart inside the allocation) has ended before this one began."""
        return self.previous_job is not None and self.previous_job != self.job_id


def take_lease(run_dir: Path, job_id: str) -> Lease:
    """Become the run's live attempt: the next token, written atomically under an exclusive lock."""
    path = RunPaths(run_dir).lease
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = current_lease(run_dir)
        lease = Lease(
            token=(held.token if held else 0) + 1, job_id=str(job_id), previous_job=held.job_id if held else None
        )
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(
                {
                    "token": lease.token,
                    "job_id": lease.job_id,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "time": time.time(),
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return lease


def settle_time(lease: Lease, taken_at: float, interval_s: float) -> float:
    """When an attempt that took `lease` at `taken_at` may first write into the run: at once, unless it displaced
    another job's attempt, which may still be training; then after two of that attempt's watch intervals, by
    which its watch has read the token (and it writes nothing from then on, `LeaseWatch.lost`). Without this, a
    new attempt that loads a small checkpoint in under a second wrote metrics between the old attempt's last ones."""
    return taken_at + 2 * interval_s if lease.displaced_another_job() else taken_at


def current_lease(run_dir: Path) -> Lease | None:
    """Who holds the run now (None: no attempt has started)."""
    try:
        data = json.loads(RunPaths(run_dir).lease.read_text())
    except FileNotFoundError:
        return None
    return Lease(int(data["token"]), str(data["job_id"]))


def holds(run_dir: Path, lease: Lease) -> bool:
    """Whether `lease` is still the run's newest (a missing file means nobody took it from us)."""
    now = current_lease(run_dir)
    return now is None or now.token == lease.token


def superseded(run_dir: Path, job_id: str, jobs: list[str]) -> bool:
    """Whether a job submitted after `job_id` (by `jobs`, the run's submission order) holds the lease: then
    this job's failure is not the run's, and nothing must be resubmitted for it."""
    now = current_lease(run_dir)
    if now is None or now.job_id == str(job_id) or now.job_id not in jobs or str(job_id) not in jobs:
        return False
    return jobs.index(now.job_id) > jobs.index(str(job_id))


class LeaseWatch:
    """Rank 0's check of the lease, off the step's path: a daemon thread re-reads the token every
    `interval_s` seconds and latches `lost()`, which the step's control values read for free.

    A thread rather than every N steps: the read costs the step nothing whatever the file system does (a
    stalled metadata server stalls this thread, not the all-reduce every rank waits in), and the delay until
    an old attempt notices is bounded in seconds whatever the step time. A read that fails (a file system
    hiccup) keeps the last verdict and is retried at the next interval."""

    def __init__(self, run_dir: Path, lease: Lease, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"run.lease_check_s must be > 0 seconds, got {interval_s}")
        self.run_dir, self.lease, self.interval_s = run_dir, lease, float(interval_s)
        self._lost = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-lease", daemon=True)

    def start(self) -> LeaseWatch:
        self._thread.start()
        return self

    def lost(self) -> bool:
        """Whether a newer attempt took the run, as of the last read (no file access)."""
        return self._lost.is_set()

    def check(self) -> bool:
        """Read the token now; True while this attempt still holds the run."""
        try:
            held = holds(self.run_dir, self.lease)
        except (OSError, ValueError, KeyError) as exc:  # unreadable or half-written by hand: try again later
            log.warning(
                "lease: cannot read %s (%s: %s); retrying in %g s",
                RunPaths(self.run_dir).lease,
                type(exc).__name__,
                exc,
                self.interval_s,
            )
            return not self.lost()
        if not held:
            self._lost.set()
        return held

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5.0)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            if not self.check():
                return
