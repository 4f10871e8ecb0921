#!/usr/bin/env python3
"""Goodput under injected failures on the real local Slurm cluster, against the model's prediction.

The smoke model trains on the dev cluster (slurm/dev-cluster.sh up first) with a RAM checkpoint tier every
`--interval` steps. A failure is injected at exponentially distributed times (mean `--mtbf` seconds, seeded,
at most `--failures`): `scontrol requeue` of the running job, which ends its tasks without any signal, as a
crash would, so the work since the last checkpoint is lost. Measured: goodput (time in steps that count, each
step once, over the wall time from the first step to the last), the blocked time per save, the restart cost
(failure to the first step of the next attempt) and the work lost per failure. The model
(hpctrain/goodput/model.py, exact renewal form) predicts goodput from the same measured costs and MTBF.
The measured costs are written in the `hpctrain.goodput.costs/1` schema for tools/goodput.py.

    python bench/bench_goodput.py [--steps 1500 --interval 50 --mtbf 60 --failures 4 --out costs.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.goodput.model import goodput_exact  # noqa: E402


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def state(job: str) -> str:
    return subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--interval", type=int, default=50, help="RAM tier interval in steps")
    parser.add_argument("--mtbf", type=float, default=60.0)
    parser.add_argument("--failures", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/goodput_costs.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="hpctrain-bench-goodput-"))
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "+experiment=smoke", "cluster=dev",
                           f"train.max_steps={args.steps}", "optim.warmup_steps=20", f"run.root={root}",
                           "run.id=goodput", "train.log_every=100", "health.preflight=off",
                           f"checkpoint.tiers=[{{name: ram, path: {root}/shm, interval_steps: {args.interval}, "
                           "keep_last: 2}, {name: shared, path: checkpoints, interval_steps: 100000, keep_last: 1}]"],
                          capture_output=True, text=True, check=True)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = root / "smoke" / "goodput"
    failures: list[float] = []
    next_failure = None
    while True:
        rows = metrics(run_dir)
        if state(job) == "COMPLETED" and rows and rows[-1]["step"] == args.steps:
            break
        if state(job) in ("FAILED", "CANCELLED"):
            raise SystemExit(f"job {job} ended {state(job)}")
        training = rows and time.time() - rows[-1]["time"] < 2
        if training and next_failure is None and len(failures) < args.failures:
            next_failure = time.time() + rng.expovariate(1 / args.mtbf)
        if training and next_failure is not None and time.time() >= next_failure:
            subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
            failures.append(time.time())
            next_failure = None
        time.sleep(0.2)

    rows = metrics(run_dir)
    start = rows[0]["time"] - rows[0]["step_time_s"]
    end = rows[-1]["time"]
    final = {r["step"]: r for r in rows}
    useful = sum(r["step_time_s"] for r in final.values())
    step_s = statistics.median(r["step_time_s"] for r in rows)
    blocked = [r["ckpt/ram/blocked_s"] for r in rows if "ckpt/ram/blocked_s" in r]
    totals = [r["ckpt/ram/total_s"] for r in rows if "ckpt/ram/total_s" in r]
    restarts, lost = [], []
    # The next attempt starts where the step count goes back (it resumes from the last checkpoint).
    boundaries = [i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"]]
    for t in failures:
        i = next((i for i in boundaries if rows[i]["time"] > t), None)
        if i is None:
            continue
        restarts.append(rows[i]["time"] - rows[i]["step_time_s"] - t)
        lost.append(rows[i - 1]["step"] - (rows[i]["step"] - 1))
    (run_dir / "injected_failures.json").write_text(json.dumps(failures))
    c = statistics.median(blocked)
    tau = args.interval * step_s
    r = statistics.mean(restarts) if restarts else 0.0
    wall = end - start
    measured = useful / wall
    predicted = goodput_exact(tau, c, args.mtbf, r, statistics.median(totals) if totals else 0.0)
    observed_mtbf = wall / max(1, len(failures))
    plug_in = goodput_exact(tau, c, observed_mtbf, r, statistics.median(totals) if totals else 0.0)
    costs = {"schema": "hpctrain.goodput.costs/1",
             "state_bytes_per_node": None,
             "tiers": {"ram": {"blocked_s": c, "write_s": statistics.median(totals) if totals else 0.0,
                               "durable": False}},
             "restart_s": r, "p_fast": 1.0,
             "source": f"bench/bench_goodput.py on the dev cluster, job {job}, {time.strftime('%Y-%m-%d %H:%M')}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(costs, indent=1))
    print(f"job {job}: {args.steps} steps of {step_s:.3f} s, RAM tier every {args.interval} steps ({tau:.1f} s), "
          f"{len(failures)} injected failures (scontrol requeue, mean {args.mtbf:.0f} s apart)")
    print(f"checkpoint blocked per save C = {c * 1e3:.1f} ms (median of {len(blocked)}), "
          f"commit after {statistics.median(totals) if totals else 0:.2f} s")
    print(f"restart cost R = {r:.1f} s (failure -> first step of the next attempt: "
          f"{', '.join(f'{x:.1f}' for x in restarts)})")
    print(f"lost steps per failure: {lost} (expected about interval/2 = {args.interval / 2:.0f})")
    print(f"measured goodput: {useful:.1f} s of unique steps / {wall:.1f} s wall = {measured:.1%}")
    print(f"model (exact renewal form, MTBF {args.mtbf:.0f} s): {predicted:.1%}; with the observed failure rate "
          f"(one per {observed_mtbf:.0f} s): {plug_in:.1%}; difference {abs(measured - plug_in) * 100:.1f} pp")
    print(f"measured costs written to {args.out}")


if __name__ == "__main__":
    main()
