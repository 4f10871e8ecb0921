"""What a task leaves behind when it fails: one JSON record per rank, and the job's rank -> host map.

The tasks write them (the training loop, the hang watchdog, the pre-flight); the supervisor (after srun)
reads them to decide which node(s) to exclude on resubmission, and whether the failure is deterministic (the
same error at the same step again), in which case resubmitting would only loop.
"""

from __future__ import annotations

import json
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from hpctrain.records.paths import RunPaths

# Messages that mean "another rank went away", not "this rank is broken".
PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "timeout",
    "Timeout",
    "connectFullMesh",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "Connection refused",
)


def is_peer_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in PEER_MARKERS)


def record_failure(
    run_dir: Path,
    job_id: str,
    rank: int,
    step: int,
    exc: BaseException,
    peer: bool | None = None,
    blame: list[str] | None = None,
) -> Path:
    """Write this rank's record. `peer` overrides the guess from the message; `blame` names other hosts at
    fault (a health check run on this rank found them bad), instead of this rank's own."""
    directory = RunPaths(run_dir).failures(job_id)
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "host": socket.gethostname(),
        "job_id": job_id,
        "step": step,
        "type": type(exc).__name__,
        "message": str(exc),  # whole: the key and the fix are often at its end
        "peer": is_peer_failure(exc) if peer is None else peer,
        "blame": blame,
        "time": time.time(),
        "traceback": traceback.format_exception(exc)[-12:],
    }
    path = directory / f"rank{rank}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def record_hosts(run_dir: Path, job_id: str, hosts: list[str]) -> None:
    """Rank -> host of this attempt: ranks that die without a record (a dead node) are found through it."""
    path = RunPaths(run_dir).hosts(job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hosts))


def read_hosts(run_dir: Path, job_id: str) -> list[str]:
    path = RunPaths(run_dir).hosts(job_id)
    return json.loads(path.read_text()) if path.exists() else []


def attempt_key(job_id: str, restart: int, requeue: int = 0) -> str:
    """The records' folder name of one attempt: the job id (`<job>r<k>` for its k-th run after a requeue: a
    requeued job keeps its id and counts its restarts from 0 again), then `.<n>` for the n-th restart of its
    workers inside the allocation. Each attempt keeps its own records: no later one may overwrite them."""
    base = job_id if requeue == 0 else f"{job_id}r{requeue}"
    return base if restart == 0 else f"{base}.{restart}"


def last_attempt(run_dir: Path, job_id: str, since: float = 0.0) -> str:
    """The records' key of the job's last attempt that failed (its last restart inside the allocation with
    failure records; a restart that left at once, without training, has none). `since`: the start of the
    job's current run: a requeued job numbers its restarts from 0 again, under the same keys, so records older
    than its run are an earlier run's and do not count."""
    restarts = [
        int(p.name.rpartition(".")[2])
        for p in RunPaths(run_dir).failures(job_id).parent.glob(f"{job_id}.*")
        if p.name.rpartition(".")[2].isdigit() and read_failures(run_dir, p.name, since)
    ]
    return attempt_key(job_id, max(restarts, default=0))


def last_restart(run_dir: Path, job_id: str) -> int:
    """The job's highest restart inside the allocation so far (every attempt writes its records folder at
    start); 0 when there was none."""
    names = (p.name.rpartition(".")[2] for p in RunPaths(run_dir).failures(job_id).parent.glob(f"{job_id}.*"))
    return max((int(n) for n in names if n.isdigit()), default=0)


def free_restart(run_dir: Path, job_id: str, restart: int, requeue: int = 0) -> int:
    """The restart number a new set of workers records under: `restart` (its agent's count), raised above every
    number an attempt of this job run already recorded under. torch's elastic agent does not count a change of
    members (a hot spare taking a hung node's place) as a restart: the new workers would start with the number
    of those they replace and write over their records (host map, hang dumps, failure records)."""
    run = attempt_key(job_id, 0, requeue)
    folder = RunPaths(run_dir).failures(run)
    used = [int(n) for p in folder.parent.glob(f"{run}.*") if (n := p.name.rpartition(".")[2]).isdigit()]
    used += [0] if folder.exists() else []
    return max(restart, max(used) + 1) if used else restart


def condemned_hosts(run_dir: Path, job_id: str, restart: int) -> list[str]:
    """Hosts the health checks condemned in the attempt before `restart` (records with `blame`): restarting on
    the same nodes cannot help, the job must leave the allocation to run without them."""
    if restart < 1:
        return []
    records = read_failures(run_dir, attempt_key(job_id, restart - 1))
    return sorted({h for r in records for h in (r.get("blame") or [])})


def diagnose(
    records: list[dict[str, Any]], hosts_by_rank: list[str] | None = None
) -> tuple[list[str], dict[str, Any] | None]:
    """The hosts to blame and the root error (the first record that is not a consequence of a lost peer).

    With no such record, the ranks that left no record at all (killed with their node, or by the kernel)
    are the suspects; when no rank left one, the whole job was killed from outside (scancel, the OOM killer
    of a login policy...) and no node is to blame.
    """
    own = [r for r in records if not r["peer"]]
    root = own[0] if own else (records[0] if records else None)
    hosts = sorted({h for r in own for h in (r.get("blame") or [r["host"]])})
    if not own and hosts_by_rank:
        silent = set(range(len(hosts_by_rank))) - {r["rank"] for r in records}
        if len(silent) < len(hosts_by_rank):
            hosts = sorted({hosts_by_rank[r] for r in silent})
    signature = (
        None
        if root is None
        else {
            "type": root["type"],
            "message": root["message"],
            "step": root["step"],
            "rank": root["rank"],
            "host": root["host"],
        }
    )
    return hosts, signature


SAME_PREFIX = 500  # characters of two messages compared by `same_failure`


def same_failure(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Two attempts ended with the same error at the same step: a deterministic failure, retrying loops.
    The messages are compared on their first SAME_PREFIX characters (signatures carry them whole): signatures
    written before that, cut there, still compare equal to today's."""
    return (
        a is not None
        and b is not None
        and (a["type"], a["message"][:SAME_PREFIX], a["step"]) == (b["type"], b["message"][:SAME_PREFIX], b["step"])
    )


def read_failures(run_dir: Path, job_id: str, since: float = 0.0) -> list[dict[str, Any]]:
    """An attempt's records, oldest first; only those written at `since` or later."""
    directory = RunPaths(run_dir).failures(job_id)
    if not directory.is_dir():
        return []
    records = (json.loads(p.read_text()) for p in directory.glob("rank*.json"))
    return sorted((r for r in records if r["time"] >= since), key=lambda r: r["time"])
