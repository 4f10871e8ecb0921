"""One live attempt per run: a fencing token in the run directory.

A run can be started twice at once: the supervisor resubmits a failed job while Slurm requeues the same job
for NODE_FAIL, or a user starts a run that is still alive. Both would train into the same run directory,
commit the same checkpoints and write the same metrics. So every attempt takes the lease when it starts (the
token goes up by one under an exclusive lock, the file is replaced atomically) and the newest attempt holds
the run. The older one learns it has lost at its next step boundary (rank 0 reads the token; the answer
rides on the step's one all-reduce) and ends without writing anything more: no checkpoint, no metrics, no
failure record, exit status 0 so that nobody resubmits it; the supervisor of a job that no longer holds the
lease does nothing either.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.records.paths import RunPaths


class StaleAttempt(RuntimeError):
    """A newer attempt of this run took the lease: this one stops without writing."""


@dataclass(frozen=True)
class Lease:
    token: int
    job_id: str


def take_lease(run_dir: Path, job_id: str) -> Lease:
    """Become the run's live attempt: the next token, written atomically under an exclusive lock."""
    path = RunPaths(run_dir).lease
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = current_lease(run_dir)
        lease = Lease(token=(held.token if held else 0) + 1, job_id=str(job_id))
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump({"token": lease.token, "job_id": lease.job_id, "host": socket.gethostname(),
                       "pid": os.getpid(), "time": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return lease


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
