"""The ledger of a run directory: its records read from disk and its jobs' accounting asked of the scheduler
(the side effects around the pure `ledger.build_ledger`). Used by `python -m hpctrain.status` on the login
node and by rank 0 at the end of each attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
        for record, self.offset in lines_from(RunPaths(run_dir).metrics, self.offset):
            self.rows.append(Row.of(record))
        return self.rows


def measure(run_dir: Path, now: float | None = None, accounting_timeout_s: float = 60,
            cache: RowCache | None = None) -> Ledger:
    """The run's ledger as of now (a task asks the accounting with a short timeout: a stop must not wait)."""
    now = time.time() if now is None else now
    settings = run_settings(run_dir)
    jobs = read_jobs(run_dir)
    allocations = scheduler_for(settings["executor"]).accounting([str(j["job_id"]) for j in jobs],
                                                                    timeout_s=accounting_timeout_s)
    accounting = allocations is not None
    if allocations is None:
        allocations = local_allocations(jobs, _local_job_alive)
    elif jobs and not allocations:
        log.warning("no accounting for jobs %s: the ledger spans only what the run recorded",
                    ",".join(str(j["job_id"]) for j in jobs))
        allocations, accounting = local_allocations(jobs, lambda job: job == str(jobs[-1]["job_id"])), False
    rows: Iterable[Any] = cache.read(run_dir) if cache is not None else iter_metrics(run_dir)
    return build_ledger(events=read_events(run_dir), rows=rows, allocations=allocations,
                        accounting=accounting, now=now, max_steps=settings["max_steps"],
                        completed=read_completed(run_dir), resubmissions=read_attempts(run_dir),
                        failures=lambda key: read_failures(run_dir, key), hosts=lambda key: read_hosts(run_dir, key))


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
