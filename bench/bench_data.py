"""How long training steps wait for their data: the smoke run (flat byte tokens) and the stdlib_bpe run (a
blended, packed Megatron-format dataset), each with the background read-ahead on (the default) and off.

Runs the real command (`python -m hpctrain`, 2 processes, submitit's local executor) and reads each run's
metrics.jsonl: the median per-step data wait as a share of the median step time. The goal is < 1% with the
read-ahead. The run without it is the reference measured in the same session: what reading on the training
thread would cost.

    python bench/bench_data.py [--steps 60] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without an install too

from hpctrain.entry import EntryParser  # noqa: E402

CASES = {
    "smoke (flat bytes)": ["+experiment=smoke"],
    "stdlib_bpe (indexed, packed)": ["+experiment=stdlib_bpe", "train.eval_every=0"],
    "stdlib_bpe, 2-way blend": ["+experiment=stdlib_bpe", "train.eval_every=0", "data.prepare.inputs=[]"],
}


def run(overrides: list[str], root: Path, env: dict[str, str]) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *overrides, f"run.root={root}"],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "WANDB_MODE": "offline"},
    )
    if proc.returncode:
        raise SystemExit(f"hpctrain failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_share(metrics: list[dict]) -> tuple[float, float, float]:
    """(median data wait s, median step s, their ratio), the first steps (warm-up) left out."""
    rows = metrics[5:]
    wait = statistics.median(m["data_wait_s"] for m in rows)
    step = statistics.median(m["step_time_s"] for m in rows)
    return wait, step, wait / step


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {"HPCTRAIN_CACHE": f"{tmp}/cache"}
        prefix = f"{tmp}/cache/stdlib_bpe4096/stdlib"
        run(["+experiment=stdlib_bpe", "train.max_steps=1", "train.eval_every=0"], Path(tmp) / "prep", env)
        blend = f"data.blend='0.6 {prefix} 0.4 {prefix}'"  # the same data twice: the blending path, measured
        print(f"{'case':34} {'read-ahead':>10} {'wait ms':>9} {'step ms':>9} {'wait/step':>10}")
        for name, overrides in CASES.items():
            if "blend" in name:
                overrides = [*overrides, blend]
            for prefetch in (1, 0):
                metrics = run(
                    [*overrides, f"train.max_steps={args.steps}", f"data.prefetch={prefetch}"], Path(tmp) / "runs", env
                )
                wait, step, share = wait_share(metrics)
                out[f"{name}, prefetch={prefetch}"] = {"wait_s": wait, "step_s": step, "share": share}
                print(f"{name:34} {'on' if prefetch else 'off':>10} {wait * 1e3:9.3f} {step * 1e3:9.1f} {share:10.2%}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
