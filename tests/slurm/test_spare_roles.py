"""On the real Slurm dev cluster: a job with a hot spare trains on the node that holds the run's RAM checkpoint,
even when that node is the last by index, the one that would have waited as the spare (issue 48, D6)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_hpctrain
from tests.slurm.test_hpctrain_on_slurm import submit, wait_done

pytestmark = [pytest.mark.slurm]


@pytest.mark.timeout(500)
def test_the_node_holding_the_ram_checkpoint_trains_and_another_waits_as_the_spare(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    """The run trains 30 steps on n3 and n4 (its RAM tier on each: its own files and the other's copy; nothing
    on shared storage). Resumed to 40 steps with a spare on n1, n2, n3: by index n3 would be the spare and the
    RAM checkpoint unreachable (a fresh start). n3 trains with n1, n2 waits, and the run resumes from step 30
    of the RAM tier, the files the old n4 wrote fetched from n3's copy."""
    job, run_dir = submit(
        slurm_cluster, tmp_path, "roles", "cluster.exclude='n1,n2'", "train.max_steps=30", "checkpoint.save_final=false"
    )
    assert wait_done(slurm_cluster, run_dir) == {job: "COMPLETED"}
    proc = run_hpctrain(
        f"run.resume={run_dir}",
        f"run.root={tmp_path}",
        "train.max_steps=40",
        "cluster.spare_nodes=1",
        "cluster.exclude=n4",
        cwd=tmp_path,
        timeout=60,
        env=slurm_cluster.env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    states = wait_done(slurm_cluster, run_dir)
    assert states[second] == "COMPLETED", states
    nodes = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", second).stdout.strip()
    assert nodes == "n[1-3]", nodes
    logs = {n: (run_dir / "submitit" / f"{second}_{n}_log.err").read_text() for n in range(3)}
    assert "node 2: trains in slot 1 (it holds tier ram step 30" in logs[2], logs[2][-2000:]
    assert "node 1: waits as a hot spare" in logs[1], logs[1][-2000:]
    assert "node 0: trains in slot 0" in logs[0], logs[0][-2000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["tier"] == "ram" and resumed[0]["step"] == 30, resumed
    assert resumed[0]["fetched_bytes"] > 0  # n1's share came from n3's RAM
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 40 and steps.count(31) == 1 and steps.count(1) == 1  # no step trained twice
