#!/usr/bin/env python3
"""What a failure costs with recovery inside the allocation, part by part, on the real Slurm dev cluster.

One run per incident (`+experiment=smoke cluster=dev`: 2 nodes x 2 workers, a RAM tier every 10 steps):
- raise: rank 1 raises at step 35 (`HPCTRAIN_INJECT_FAULT=raise:step=35:rank=1:once`);
- kill: this script SIGKILLs a worker (the first agent's second) once step 35 is logged (as the OOM killer
  would);
- hang: rank 1 sleeps at step 35 and the hang watchdog (health.hang_timeout_s=10, the least the checks allow)
  ends it;
- node-spare, node-shrink, node-requeue: the job's second node dies at step 35 (`slurm/dev-cluster.sh
  kill-node`: slurmd and every process in its namespace) and a hot spare takes its place
  (cluster.spare_nodes=1), or the job goes on with one node (elastic.min_nodes=1), or Slurm requeues it;
- node0-spare: the job's first node dies (rank 0's, the batch host, the rendezvous store's host): the store
  moves to the next node and the spare takes the dead node's slot there;
- node-spare-silent, node-shrink-silent, node0-spare-silent: as node-spare, node-shrink and node0-spare, but
  the node's link goes down before its processes die (a power loss): the survivors' connections to it go
  silent instead of closing.
Every node's RAM tier is its own /dev/shm (replicated to the next node): after a node death its state
comes from the peers' copies.
Each incident is broken down like nvidia-resiliency-ext's restart-latency table, from the run's own records
(failure records, the watchdog's record, the restarted attempt's "attempt" event): detection, teardown +
rendezvous + process spawn (the agents' part), imports, joining the process group, then the state load part by
part (lease and host list, watchdog and pre-flight, engine build, checkpoint manager, state read, with the tier;
data and tracker), the first step; and the total from the failure to the next completed step.

With `--busy N`, a raise is also run with N jobs of the whole cluster queued behind the run, once with agents
and once with resubmission: the resubmitted job waits for the queue, the agents do not leave the allocation.

    slurm/dev-cluster.sh up && python bench/bench_restart.py [--kinds raise kill hang] [--busy 2]
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_goodput import job_workers  # noqa: E402
from devcluster import metrics, state, submit_smoke  # noqa: E402

from hpctrain.entry import EntryParser
from hpctrain.records.history import ATTEMPT_MARKS, ATTEMPT_PARTS  # noqa: E402
from hpctrain.records.paths import RunPaths  # noqa: E402

STEP = 35  # the failing step; the RAM tier's last save before it is step 30
STEPS = 80
DEV_CLUSTER = Path(__file__).resolve().parents[1] / "slurm" / "dev-cluster.sh"
# A whole node dies (slurmd and every process in its namespace): a hot spare takes its place, or the job
# shrinks to the node left, or (neither) Slurm requeues the job for NODE_FAIL onto other nodes.
# kind -> (the victim: its node index in the job, the run's overrides)
NODE_DEATHS = {
    "node-spare": (1, ["cluster.spare_nodes=1"]),
    "node0-spare": (0, ["cluster.spare_nodes=1"]),
    "node-shrink": (1, ["elastic.min_nodes=1"]),
    "node-requeue": (1, []),
    "node-spare-silent": (1, ["cluster.spare_nodes=1"]),
    "node-shrink-silent": (1, ["elastic.min_nodes=1"]),
    "node0-spare-silent": (0, ["cluster.spare_nodes=1"]),
}
# These die as a node losing power does: its link goes down first, so its peers see silence, not closed
# connections (`kill-node --silent`).
SILENT = {"node-spare-silent", "node-shrink-silent", "node0-spare-silent"}


def run_incident(
    root: Path, kind: str, in_allocation: bool = True, blockers: int = 0, blocker_s: int = 60
) -> dict[str, Any]:
    """One run with one incident; `blockers` jobs of the whole cluster are queued behind it (a busy cluster)."""
    overrides = ["health.preflight=off", "train.log_every=1000", f"launcher.in_allocation={in_allocation}"]
    if kind in ("raise", "hang"):
        overrides.append(f"+cluster.env.HPCTRAIN_INJECT_FAULT='{kind}:step={STEP}:rank=1:once'")
    if kind == "hang":
        overrides += ["health.hang_timeout_s=10", "health.hang_factor=5"]
    overrides += NODE_DEATHS[kind][1] if kind in NODE_DEATHS else []
    name = f"{kind}-{'agents' if in_allocation else 'resubmit'}" + (f"-busy{blockers}" if blockers else "")
    job, run_dir = submit_smoke(root, name, STEPS, 10, 1000, *overrides)
    for i in range(blockers):  # behind the run in the queue: they get its nodes whenever it leaves them
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--nodes={len(nodes())}",
                "--exclusive",
                f"--output={root}/blocker{i}.out",
                "--wrap",
                f"sleep {blocker_s}",
            ],
            check=True,
            capture_output=True,
        )
    killed_at = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rows = metrics(run_dir)
        if kind == "kill" and killed_at is None and rows and rows[-1]["step"] >= STEP:
            os.kill(job_workers(job)[1], signal.SIGKILL)  # the first agent's second worker
            killed_at = time.time()
        if kind in NODE_DEATHS and killed_at is None and rows and rows[-1]["step"] >= STEP:
            victim = job_nodes(job)[NODE_DEATHS[kind][0]]
            subprocess.run(
                ["bash", str(DEV_CLUSTER), "kill-node", victim, *(["--silent"] if kind in SILENT else [])],
                check=True,
                capture_output=True,
            )
            killed_at = time.time()
        rows = metrics(run_dir)
        # (a job whose batch host died is ended by hpctrain once the run is over: CANCELLED)
        if (
            rows
            and rows[-1]["step"] == STEPS
            and state(latest_job(run_dir)).split()[0] in ("COMPLETED", "FAILED", "CANCELLED")
        ):
            break
        time.sleep(0.1)
    if kind in NODE_DEATHS:
        subprocess.run(["bash", str(DEV_CLUSTER), "revive-node", victim], capture_output=True)
        time.sleep(5)  # back in service before the next incident
    result = breakdown(run_dir, job, kind, killed_at)
    return {**result, "in_allocation": in_allocation, "blockers": blockers, "name": name}


def job_nodes(job: str) -> list[str]:
    listed = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True).stdout.split()


def nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    return sorted(set(out.split()))


def latest_job(run_dir: Path) -> str:
    return json.loads(RunPaths(run_dir).jobs.read_text().splitlines()[-1])["job_id"]


def breakdown(run_dir: Path, job: str, kind: str, killed_at: float | None) -> dict[str, Any]:
    paths = RunPaths(run_dir)
    records = [json.loads(p.read_text()) for p in paths.failures(job).glob("rank*.json")]
    own = [r for r in records if r["rank"] == 1]
    if kind == "kill" or kind in NODE_DEATHS:
        failed = killed_at
    elif kind == "hang":  # the fault's marker is written as the rank starts to hang
        failed = (paths.faults / f"hang-{STEP}-1.fired").stat().st_mtime
    else:
        failed = own[0]["time"]
    noticed = min(r["time"] for r in records) if records else failed
    events = [json.loads(line) for line in paths.events.read_text().splitlines()]
    # the next attempt: a restart in the same job, or the resubmitted job's first
    attempt = next(e for e in events if e["event"] == "attempt" and e["process_started"] > failed)
    resume = [e for e in events if e["event"] == "resume"]
    steps = [m["step"] for m in metrics(run_dir)]
    parts = {
        "detection": noticed - failed,
        "teardown to spawn (rendezvous or queue)": attempt["process_started"] - noticed,
    }
    for label, (start, end) in zip(ATTEMPT_PARTS, itertools.pairwise(ATTEMPT_MARKS)):
        parts[label] = attempt[end] - attempt[start]
    return {
        "kind": kind,
        "job": job,
        "state": state(latest_job(run_dir)),
        "parts": parts,
        "total": attempt["first_step"] - failed,
        "tier": resume[-1]["tier"] if resume else None,
        "from_step": attempt["from_step"],
        "fetched_bytes": resume[-1].get("fetched_bytes", 0) if resume else 0,
        "redone": len(steps) - len(set(steps)),
        "jobs": len(paths.jobs.read_text().splitlines()),
    }


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--kinds", nargs="+", default=["raise", "kill", "hang", *NODE_DEATHS])
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="also: a raise on a busy cluster (N jobs of every node queued behind the run), with "
        "agents and with resubmission (launcher.in_allocation=false), side by side",
    )
    parser.add_argument("--blocker-s", type=int, default=60, help="how long each queued job runs")
    parser.add_argument("--out", type=Path, default=Path("bench/restart_breakdown.json"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpctrain-bench-restart-"))
    results = [run_incident(root, kind) for kind in args.kinds]
    if args.busy:
        results += [run_incident(root, "raise", agents, args.busy, args.blocker_s) for agents in (True, False)]
    args.out.write_text(json.dumps(results, indent=1))
    names = list(results[0]["parts"])
    print(f"{'incident':<22}" + "".join(f" {n:>{len(n) + 1}}" for n in names) + f"{'total':>9}  tier, resumed at, job")
    for r in results:
        print(
            f"{r['name']:<22}" + "".join(f" {r['parts'][n]:>{len(n)}.2f}s" for n in names) + f"{r['total']:>8.2f}s  "
            f"{r['tier']}, step {r['from_step']}, {r['jobs']} job(s) ({r['state']})"
        )


if __name__ == "__main__":
    main()
