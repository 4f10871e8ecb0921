"""The name of every file and folder hpctrain keeps in a run directory, and where each one lives.

One table, read by every writer and reader (the launcher, the tasks, the supervisor, the tools), so a name
changes in one place. Tests keep their literal names on purpose: they pin the on-disk contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"  # the resolved config the tasks read (written by the launcher)
SUBMITIT = "submitit"  # submitit's folder: batch scripts, pickles, task logs
PLAN = "plan.json"  # the plan of the submission
PLAN_CHART = "plan.png"
JOBS = "jobs.jsonl"  # one line per job submitted for the run (first submission and resubmissions)
ATTEMPTS = "attempts.jsonl"  # one line per failed job the supervisor resubmitted
FAILED = "FAILED.json"  # why the supervisor stopped resubmitting
COMPLETED = "COMPLETED.json"  # the job whose ranks trained the run to its last step
FAILURES = "failures"  # failures/<job>/rank<R>.json, and the job's host map
HOSTS = "hosts.json"
HANGS = "hangs"  # hangs/<job>/: the watchdog's stacks and flight-recorder dumps
HEALTH = "health"  # health/<job>/preflight.json
PREFLIGHT = "preflight.json"
FAULTS = "faults"  # markers of injected faults that fire once
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
LEASE = "lease.json"  # the fencing token of the one live attempt (records/lease.py)
SWEEP_TABLE = "sweep.json"  # in the Hydra sweep directory, not in a run directory


def _entry(name: str) -> property:
    """A file or folder directly in the run directory."""
    return property(lambda self: self.root / name, doc=f"<run dir>/{name}")


@dataclass(frozen=True)
class RunPaths:
    """The files of one run directory."""

    root: Path

    config = _entry(CONFIG)
    submitit = _entry(SUBMITIT)
    plan = _entry(PLAN)
    plan_chart = _entry(PLAN_CHART)
    jobs = _entry(JOBS)
    attempts = _entry(ATTEMPTS)
    failed = _entry(FAILED)
    completed = _entry(COMPLETED)
    faults = _entry(FAULTS)
    metrics = _entry(METRICS)
    events = _entry(EVENTS)
    lease = _entry(LEASE)

    def archived_config(self, stamp: str) -> Path:
        """Where a resume moves the previous config (the new one takes its name)."""
        return self.root / f"config.{stamp}.yaml"

    def failures(self, job_id: str) -> Path:
        return self.root / FAILURES / job_id

    def hosts(self, job_id: str) -> Path:
        return self.failures(job_id) / HOSTS

    def hangs(self, job_id: str) -> Path:
        return self.root / HANGS / job_id

    def preflight(self, job_id: str) -> Path:
        return self.root / HEALTH / job_id / PREFLIGHT
