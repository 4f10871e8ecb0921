"""Replica groups (`recovery=replicas`, torchft) on the real multi-node Slurm dev cluster: a whole node of one
group dies in the middle of the run; the other group never stops for more than two step times and takes steps
alone; the hot spare takes the dead node's slot, the group restarts there, heals from its live peer over the
network and rejoins; the run finishes with every group's weights equal bit for bit, and the ledger names the
incident and what it cost."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint.inspect import export_model, find
from tests.slurm.test_hpctrain_on_slurm import finished, job_states, submit, wait_for

pytestmark = [pytest.mark.slurm]
pytest.importorskip("torchft")

STEPS = 120
# Steps of about a second on the dev cluster's shared cores (a larger batch of the smoke model), so that "two step
# times" is a bound the lighthouse's 500 ms heartbeat timeout can meet.
REPLICAS = [
    "recovery=replicas",
    "recovery.heartbeat_timeout_ms=500",
    "recovery.join_timeout_ms=500",
    f"train.max_steps={STEPS}",
    "train.global_batch=128",
    "train.micro_batch=32",
    "train.log_every=1",
]
# (overrides, the victim's index among the job's nodes, whether a spare takes its slot and the group rejoins)
VARIANTS = {
    "1 node a group, a spare": (["cluster.nodes=2", "cluster.spare_nodes=1"], 1, True),
    "2 nodes a group, no spare": (["cluster.nodes=4", "cluster.spare_nodes=0", "train.global_batch=256"], 2, False),
}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / "replicas" / f"g{group}"


def final_weights(run_dir: Path, group: int) -> dict[str, torch.Tensor]:
    ckpt = find(group_dir(run_dir, group), tier="shared")
    return torch.load(export_model(ckpt, run_dir / f"export{group}" / "model.pt")[0])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_dead_groups_node_stops_nobody_else_and_the_group_heals_from_its_peer(
    slurm_cluster: Any, tmp_path: Path, variant: str
) -> None:
    """With a spare, the dead node's group restarts on it, heals and rejoins; without one (2 nodes a group), the
    group's other node leaves the run and group 0 finishes it alone."""
    overrides, victim_index, rejoins = VARIANTS[variant]
    job, run_dir = submit(slurm_cluster, tmp_path, "replicas", *REPLICAS, *overrides, shared_every=1000)
    metrics = run_dir / "metrics.jsonl"
    wait_for("step 25", lambda: any(r["step"] >= 25 and r["participants"] == 2 for r in rows(metrics)), 300, 0.5)
    nodes = slurm_cluster.run(
        "scontrol", "show", "hostnames", slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    ).stdout.split()
    victim = nodes[victim_index]  # group 1's (first) node: slots g*k .. g*k+k-1 are group g
    killed = time.time()
    subprocess.run(["bash", str(slurm_cluster.script), "kill-node", victim], check=True, capture_output=True)
    try:
        wait_for(
            "the run to finish",
            lambda: (
                max((r["step"] for r in rows(metrics)), default=0) == STEPS
                and finished(slurm_cluster, run_dir)
                and job_states(slurm_cluster, run_dir)
            ),
            500,
            every=2,
        )
    finally:
        subprocess.run(["bash", str(slurm_cluster.script), "revive-node", victim], capture_output=True)
    states = job_states(slurm_cluster, run_dir)
    assert states == {job: "COMPLETED"}, states
    got = rows(metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # group 0 never restarted nor repeated a step
    before = [r for r in got if r["time"] < killed]
    step_time = statistics.median(b["time"] - a["time"] for a, b in zip(before, before[1:]))
    gaps = [(b["step"], b["time"] - a["time"]) for a, b in zip(got, got[1:]) if b["time"] > killed]
    worst = max(gap for _, gap in gaps)
    assert worst <= 2 * step_time, (worst, step_time, gaps[:10])
    alone = [r["step"] for r in got if r["participants"] == 1 and r["time"] > killed]
    assert alone, "no step was taken by group 0 alone"
    status = subprocess.run(
        ["python", "-m", "hpctrain.status", str(run_dir)], capture_output=True, text=True, env=slurm_cluster.env()
    )
    assert "replica group 1" in status.stdout, status.stdout[-3000:]  # the ledger names the incident and its cost
    g1 = [json.loads(line) for line in (group_dir(run_dir, 1) / "events.jsonl").read_text().splitlines()]
    heal = [e for e in g1 if e["event"] == "replica_heal" and e["time"] > killed]
    if not rejoins:  # group 1 stayed out: group 0 trained alone to the end
        assert not heal and got[-1]["participants"] == 1, heal
        print(f"{variant}: step {step_time:.2f} s, worst gap {worst:.2f} s, alone {len(alone)} steps")
        return
    # group 1, restarted on the spare, healed from group 0 (not from disk: it had no checkpoint of its own)
    assert heal and heal[0]["step"] >= alone[0], (heal, alone[:3])
    assert got[-1]["participants"] == 2
    assert "takes slot 1" in (run_dir / "submitit" / f"{job}_2_log.err").read_text()
    w0, w1 = final_weights(run_dir, 0), final_weights(run_dir, 1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    print(f"{variant}: step {step_time:.2f} s, worst gap {worst:.2f} s, alone {len(alone)} steps, heal {heal[0]}")
