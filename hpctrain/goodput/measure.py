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

from hpctrain.goodput.ledger import GroupRecords, Ledger, ReplicaSetup, Row, build_ledger, local_allocations
from hpctrain.records.failures import read_failures, read_hosts
from hpctrain.records.history import iter_metrics, lines_from, read_events
from hpctrain.records.jobs import read_attempts, read_completed, read_jobs
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"


def run_settings(run_dir: Path) -> dict[str, Any]:
    """What the ledger needs of the run's config: its last step, its scheduler, its hot spares, its replica
    groups."""
    return settings_of(OmegaConf.load(RunPaths(run_dir).config))


def settings_of(cfg: Any) -> dict[str, Any]:
    """`run_settings` of a loaded config: "replicas" holds a `ReplicaSetup`'s fields under
    recovery=replicas|diloco (docs/replicas.md: cluster.nodes and train.global_batch split among the groups)."""
    settings = {
        "max_steps": int(cfg.train.max_steps),
        "executor": str(cfg.cluster.executor),
        "spares": int(cfg.cluster.get("spare_nodes", 0)),
    }
    recovery = cfg.get("recovery")
    if recovery is not None and str(recovery.mode) in ("replicas", "diloco"):
        groups = int(recovery.groups)
        settings["replicas"] = {
            "groups": groups,
            "nodes": max(1, int(cfg.cluster.nodes) // groups),
            "group_batch": int(cfg.train.global_batch) // groups,
            "sync_every": int(recovery.sync_every) if str(recovery.mode) == "diloco" else 1,
        }
    return settings


def group_dir(run_dir: Path, group: int) -> Path:
    """Where replica group `group` keeps its records: the run directory for group 0, `replicas/g<g>/` of it
    for the others (as hpctrain.train.replicated.group_run_dir writes them; that module imports torch)."""
    return run_dir if group == 0 else run_dir / REPLICAS_DIR / f"g{group}"


class RowCache:
    """The metrics rows read so far, kept as `Row`s, and where the file was left: a task that makes the ledger
    several times (each attempt's start and end) parses each row once. Parsing is most of a ledger's cost:
    about 10 us a row on a slow core, seconds for a run of 500,000 steps."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.offset = 0
        self.groups: dict[int, RowCache] = {}  # replica groups past the first: each its own file

    def group(self, group: int) -> RowCache:
        """The cache of replica group `group`'s rows (group 0's are this one's)."""
        return self if group == 0 else self.groups.setdefault(group, RowCache())

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
    def group(self, group: int) -> Records: ...


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

    def group(self, group: int) -> RunFiles:
        """Replica group `group`'s records (its folder: `group_dir`)."""
        return RunFiles(group_dir(self.run_dir, group), self.cache.group(group) if self.cache is not None else None)


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
    replicas = ReplicaSetup(**settings["replicas"]) if settings.get("replicas") else None
    allocations = scheduler_for(settings["executor"]).accounting(
        [str(j["job_id"]) for j in jobs], timeout_s=accounting_timeout_s
    )
    accounting = allocations is not None
    # a local job holds its groups' nodes and its spares (no accounting to say so), else the one machine
    nodes = replicas.groups * replicas.nodes + int(settings.get("spares") or 0) if replicas is not None else 1
    if allocations is None:
        allocations = local_allocations(jobs, _local_job_alive, nodes)
    elif jobs and not allocations:
        log.warning(
            "no accounting for jobs %s: the ledger spans only what the run recorded",
            ",".join(str(j["job_id"]) for j in jobs),
        )
        allocations, accounting = local_allocations(jobs, lambda job: job == str(jobs[-1]["job_id"]), nodes), False
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
        spares=settings.get("spares"),
        replicas=replicas,
        groups=[_group_records(records.group(g)) for g in range(1, replicas.groups)] if replicas is not None else (),
    )


def _group_records(records: Records) -> GroupRecords:
    return GroupRecords(records.events(), records.rows(), records.failures, records.hosts)


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
