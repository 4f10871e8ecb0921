#!/usr/bin/env python3
"""Goodput under injected failures on the real local Slurm cluster: measured here, by the run's own ledger
(`python -m hpctrain.status`), and predicted by the model.

The smoke model trains on the dev cluster (slurm/dev-cluster.sh up first) with a RAM checkpoint tier every
`--interval` steps. Failures are injected at exponentially distributed times (mean `--mtbf` seconds, seeded,
at most `--failures`), their kinds taken in turn from `--kinds`:
- rank-crash (default): SIGKILL one worker; the agents restart every worker inside the allocation;
- crash: SIGKILL every process of the job (agents and workers): srun fails and the supervisor resubmits it;
- usr2: `scancel --signal=USR2` (a preemption's or time limit's warning): hpctrain saves, requeues itself;
- preempt: `scontrol requeue` (SIGTERM): hpctrain saves at the step boundary, Slurm requeues;
- node-death: the job's last node dies (slurm/dev-cluster.sh kill-node; revived once the run trains again):
  Slurm requeues the job (NODE_FAIL) onto the nodes left.
Measured here, independently of hpctrain's ledger: goodput over the allocations (time in the steps that count,
each once, less their data wait, over the node-seconds Slurm's accounting says the run's jobs held), goodput
over the training window (first step to last), the blocked time per save, the restart cost and the work lost
per failure. The ledger's goodput is compared with the first, its parts' sum with the accounted wall time.
The model (hpctrain/goodput/model.py, exact renewal form) predicts goodput from the same measured costs
and MTBF. The measured costs are written in the `hpctrain.goodput.costs/1` schema for tools/goodput.py.

    python bench/bench_goodput.py [--steps 1500 --interval 12 --mtbf 60 --failures 4 --kinds rank-crash ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from devcluster import metrics, state, submit_smoke  # noqa: E402

from hpctrain.entry import EntryParser
from hpctrain.goodput.model import goodput_exact  # noqa: E402


def job_processes(job: str) -> dict[int, dict[bytes, bytes]]:
    """The processes of the job's step 0 on this machine's nodes (tasks, and the workers their agents start),
    by pid, with their environments; slurmd, srun and the batch script are not among them."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if (
            env.get(b"SLURM_JOB_ID") == job.encode()
            and env.get(b"SLURM_STEP_ID") == b"0"
            and b"SUBMITIT_EXECUTOR" in env
        ):
            found[int(proc.name)] = env
    return found


def kill(pids: list[int]) -> int:
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def job_workers(job: str) -> list[int]:
    """The training workers of the job: the children of its agents (forked, so their environment in /proc is
    the agent's), in the order the agents started them (by pid)."""
    procs = job_processes(job)

    def parent(pid: int) -> int:
        try:
            return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return -1

    return sorted(pid for pid in procs if parent(pid) in procs)


def kill_rank(job: str, rng: random.Random) -> int:
    """A rank crash: SIGKILL one training worker (as the OOM killer would); its node's agent restarts every
    worker inside the allocation."""
    workers = job_workers(job)
    return kill([rng.choice(workers)]) if workers else 0


def current_job(run_dir: Path) -> str:
    """The run's newest job (a crash is resubmitted under a new id by the supervisor)."""
    return json.loads((run_dir / "jobs.jsonl").read_text().splitlines()[-1])["job_id"]


@dataclass
class Measured:
    """What the run showed (seconds unless said otherwise); c, w and r are the model's C, W and R."""

    step_s: float  # median step time
    useful: float  # time in steps that count, each step once
    wall: float  # from the first step's start to the last step's end
    blocked: list[float]  # RAM tier: blocked per save
    c: float  # median of `blocked`
    w: float  # RAM tier: median time from a save's start to its commit
    shared_blocked: float  # shared tier: medians, as for the RAM tier
    shared_write: float
    node_bytes: float  # checkpoint state per node
    restarts: list[float]  # failure -> first step of the next attempt
    r: float  # mean of `restarts`
    lost: list[int]  # steps lost per failure
    gaps: list[float]  # per step: time outside the timed step
    in_step: float  # fraction of the running time inside the timed steps
    observed_mtbf: float  # running time between failures


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument(
        "--interval",
        type=int,
        default=12,
        help="RAM tier interval in steps; 12 (2 s) is about the model's optimum sqrt(2 C M) for the "
        "measured C (20 ms blocked per save) at an MTBF of 60 s",
    )
    parser.add_argument("--mtbf", type=float, default=60.0)
    parser.add_argument("--failures", type=int, default=4)
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=["rank-crash"],
        help="the failures, taken in turn (see the module docstring); work since the last "
        "checkpoint is lost by crashes and node deaths, not by usr2 and preempt",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/goodput_costs.json"))
    parser.add_argument("--ledger-out", type=Path, help="also write the run's ledger (status --json) here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpctrain-bench-goodput-"))
    _, run_dir = submit_smoke(
        root, "goodput", args.steps, args.interval, 500, "health.preflight=off", "launcher.max_restarts=100"
    )
    failures = inject_failures(run_dir, args)
    rows = metrics(run_dir)
    (run_dir / "injected_failures.json").write_text(json.dumps(failures))
    m = measure(rows, failures)
    jobs = [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    held = allocated_node_s(jobs)
    ledger = json.loads(
        subprocess.run(
            [sys.executable, "-m", "hpctrain.status", str(run_dir), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    if args.ledger_out:
        args.ledger_out.write_text(json.dumps(ledger, indent=1))
    if set(args.kinds) <= {"rank-crash", "crash", "preempt"} and len(set(args.kinds)) == 1:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(costs(m, args.kinds[0]), indent=1))
        print(f"measured costs written to {args.out}")
    print(
        subprocess.run(
            [sys.executable, "-m", "hpctrain.status", str(run_dir)], capture_output=True, text=True, check=True
        ).stdout
    )
    print_results(args, jobs, failures, m)
    print_ledger_check(m, held, ledger)


KINDS = ("rank-crash", "crash", "usr2", "preempt", "node-death")
DEV_CLUSTER = Path(__file__).resolve().parents[1] / "slurm" / "dev-cluster.sh"


def job_nodes(job: str) -> list[str]:
    listed = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True).stdout.split()


def inject(kind: str, job: str, rng: random.Random) -> str | None:
    """One failure of `kind` to the run's current job; the node killed, for a node death."""
    if kind == "rank-crash":
        kill_rank(job, rng)
    elif kind == "crash":  # every process of the job's tasks: srun fails, the supervisor resubmits
        subprocess.run(["bash", str(DEV_CLUSTER), "kill-job", job], check=True, capture_output=True)
    elif kind == "usr2":
        subprocess.run(["scancel", "--signal=USR2", job], check=True, capture_output=True)
    elif kind == "preempt":
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
    else:
        victim = job_nodes(job)[-1]
        subprocess.run(["bash", str(DEV_CLUSTER), "kill-node", victim], check=True, capture_output=True)
        return victim
    return None


def inject_failures(run_dir: Path, args: argparse.Namespace) -> list[float]:
    """Failures at exponentially distributed times while the run trains, until it completes; their times. A
    killed node is revived 10 s later (Slurm has requeued its job by then)."""
    rng = random.Random(args.seed)
    failures: list[float] = []
    next_failure = None
    dead: str | None = None
    while True:
        rows = metrics(run_dir)
        job = current_job(run_dir)
        if rows and rows[-1]["step"] == args.steps and state(job) == "COMPLETED":
            return failures
        if (run_dir / "FAILED.json").exists():
            raise SystemExit(f"the run failed: {(run_dir / 'FAILED.json').read_text()}")
        training = rows and time.time() - rows[-1]["time"] < 2
        if dead is not None and time.time() > failures[-1] + 10:  # the requeue may need it (excluded nodes)
            subprocess.run(["bash", str(DEV_CLUSTER), "revive-node", dead], capture_output=True)
            dead = None
        if training and next_failure is None and len(failures) < args.failures:
            next_failure = time.time() + rng.expovariate(1 / args.mtbf)
        if training and next_failure is not None and time.time() >= next_failure:
            dead = inject(args.kinds[len(failures) % len(args.kinds)], job, rng) or dead
            failures.append(time.time())
            next_failure = None
        time.sleep(0.2)


def allocated_node_s(jobs: list[str]) -> float:
    """Node-seconds the jobs held, every run of each (requeues), from Slurm's accounting directly."""
    out = subprocess.run(
        ["sacct", "-X", "-D", "-P", "-n", "-o", "Start,End,NNodes", "-j", ",".join(jobs)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
    )
    held = 0.0
    for line in out.stdout.splitlines():
        start, end, nodes = line.split("|")
        if start.isdigit() and end.isdigit():
            held += (int(end) - int(start)) * int(nodes)
    return held


def measure(rows: list[dict[str, Any]], failures: list[float]) -> Measured:
    start = rows[0]["time"] - rows[0]["step_time_s"]
    end = rows[-1]["time"]
    final = {r["step"]: r for r in rows}
    useful = sum(r["step_time_s"] - r.get("data_wait_s", 0.0) for r in final.values())
    step_s = statistics.median(r["step_time_s"] for r in rows)
    blocked = [r["ckpt/ram/blocked_s"] for r in rows if "ckpt/ram/blocked_s" in r]
    totals = [r["ckpt/ram/total_s"] for r in rows if "ckpt/ram/total_s" in r]
    shared_blocked = [r["ckpt/shared/blocked_s"] for r in rows if "ckpt/shared/blocked_s" in r]
    shared_totals = [r["ckpt/shared/total_s"] for r in rows if "ckpt/shared/total_s" in r]
    node_bytes = max(r["ckpt/ram/bytes"] for r in rows if "ckpt/ram/bytes" in r) / 2  # 2 nodes
    restarts, lost = restart_costs(rows, failures)
    # Per-step work outside the timed step (logging, agreement all-reduces): part of each attempt's running
    # time that the model counts as training, so the prediction is scaled by the measured fraction.
    gaps = [
        b["time"] - b["step_time_s"] - a["time"]
        for a, b in zip(rows, rows[1:])
        if 0 <= b["time"] - b["step_time_s"] - a["time"] < 1.0
    ]
    in_step = step_s / (step_s + statistics.mean(gaps)) if gaps else 1.0
    c = statistics.median(blocked)
    w = statistics.median(totals) if totals else 0.0
    restart_s = statistics.mean(restarts) if restarts else 0.0
    wall = end - start
    observed_mtbf = (wall - restart_s * len(failures)) / max(1, len(failures))  # running time between failures
    return Measured(
        step_s=step_s,
        useful=useful,
        wall=wall,
        blocked=blocked,
        c=c,
        w=w,
        shared_blocked=statistics.median(shared_blocked),
        shared_write=statistics.median(shared_totals),
        node_bytes=node_bytes,
        restarts=restarts,
        r=restart_s,
        lost=lost,
        gaps=gaps,
        in_step=in_step,
        observed_mtbf=observed_mtbf,
    )


def restart_costs(rows: list[dict[str, Any]], failures: list[float]) -> tuple[list[float], list[int]]:
    """Per failure: seconds to the first step of the next attempt, and the steps lost."""
    restarts, lost = [], []
    for t in failures:
        before = [r for r in rows if r["time"] <= t]
        # The next attempt's first step starts after the failure (rows of the old attempt may still follow).
        nxt = next(
            (
                r
                for r in rows
                if r["time"] - r["step_time_s"] > t + 1.0 and before and (r["step"] <= before[-1]["step"] + 1)
            ),
            None,
        )
        if nxt is None or not before:
            continue
        restarts.append(nxt["time"] - nxt["step_time_s"] - t)
        lost.append(before[-1]["step"] - (nxt["step"] - 1))
    return restarts, lost


def costs(m: Measured, kind: str) -> dict[str, Any]:
    """The measured costs in the `hpctrain.goodput.costs/1` schema, for tools/goodput.py."""
    return {
        "schema": "hpctrain.goodput.costs/1",
        "state_bytes_per_node": m.node_bytes,
        "tiers": {
            "ram": {"blocked_s": m.c, "write_s": m.w, "durable": False},
            "shared": {"blocked_s": m.shared_blocked, "write_s": m.shared_write, "durable": True},
        },
        "restart_s": m.r,  # p_fast is not measured here: a node failure loses the RAM tier with the node
        "source": f"bench/bench_goodput.py --kinds {kind} on the dev cluster, {time.strftime('%Y-%m-%d %H:%M')}",
    }


def predict(kind: str, tau: float, m: Measured, mtbf: float) -> tuple[float, float, str]:
    """The model's goodput at --mtbf and at the observed failure rate, and which form it used."""
    if kind not in ("preempt", "usr2"):
        return (
            goodput_exact(tau, m.c, mtbf, m.r, m.w),
            goodput_exact(tau, m.c, m.observed_mtbf, m.r, m.w),
            "exact renewal form: lost work + restart + blocking",
        )
    # a graceful stop saves at the signal: no work is lost, each failure costs the restart only
    return (
        tau / (tau + m.c) * mtbf / (mtbf + m.r),
        tau / (tau + m.c) * m.observed_mtbf / (m.observed_mtbf + m.r),
        "graceful stops: restart + blocking, no lost work",
    )


def print_results(args: argparse.Namespace, jobs: list[str], failures: list[float], m: Measured) -> None:
    tau = args.interval * m.step_s
    kind = args.kinds[0] if len(set(args.kinds)) == 1 else "mixed"
    predicted, plug_in, form = predict(kind, tau, m, args.mtbf)
    measured = m.useful / m.wall
    print(
        f"jobs {', '.join(jobs)}: {args.steps} steps of {m.step_s:.3f} s, RAM tier every {args.interval} steps "
        f"({tau:.1f} s), {len(failures)} injected failures ({', '.join(args.kinds)}; mean {args.mtbf:.0f} s apart)"
    )
    print(f"checkpoint blocked per save C = {m.c * 1e3:.1f} ms (median of {len(m.blocked)}), commit after {m.w:.2f} s")
    print(
        f"restart cost R = {m.r:.1f} s (failure -> first step of the next attempt: "
        f"{', '.join(f'{x:.1f}' for x in m.restarts)})"
    )
    print(f"lost steps per failure: {m.lost} (expected about interval/2 = {args.interval / 2:.0f} for crashes)")
    print(
        f"measured goodput in the training window: {m.useful:.1f} s of unique steps / {m.wall:.1f} s from the "
        f"first step to the last = {measured:.1%}"
    )
    print(
        f"loop overhead outside the timed step: {statistics.mean(m.gaps) * 1e3:.1f} ms per step "
        f"({1 - m.in_step:.1%} of running time)"
    )
    print(
        f"model ({form}): {predicted:.1%} at MTBF {args.mtbf:.0f} s; with the observed failure rate (one per "
        f"{m.observed_mtbf:.0f} s of running): {plug_in:.1%}; measured - model = {(measured - plug_in) * 100:+.1f} pp"
    )
    print(
        f"model x time in steps ({m.in_step:.1%}): {plug_in * m.in_step:.1%}; measured - model = "
        f"{(measured - plug_in * m.in_step) * 100:+.1f} pp"
    )


def print_ledger_check(m: Measured, held: float, ledger: dict[str, Any]) -> None:
    """The ledger against this bench: its parts against the node-seconds Slurm accounted, its goodput against
    the one measured here over the same allocations (2 nodes: each step's time counts on both)."""
    nodes = 2
    measured = m.useful * nodes / held
    parts = sum(ledger["parts"].values())
    print(
        f"allocated (sacct, every run of every job): {held:.0f} node-s; the ledger's parts sum to {parts:.1f} "
        f"node-s ({(parts - held) / held:+.2%})"
    )
    print(
        f"goodput over the allocations: measured here {measured:.2%}, ledger {ledger['goodput']:.2%} "
        f"(ledger - measured = {(ledger['goodput'] - measured) * 100:+.2f} pp)"
    )


if __name__ == "__main__":
    main()
