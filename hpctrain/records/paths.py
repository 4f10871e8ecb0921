"""The name of every file and folder hpctrain keeps in a run directory, and where each one lives.

One table, read by every writer and reader (the launcher, the tasks, the supervisor, the tools), so a name
changes in one place. Tests keep their literal names on purpose: they pin the on-disk contract.
"""

from __future__ import annotations

import os
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


# ---------------------------------------------------------------- what a run's checkpoints may resolve to
#
# A run saves, loads and deletes checkpoints only in its own directories (issue 46): a relative tier in the run
# directory, an absolute one (node-local RAM or SSD, a shared scratch) in `<path>/<run id>`. A symbolic link that
# leads out of them (another run's `checkpoints/`) would make a resume load that run's checkpoint, save into its
# directory and let retention delete its steps; the login node (hpctrain.launch.rundir) and the checkpoint manager
# both refuse it. One rule, here, read by both (torch-free: the login node imports it).


def tier_directory(path: str, run_dir: Path, run_id: str) -> tuple[Path, Path]:
    """A tier's directory for this run, and the home it must resolve inside: the run directory for a relative
    tier path; for an absolute one, the run's own subdirectory `<path>/<run id>`, `path` itself resolved (a
    scratch mount may be a link; the run's subdirectory under it may not lead elsewhere)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p / run_id, Path(os.path.realpath(p)) / run_id
    return run_dir / p, Path(os.path.realpath(run_dir))


def within(path: Path, home: Path) -> bool:
    """Whether `path`, every link on the way resolved, is `home` or below it (`home` as it is given)."""
    real, root = os.path.realpath(path), str(home)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def escape(path: Path, home: Path) -> str | None:
    """Why `path` leads out of `home` (None when it stays inside): the link that takes it out, and where to."""
    if within(path, home):
        return None
    real = os.path.realpath(path)
    link = next((q for q in (path, *path.parents) if q.is_symlink()), None)
    if link is None:
        return f"{path} resolves to {real}, outside {home}"
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    shown = target if os.path.join(link.parent, target) == real else f"{target} ({real})"
    return f"{link} is a symbolic link to {shown}, outside {home}"


def escaping_entries(directory: Path, prefix: str) -> list[tuple[Path, str]]:
    """The entries of `directory` named `prefix*` that lead out of it through a link, with why (a checkpoint
    directory `step_<N>` linked to another run's)."""
    try:
        entries = sorted(directory.iterdir()) if directory.is_dir() else []
    except OSError:
        return []
    home = Path(os.path.realpath(directory))
    return [
        (e, why) for e in entries if e.name.startswith(prefix) and e.is_symlink() for why in [escape(e, home)] if why
    ]
