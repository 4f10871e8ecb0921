"""What the benchmarks on the local Slurm cluster share: submit the smoke model there, read its metrics, ask
sacct for a job's state."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hpctrain.records.paths import RunPaths


def submit_smoke(
    root: Path, run_id: str, steps: int, ram_interval: int, shared_interval: int, *overrides: str
) -> tuple[str, Path]:
    """Submit `+experiment=smoke cluster=dev` with a RAM tier (each node's own /dev/shm, replicated to a peer)
    and a shared tier; returns (job id, run dir)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctrain",
            "+experiment=smoke",
            "cluster=dev",
            f"train.max_steps={steps}",
            "optim.warmup_steps=20",
            f"run.root={root}",
            f"run.id={run_id}",
            "train.log_every=50",
            *overrides,
            f"checkpoint.tiers=[{{name: ram, path: /dev/shm/hpctrain-bench/{root.name}, "
            f"interval_steps: {ram_interval}, "
            f"keep_last: 2}}, {{name: shared, path: checkpoints, interval_steps: {shared_interval}, "
            "keep_last: 1}]",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return re.search(r"submitted job (\d+)", proc.stdout).group(1), root / "smoke" / run_id


def metrics(run_dir: Path) -> list[dict]:
    """The rows written so far (a row still being written, without its newline, is left for the next read)."""
    path = RunPaths(run_dir).metrics
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def state(job: str) -> str:
    """The job's current state: sacct's last record (a job that lost a node under --no-kill has a RESIZING
    record before it; a requeued one, the earlier attempts')."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True, text=True
    ).stdout.splitlines()  # one record a line ("CANCELLED by 0" has spaces)
    return out[-1].strip() if out else ""
