"""After srun: decide whether a failed job is resubmitted, without which nodes, or stopped with a report.

Runs inside the batch script, right after srun returns (a teardown line of the sbatch script that submitit
writes): `python -m hpctrain.launch.supervise RUN_DIR JOB_ID SRUN_EXIT_CODE`. A preempted or requeued job
never gets here (Slurm kills the batch script when it requeues); a job whose tasks all succeeded exits 0.

For a failed job:
- the ranks' failure records (hpctrain/train/failure.py) name the hosts whose own code failed (as opposed
  to ranks that only lost a peer): those hosts are excluded from the next attempt, with every host excluded
  before;
- the same error at the same step as the previous attempt is deterministic (a config or code error): stop;
- at most `launcher.max_restarts` resubmissions;
- never a resubmission that can not start: when the partition has fewer nodes than the job needs once the
  excluded ones are left out, Slurm would keep it pending forever, so the supervisor stops and says so.
The resubmission runs the same sbatch script and pickle under a new job id (sbatch --hold, copy, release),
in the same run directory, so it resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpctrain.train.failure import read_failures, read_hosts

ATTEMPTS = "attempts.jsonl"
REPORT = "FAILED.json"


def diagnose(records: list[dict[str, Any]], hosts_by_rank: list[str] | None = None
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
    signature = None if root is None else {"type": root["type"], "message": root["message"][:500],
                                           "step": root["step"], "rank": root["rank"], "host": root["host"]}
    return hosts, signature


def same_failure(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and (a["type"], a["message"], a["step"]) == (
        b["type"], b["message"], b["step"])


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / ATTEMPTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def decide(run_dir: Path, job_id: str, exit_code: int, max_restarts: int) -> dict[str, Any]:
    """Pure decision from the records on disk: {"action": "done"|"stop"|"resubmit", ...}."""
    if exit_code == 0:
        return {"action": "done"}
    attempts = read_attempts(run_dir)
    hosts, signature = diagnose(read_failures(run_dir, job_id), read_hosts(run_dir, job_id))
    excluded = sorted(set(hosts).union(*(a.get("excluded", []) for a in attempts)))
    failed_before = [a for a in attempts if a.get("signature")]
    if failed_before and same_failure(failed_before[-1]["signature"], signature):
        return {"action": "stop", "why": f"deterministic failure: the same error at step {signature['step']} on "
                f"two attempts in a row ({signature['type']}: {signature['message'][:200]}); resubmitting would "
                "loop. Fix the cause, then resume with run.resume", "signature": signature, "excluded": excluded}
    if len(attempts) >= max_restarts:
        return {"action": "stop", "why": f"{len(attempts)} resubmissions already (launcher.max_restarts="
                f"{max_restarts})", "signature": signature, "excluded": excluded}
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
    return (f"{name} has {len(set(partition_nodes))} node(s); with {','.join(exclude)} excluded only {len(left)} "
            f"remain and the job needs {needed} (cluster.nodes). Return repaired nodes to service (scontrol update "
            f"nodename=... state=resume), or lower cluster.nodes, then resume with run.resume")


def partition_nodes(partition: str | None) -> list[str]:
    """The nodes of a partition (the default one when None), from sinfo; [] when Slurm can not be asked."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P|%N"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    lists = [nodes for name, _, nodes in (line.partition("|") for line in out.splitlines())
             if (name.rstrip("*") == partition if partition else name.endswith("*")) and nodes]
    if not lists:
        return []
    hosts = subprocess.run(["scontrol", "show", "hostnames", ",".join(lists)], capture_output=True, text=True,
                           timeout=60)
    return sorted(set(hosts.stdout.split())) if hosts.returncode == 0 else []


def resubmit(folder: Path, job_id: str, exclude: list[str]) -> str:
    """Submit the job's sbatch script again, held, give the new id the same pickle, release it."""
    script = folder / f"{job_id}_submission.sh"
    cmd = ["sbatch", "--hold", "--parsable"] + ([f"--exclude={','.join(exclude)}"] if exclude else []) + [str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    new_id = out.split(";")[0]
    shutil.copy(folder / f"{job_id}_submitted.pkl", folder / f"{new_id}_submitted.pkl")
    shutil.copy(script, folder / f"{new_id}_submission.sh")
    subprocess.run(["scontrol", "release", new_id], capture_output=True, text=True, timeout=60, check=True)
    return new_id


def main(argv: list[str]) -> int:
    run_dir, job_id, exit_code = Path(argv[0]), argv[1], int(argv[2]) % 256
    cfg = OmegaConf.load(run_dir / "config.yaml")
    decision = decide(run_dir, job_id, exit_code, int(cfg.launcher.max_restarts))
    if decision["action"] == "done":
        return 0
    if decision["action"] == "resubmit":
        exclude = sorted(set(decision["excluded"]) | set(_csv(cfg.cluster.exclude)))
        why = cannot_fit(partition_nodes(cfg.cluster.partition), exclude, int(cfg.cluster.nodes),
                         cfg.cluster.partition)
        if why:
            decision = {**decision, "action": "stop", "why": why}
    record = {"job_id": job_id, "exit_code": exit_code, "time": time.time(), **decision}
    if decision["action"] == "stop":
        (run_dir / REPORT).write_text(json.dumps(record, indent=1))
        print(f"hpctrain supervisor: job {job_id} failed; not resubmitting: {decision['why']}. "
              f"Report: {run_dir / REPORT}", flush=True)
        return exit_code
    new_id = resubmit(run_dir / "submitit", job_id, exclude)
    record["resubmitted_as"] = new_id
    with open(run_dir / ATTEMPTS, "a") as f:
        f.write(json.dumps(record) + "\n")
    with open(run_dir / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": new_id, "executor": "slurm", "submitted": time.time(),
                            "resubmission_of": job_id, "exclude": exclude}) + "\n")
    print(f"hpctrain supervisor: job {job_id} failed (exit {exit_code}); resubmitted as {new_id}"
          + (f" excluding {','.join(exclude)}" if exclude else ""), flush=True)
    return exit_code  # the batch script's status: this job stays FAILED in sacct


def _csv(value: str | None) -> list[str]:
    return [v for v in (value or "").split(",") if v]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
