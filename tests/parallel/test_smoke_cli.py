"""The training loop path end to end: `python -m hpctrain` with a pipeline layout (GPT) or tensor and sequence
parallelism (Llama), local executor, 2 processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["parallel.pp=2"], ["model=llama_tiny", "parallel.tp=2", "parallel.sequence_parallel=true"]],
    ids=["gpt_pp2", "llama_tp2_sp"],
)
def test_smoke_run(tmp_path: Path, layout: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hpctrain",
        "+experiment=smoke",
        *layout,
        "train.micro_batch=4",
        "train.max_steps=12",
        "optim.warmup_steps=4",
        "train.log_every=4",
        f"run.root={tmp_path / 'runs'}",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+/12 \| loss ([0-9.]+)", out.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0], out.stdout[-2000:]
    assert "MFU" in out.stdout and "peak mem" in out.stdout
