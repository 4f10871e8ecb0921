"""The run's job history: every job submitted for it, the supervisor's resubmissions, and its final report.

The launcher appends the first job and the supervisor each resubmission to `jobs.jsonl`; the supervisor
reads its own earlier decisions back from `attempts.jsonl` (how many restarts, which hosts were excluded,
the previous failure's signature) and writes `FAILED.json` when it stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpctrain.bounded import Unreadable, read_text
from hpctrain.records.paths import RunPaths


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def append_job(run_dir: Path, job_id: str, executor: str, **fields: Any) -> None:
    """One submitted job: its id, the executor, the time, and what the submitter adds (resumed, exclude...)."""
    _append(RunPaths(run_dir).jobs, {"job_id": job_id, "executor": executor, "submitted": time.time(), **fields})


def read_jobs(run_dir: Path) -> list[dict[str, Any]]:
    return _read(RunPaths(run_dir).jobs)


def append_attempt(run_dir: Path, record: dict[str, Any]) -> None:
    """A failed job the supervisor resubmitted, with its decision (signature, excluded hosts, new id)."""
    _append(RunPaths(run_dir).attempts, record)


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    return _read(RunPaths(run_dir).attempts)


def write_completed(run_dir: Path, job_id: str, step: int, replica_dir: str | None = None) -> None:
    """The run reached its last step in this job: whatever srun says after (a node lost on the way with
    `--no-kill` makes its status non-zero), there is nothing to resubmit. `replica_dir`: the replica group's
    folder (relative to run_dir) that finished the run while group 0 was out: its checkpoints hold the end."""
    record = {"job_id": job_id, "step": step, "time": time.time()}
    RunPaths(run_dir).completed.write_text(json.dumps(record | ({"replica_dir": replica_dir} if replica_dir else {})))


def read_completed(run_dir: Path) -> dict[str, Any] | None:
    """COMPLETED.json: None when there is none, or when it is no JSON object (a file a crash cut short, or
    something else in its place: bounded, never a traceback)."""
    path = RunPaths(run_dir).completed
    if not path.exists():
        return None
    try:
        record = json.loads(read_text(path, 2**20))
    except (Unreadable, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_report(run_dir: Path) -> dict[str, Any] | None:
    path = RunPaths(run_dir).failed
    return json.loads(path.read_text()) if path.exists() else None


def write_report(run_dir: Path, record: dict[str, Any]) -> Path:
    """Why the run stopped (the supervisor, or the workers inside the allocation), for the user to read."""
    path = RunPaths(run_dir).failed
    path.write_text(json.dumps(record, indent=1))
    return path
