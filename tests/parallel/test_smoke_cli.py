"""The training loop path end to end: `python -m hpctrain` with a pipeline layout, local executor, 2 processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_run_with_pipeline_parallelism(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hpctrain", "+experiment=smoke", "parallel.pp=2", "train.micro_batch=4",
           "train.max_steps=12", "optim.warmup_steps=4", "train.log_every=4", f"run.root={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+/12 \| loss ([0-9.]+)", out.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0], out.stdout[-2000:]
    assert "MFU" in out.stdout and "peak mem" in out.stdout
