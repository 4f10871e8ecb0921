"""The ledger of a run directory: its records read from disk and its jobs' accounting asked of the scheduler
(the side effects around the pure `ledger.build_ledger`). Used by `python -m hpctrain.status` on the login
node and by rank 0 at the end of each attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from hpctrain.goodput.ledger import Ledger, Row, build_ledger, local_allocations
from hpctrain.records.failures import read_failures, read_hosts
from hpctrain.records.history import iter_metrics, lines_from, read_events
from hpctrain.records.jobs import read_attempts, read_completed, read_jobs
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for

log = logging.getLogger(__name__)


def run_settings(run_dir: Path) -> dict[str, Any]:
    """What the ledger needs of the run's config: its last step and its scheduler."""
    cfg = OmegaConf.load(RunPaths(run_dir).config)
    return {"max_steps": int(cfg.train.max_steps), "executor": str(cfg.cluster.executor)}


class RowCache:
    """The metrics rows read so far, kept as `Row`s, and where the file was left: a task that makes the ledger
    several times (each attempt's start and end) parses each row once. Parsing is most of a ledger's cost:
    about 10 us a row on a slow core, seconds for a run of 500,000 steps."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.offset = 0

    def read(self, run_dir: Path) -> list[Row]:
        for record, offset in lines_from(RunPaths(run_dir).metrics, self.offset):
            self.offset = offset
            self.rows.append(Row.of(record))
        return self.rows


class Records(Protocol):
    """Where a ledger's records come from: the task's own fresh ones (`RunFiles`), or what a user points
    `python -m hpctrain.status` at, read tolerantly (hpctrain.status.records)."""

    def jobs(self) -> list[dict[str, Any]]: ...
    def events(self) -> list[dict[str, Any]]: ...
    def rows(self) -> Iterable[Any]: ...
    def completed(self) -> dict[str, Any] | None: ...
    def attempts(self) -> list[dict[str, Any]]: ...
    def failures(self, key: str) -> list[dict[str, Any]]: ...
    def hosts(self, key: str) -> list[str]: ...


@dataclass
class RunFiles:
    """A run directory's records as hpctrain.records reads them (strict: the task reads what it wrote)."""

    run_dir: Path
    cache: RowCache | None = None

    def jobs(self) -> list[dict[str, Any]]:
        return read_jobs(self.run_dir)

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir)

    def rows(self) -> Iterable[Any]:
        return self.cache.read(self.run_dir) if self.cache is not None else iter_metrics(self.run_dir)

    def completed(self) -> dict[str, Any] | None:
        return read_completed(self.run_dir)

    def attempts(self) -> list[dict[str, Any]]:
        return read_attempts(self.run_dir)

    def failures(self, key: str) -> list[dict[str, Any]]:
        return read_failures(self.run_dir, key)

    def hosts(self, key: str) -> list[str]:
        return read_hosts(self.run_dir, key)


def measure(
    run_dir: Path,
    now: float | None = None,
    accounting_timeout_s: float = 60,
    cache: RowCache | None = None,
    records: Records | None = None,
    settings: dict[str, Any] | None = None,
) -> Ledger:
    """The run's ledger as of now (a task asks the accounting with a short timeout: a stop must not wait).
    `records`: where the records come from (default: the run's files, read strictly); `settings`: the run's
    `run_settings`, when the caller read them already."""
    now = time.time() if now is None else now
    records = RunFiles(run_dir, cache) if records is None else records
    settings = run_settings(run_dir) if settings is None else settings
    jobs = records.jobs()
    allocations = scheduler_for(settings["executor"]).accounting(
        [str(j["job_id"]) for j in jobs], timeout_s=accounting_timeout_s
    )
    accounting = allocations is not None
    if allocations is None:
        allocations = local_allocations(jobs, _local_job_alive)
    elif jobs and not allocations:
        log.warning(
            "no accounting for jobs %s: the ledger spans only what the run recorded",
            ",".join(str(j["job_id"]) for j in jobs),
        )
        allocations, accounting = local_allocations(jobs, lambda job: job == str(jobs[-1]["job_id"])), False
    return build_ledger(
        events=records.events(),
        rows=records.rows(),
        allocations=allocations,
        accounting=accounting,
        now=now,
        max_steps=settings["max_steps"],
        completed=records.completed(),
        resubmissions=records.attempts(),
        failures=records.failures,
        hosts=records.hosts,
    )


def _local_job_alive(job_id: str) -> bool:
    """A local job's id is its process id (submitit's LocalExecutor), on this machine: alive while that
    process runs submitit's job (not a zombie, not a new process under a reused pid)."""
    proc = Path("/proc") / job_id
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        command = (proc / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"submitit" in command
