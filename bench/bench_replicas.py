#!/usr/bin/env python3
"""Goodput of replica groups (`recovery=replicas`, torchft) against today's restart of every rank, on the real
local Slurm cluster, under the same injected failures.

Both runs train the smoke model for `--steps` steps on 2 nodes x 2 workers with the same global batch and a RAM
checkpoint tier every `--interval` steps; they alternate (restart, replicas, restart, ...: `--repeats` of each) so
that the machine's weather falls on both. Failures are rank crashes (SIGKILL of one worker: the OOM killer, a
segfault) at exponentially distributed times (mean `--mtbf` seconds of training, seeded, the same draws for both
modes), at most `--failures` a run:
- restart: the node agents stop every worker of the job and start them again; they resume from the RAM tier and
  train again the steps since it;
- replicas: 2 groups of 1 node each; the crashed worker's group restarts alone and heals from the other group,
  which takes its steps alone meanwhile (half the samples of those steps are not trained on).
Goodput here = the work the run kept, in full steps (a step with 1 of 2 groups counts 1/2; a step trained again
counts once), times the undisturbed step time (the median of steps no failure touched), over the training window
(first step to last). It counts what a failure costs the run in time and samples, not start-up or shutdown.

    python bench/bench_replicas.py [--steps 400 --interval 25 --mtbf 25 --failures 4 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_goodput import current_job, kill_rank  # noqa: E402
from devcluster import metrics, state, submit_smoke  # noqa: E402

from hpctrain.entry import EntryParser  # noqa: E402

MODES = {
    "restart": ["recovery=restart"],
    "replicas": ["recovery=replicas", "recovery.heartbeat_timeout_ms=500", "recovery.join_timeout_ms=500"],
}


def run(mode: str, root: Path, args: argparse.Namespace, draws: list[float]) -> dict[str, Any]:
    """One run of `mode` with failures after the given seconds of training; its measures."""
    job, run_dir = submit_smoke(
        root,
        f"{mode}-{int(time.time())}",
        args.steps,
        args.interval,
        100000,
        *MODES[mode],
        "train.global_batch=32",
        "train.micro_batch=8",
        "train.log_every=1",
    )
    rng = random.Random(args.seed)
    failures: list[float] = []
    trained_s, last = 0.0, None
    while True:
        rows = metrics(run_dir)
        # the run's end: COMPLETED.json (group 0's, or the group that finished while group 0 was out)
        if (run_dir / "COMPLETED.json").exists() and state(current_job(run_dir)) == "COMPLETED":
            break
        if (run_dir / "FAILED.json").exists():
            raise SystemExit(f"{mode}: the run failed: {(run_dir / 'FAILED.json').read_text()}")
        now = time.time()
        training = bool(rows) and now - rows[-1]["time"] < 2
        if training and last is not None:
            trained_s += now - last
        last = now if training else None
        if training and len(failures) < len(draws) and trained_s >= sum(draws[: len(failures) + 1]):
            kill_rank(job, rng)
            failures.append(now)
        time.sleep(0.1)
    return measure(mode, run_dir, failures, args.steps)


def measure(mode: str, run_dir: Path, failures: list[float], steps: int) -> dict[str, Any]:
    """Group 0's rows (the run's) and, for the steps it missed while it was out, group 1's: a step's last run
    counts, with the groups that took part in it."""
    rows = metrics(run_dir)
    last_run: dict[int, dict[str, Any]] = {}
    for r in rows:  # a step trained again: its last run counts
        last_run[r["step"]] = r
    for r in metrics(run_dir / "replicas" / "g1"):  # empty with recovery=restart
        last_run.setdefault(r["step"], r)
    kept = sum(r.get("participants", 2) / 2 for r in last_run.values())
    quiet = [
        r["step_time_s"]
        for r in rows
        if r["step"] > 5 and all(abs(r["time"] - f) > 10 for f in failures) and r.get("participants", 2) == 2
    ]
    step_s = statistics.median(quiet)
    ends = [r["time"] for r in last_run.values()]
    window = max(ends) - min(ends) + rows[0]["step_time_s"]
    return {
        "mode": mode,
        "run_dir": str(run_dir),
        "failures": len(failures),
        "step_s": step_s,
        "window_s": window,
        "kept_steps": kept,
        "redone_steps": len(rows) - len({r["step"] for r in rows}),
        "alone_steps": sum(1 for r in last_run.values() if r.get("participants", 2) < 2),
        "goodput": kept * step_s / window,
    }


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--interval", type=int, default=25, help="RAM tier interval (steps)")
    parser.add_argument("--mtbf", type=float, default=25.0, help="mean seconds of training between failures")
    parser.add_argument("--failures", type=int, default=4, help="at most this many a run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    draws_rng = random.Random(args.seed)
    draws = [draws_rng.expovariate(1 / args.mtbf) for _ in range(args.failures)]
    print(f"failures after {', '.join(f'{d:.1f}' for d in draws)} s of training (each run)", flush=True)
    results: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="bench-replicas-", dir="/tmp")  # kept: each run's files, to read its incidents
    print(f"runs under {tmp}", flush=True)
    for repeat in range(args.repeats):
        for mode in MODES:
            result = run(mode, Path(tmp) / f"{mode}{repeat}", args, draws)
            results.append(result)
            print(
                f"{mode:9s} #{repeat}: goodput {result['goodput']:.1%} ({result['kept_steps']:.1f} steps kept "
                f"x {result['step_s']:.3f} s / {result['window_s']:.1f} s), {result['failures']} failures, "
                f"{result['redone_steps']} steps redone, {result['alone_steps']} with 1 of 2 groups",
                flush=True,
            )
    by_mode = {m: [r["goodput"] for r in results if r["mode"] == m] for m in MODES}
    ratios = [rep / res for rep, res in zip(by_mode["replicas"], by_mode["restart"])]
    print(
        f"\ngoodput at MTBF {args.mtbf:.0f} s: restart {statistics.median(by_mode['restart']):.1%}, replicas "
        f"{statistics.median(by_mode['replicas']):.1%}; replicas / restart, per repeat: "
        + ", ".join(f"{x:.3f}" for x in ratios)
    )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
