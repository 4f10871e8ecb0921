#!/usr/bin/env python3
"""Recovery costs on the real local Slurm cluster (slurm/dev-cluster.sh up first). Printed, not asserted.

- submit-to-first-step: from `python -m hpctrain ... cluster=dev` to the first logged training step;
- signal-to-resumed-step: from `scancel --signal=USR2` to the first step of the requeued job;
- goodput of a run preempted every ~`--every` seconds: time spent in steps that count (each step once) over
  the wall time from submission to the end.

    python bench/bench_slurm.py [--steps 600] [--every 60] [--max-signals 3]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without an install too

from devcluster import metrics, state, submit_smoke  # noqa: E402

from hpctrain.entry import EntryParser  # noqa: E402


def signal_to_resumed(run_dir: Path, rows: list[dict], signals: list[float]) -> list[float]:
    """Seconds from each signal to the start of the first step of the requeued attempt (found through the
    resume events: the resumed step follows the saved one, so the step count does not go back)."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumes = [e["time"] for e in events if e["event"] == "resume"]
    out = []
    for t in signals:
        resume = next((r for r in resumes if r > t), None)
        first = next((r for r in rows if resume is not None and r["time"] > resume), None)
        if first is not None:
            out.append(first["time"] - first["step_time_s"] - t)
    return out


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--max-signals", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpctrain-bench-slurm-"))
    submitted = time.time()
    job, run_dir = submit_smoke(root, "bench", args.steps, 50, 1000)
    signals: list[float] = []
    last_signal = submitted
    while True:
        m = metrics(run_dir)
        s = state(job)
        if s in ("COMPLETED", "FAILED", "CANCELLED") and m and m[-1]["step"] == args.steps:
            break
        if s == "FAILED":
            raise SystemExit(f"job {job} failed")
        running = m and time.time() - m[-1].get("time", 0) < 5
        if running and len(signals) < args.max_signals and time.time() - last_signal >= args.every:
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
            signals.append(time.time())
            last_signal = signals[-1]
        time.sleep(0.5)
    ended = max(m["time"] for m in metrics(run_dir))
    rows = metrics(run_dir)
    first_step = rows[0]["time"] - rows[0]["step_time_s"]
    resumed = signal_to_resumed(run_dir, rows, signals)
    final = {}
    for r in rows:
        final[r["step"]] = r
    useful = sum(r["step_time_s"] for r in final.values())
    print(f"job {job}: {args.steps} steps, {len(signals)} USR2 signals, run dir {run_dir}")
    print(f"submit-to-first-step:      {first_step - submitted:6.1f} s")
    for i, dt in enumerate(resumed):
        print(f"signal-to-resumed-step #{i + 1}: {dt:6.1f} s")
    print(f"steps logged {len(rows)} for {len(final)} distinct (redone: {len(rows) - len(final)})")
    print(f"goodput: {useful:.1f} s of steps / {ended - submitted:.1f} s wall = {useful / (ended - submitted):.1%}")


if __name__ == "__main__":
    main()
