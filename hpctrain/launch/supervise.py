"""After srun: decide whether a failed job is resubmitted, without which nodes, or stopped with a report.

Runs inside the batch script, right after srun returns (a teardown line of the sbatch script that submitit
writes): `python -m hpctrain.launch.supervise RUN_DIR JOB_ID SRUN_EXIT_CODE`. A preempted or requeued job
never gets here (Slurm kills the batch script when it requeues); a job whose tasks all succeeded exits 0.

With `launcher.in_allocation` (the default) the nodes' elastic agents restart failed workers inside the
allocation first (hpctrain/distributed/elastic.py); a job gets here failed only when they gave up
(`launcher.max_restarts` restarts spent, or the workers reported a deterministic failure in FAILED.json, and
then nothing is resubmitted), or when one task per rank runs (`launcher.in_allocation=false`).

For a failed job:
- the ranks' failure records (hpctrain/records/failures.py) name the hosts whose own code failed (as opposed
  to ranks that only lost a peer): those hosts are excluded from the next attempt, with every host excluded
  before;
- the same error at the same step as the previous attempt is deterministic (a config or code error): stop;
- at most `launcher.max_restarts` resubmissions;
- never a resubmission that can not start: when the partition has fewer nodes than the job needs once the
  excluded ones are left out, Slurm would keep it pending forever, so the supervisor stops and says so.
The resubmission runs the same sbatch script and pickle under a new job id (the scheduler's `resubmit`),
in the same run directory, so it resumes from the newest checkpoint; the failed job's own requeue is turned
off first (a dead node would otherwise have Slurm requeue it too: two attempts of one run). Every Slurm call
goes through hpctrain/scheduler/; every file read or written here is named in hpctrain/records/.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpctrain.entry import EntryParser
from hpctrain.records.failures import (
    attempt_key,
    diagnose,
    last_attempt,
    read_failures,
    read_hosts,
    same_failure,
)
from hpctrain.records.jobs import (
    append_attempt,
    append_job,
    read_attempts,
    read_completed,
    read_jobs,
    read_report,
    write_report,
)
from hpctrain.records.lease import current_lease, superseded
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import Scheduler, scheduler_for


def decide(
    run_dir: Path, job_id: str, exit_code: int, max_restarts: int, since: float = 0.0, requeue: int = 0
) -> dict[str, Any]:
    """Pure decision from the records on disk: {"action": "done"|"stop"|"resubmit", ...}. `requeue`: the job's
    run (its records' keys say it); `since`: when that run started (older records are not this failure's)."""
    if exit_code == 0:
        return {"action": "done"}
    attempts = read_attempts(run_dir)
    key = last_attempt(run_dir, attempt_key(job_id, 0, requeue), since)  # after restarts inside the allocation
    hosts, signature = diagnose(read_failures(run_dir, key, since), read_hosts(run_dir, key))
    excluded = sorted(set(hosts).union(*(a.get("excluded", []) for a in attempts)))
    failed_before = [a for a in attempts if a.get("signature")]
    if failed_before and signature is not None and same_failure(failed_before[-1]["signature"], signature):
        return {
            "action": "stop",
            "why": f"deterministic failure: the same error at step {signature['step']} on "
            f"two attempts in a row ({signature['type']}: {signature['message']}); resubmitting would "
            "loop. Fix the cause, then resume with run.resume",
            "signature": signature,
            "excluded": excluded,
        }
    if len(attempts) >= max_restarts:
        return {
            "action": "stop",
            "why": f"{len(attempts)} resubmissions already (launcher.max_restarts={max_restarts})",
            "signature": signature,
            "excluded": excluded,
        }
    return {"action": "resubmit", "signature": signature, "excluded": excluded, "blamed": hosts}


def cannot_fit(partition_nodes: list[str], exclude: list[str], needed: int, partition: str | None) -> str | None:
    """Why a job of `needed` nodes can never start in a partition without `exclude`, or None when it can.

    Counts nodes whatever their state: a DOWN or DRAINED node may come back, an excluded one never will for
    this job.
    """
    left = sorted(set(partition_nodes) - set(exclude))
    if len(left) >= needed:
        return None
    name = partition or "the default partition"
    return (
        f"{name} has {len(set(partition_nodes))} node(s); with {','.join(exclude)} excluded only {len(left)} "
        f"remain and the job needs {needed} (cluster.nodes). Return repaired nodes to service (scontrol update "
        f"nodename=... state=resume), or lower cluster.nodes, then resume with run.resume"
    )


def main(argv: list[str]) -> int:
    parser = EntryParser(prog="python -m hpctrain.launch.supervise", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("job_id", help="the Slurm job that just ended")
    parser.add_argument("exit_code", type=int, help="srun's exit status")
    args = parser.parse_args(argv)
    run_dir, job_id, exit_code = args.run_dir, args.job_id, args.exit_code % 256
    cfg = OmegaConf.load(RunPaths(run_dir).config)
    if exit_code and superseded(run_dir, job_id, [j["job_id"] for j in read_jobs(run_dir)]):
        holder = current_lease(run_dir)
        print(
            f"hpctrain supervisor: job {job_id} failed, but a later job holds the run "
            f"({holder.job_id if holder is not None else 'its lease since gone'}): not resubmitting",
            flush=True,
        )
        return exit_code
    completed = read_completed(run_dir)
    if exit_code and completed and completed["job_id"] == job_id:  # e.g. srun --no-kill after a lost node
        print(
            f"hpctrain supervisor: job {job_id} trained the run to step {completed['step']} (srun exit "
            f"{exit_code}: a node lost on the way)",
            flush=True,
        )
        return 0
    report = read_report(run_dir)
    if exit_code and report and report.get("job_id") == job_id:  # its workers stopped a restart loop
        print(f"hpctrain supervisor: job {job_id} stopped inside the allocation: {report['why']}", flush=True)
        return exit_code
    scheduler = scheduler_for(cfg.cluster.executor)
    requeue = int(scheduler.job_context().get("restart_count") or 0)  # this batch script's run of the job
    decision = decide(
        run_dir, job_id, exit_code, int(cfg.launcher.max_restarts), _run_started(scheduler, job_id), requeue
    )
    if decision["action"] == "done":
        return 0
    exclude = sorted(set(decision["excluded"]) | set(_csv(cfg.cluster.exclude)))
    if decision["action"] == "resubmit":
        why = cannot_fit(
            scheduler.partition_nodes(cfg.cluster.partition), exclude, int(cfg.cluster.nodes), cfg.cluster.partition
        )
        if why:
            decision = {**decision, "action": "stop", "why": why}
    record = {"job_id": job_id, "exit_code": exit_code, "time": time.time(), **decision}
    if decision["action"] == "stop":
        written = write_report(run_dir, record)
        print(
            f"hpctrain supervisor: job {job_id} failed; not resubmitting: {decision['why']}. Report: {written}",
            flush=True,
        )
        return exit_code
    _resubmit(scheduler, run_dir, record, exclude)
    return exit_code  # the batch script's status: this job stays FAILED in sacct


def _resubmit(scheduler: Scheduler, run_dir: Path, record: dict[str, Any], exclude: list[str]) -> None:
    """Submit the failed job again without `exclude`, and record the attempt and the new job.

    A node that died takes the job into NODE_FAIL a little later, and Slurm would requeue it (`--requeue`)
    while the resubmission starts: two attempts of one run. The job's own requeue is turned off first, so
    the resubmission is the only next attempt (the lease would stop the older one, but only at a step).
    """
    job_id = record["job_id"]
    if not scheduler.cancel_requeue(job_id):
        print(
            f"hpctrain supervisor: job {job_id} failed and will be requeued by the scheduler: not resubmitting",
            flush=True,
        )
        return
    new_id = scheduler.resubmit(RunPaths(run_dir).submitit, job_id, exclude)
    append_attempt(run_dir, {**record, "resubmitted_as": new_id})
    append_job(run_dir, new_id, scheduler.name, resubmission_of=job_id, exclude=exclude)
    print(
        f"hpctrain supervisor: job {job_id} failed (exit {record['exit_code']}); resubmitted as {new_id}"
        + (f" excluding {','.join(exclude)}" if exclude else ""),
        flush=True,
    )


def _run_started(scheduler: Scheduler, job_id: str) -> float:
    """When this run of the job started (its newest accounting record; a requeued job has one per run); 0
    (every record counts) without accounting."""
    starts = [r.start for r in scheduler.accounting([job_id]) or [] if r.job_id == job_id and r.start is not None]
    return max(starts, default=0.0)


def _csv(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
