"""Node health on the real Slurm dev cluster: pre-flight names a slow node and the job leaves its allocation
and is resubmitted without it; a hung rank is detected by the watchdog and restarted inside the allocation; a
slow rank is reported as a straggler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.test_hpctrain_on_slurm import submit, wait_done, wait_for

pytestmark = [pytest.mark.slurm]

THREE_NODES = ["cluster.nodes=3", "train.global_batch=24", "train.max_steps=60"]


def hostnames(slurm_cluster: Any, job: str) -> list[str]:
    nodes = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", job).stdout.strip()
    return slurm_cluster.run("scontrol", "show", "hostnames", nodes).stdout.split()


def jobs(run_dir: Path) -> list[str]:
    return [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()]


@pytest.mark.timeout(400)
def test_preflight_names_a_slow_node_and_the_job_runs_without_it(slurm_cluster: Any, tmp_path: Path) -> None:
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "preflight",
        *THREE_NODES,
        "health.preflight=exclude",
        "+cluster.env.HPCTRAIN_TEST_SLOW_HOST=n2",
    )
    states = wait_for(
        "the resubmission to finish",
        lambda: len(jobs(run_dir)) == 2 and wait_done(slurm_cluster, run_dir),
        300,
        every=2,
    )
    first, second = jobs(run_dir)
    assert states == {first: "FAILED", second: "COMPLETED"}, states
    assert "n2" in hostnames(slurm_cluster, first) and "n2" not in hostnames(slurm_cluster, second)
    report = json.loads((run_dir / "health" / first / "preflight.json").read_text())
    assert set(report["bad"]) == {"n2"} and "matmul" in report["bad"]["n2"][0]
    assert set(report["hosts"]) == set(hostnames(slurm_cluster, first))  # a report for every node
    assert all(h["report"] is not None for h in report["hosts"].values())
    attempt = json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[0])
    assert attempt["blamed"] == ["n2"]
    assert len(report["hosts"]["n2"]["matmul_s"]) == 2  # slow in the confirming round too
    # inside the allocation, the restart saw the condemned node and left at once instead of training again
    assert not list((run_dir / "failures" / f"{first}.1").glob("rank*.json"))
    assert "condemned n2: leaving the allocation" in (run_dir / "submitit" / f"{first}_0_log.err").read_text()
    healthy = json.loads((run_dir / "health" / second / "preflight.json").read_text())
    assert healthy["bad"] == {}


@pytest.mark.timeout(300)
def test_no_resubmission_is_made_that_could_never_start(slurm_cluster: Any, tmp_path: Path) -> None:
    """All four nodes, one of them slow: without it the job could only pend forever, so the supervisor stops."""
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "nofit",
        "cluster.nodes=4",
        "train.global_batch=32",
        "train.max_steps=60",
        "health.preflight=exclude",
        "+cluster.env.HPCTRAIN_TEST_SLOW_HOST=n2",
    )
    assert wait_done(slurm_cluster, run_dir, 200) == {job: "FAILED"}
    assert jobs(run_dir) == [job]
    report = json.loads((run_dir / "FAILED.json").read_text())
    assert report["blamed"] == ["n2"] and report["excluded"] == ["n2"]
    assert "debug has 4 node(s); with n2 excluded only 3 remain and the job needs 4" in report["why"]


@pytest.mark.timeout(400)
def test_a_hung_rank_is_detected_and_restarted_inside_the_allocation(slurm_cluster: Any, tmp_path: Path) -> None:
    """The watchdog ends the hung rank with its stack and a record; the agents restart every rank in the same
    job (a hang is a process failure: the nodes stay)."""
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "hang",
        "train.max_steps=40",
        "+cluster.env.HPCTRAIN_INJECT_FAULT='hang:step=25:rank=3:once'",
        "health.hang_timeout_s=15",
    )
    assert wait_done(slurm_cluster, run_dir, 300) == {job: "COMPLETED"}
    assert jobs(run_dir) == [job] and not (run_dir / "attempts.jsonl").exists()
    dump = (run_dir / "hangs" / job / "rank3.txt").read_text()
    assert "no step completed" in dump and "faults.py" in dump  # the stack shows where it hung
    records = {
        json.loads(p.read_text())["rank"]: json.loads(p.read_text())
        for p in (run_dir / "failures" / job).glob("rank*.json")
    }
    assert records[3]["type"] == "Hang" and not records[3]["peer"]
    assert all(r["peer"] for rank, r in records.items() if rank != 3)  # the others only waited for rank 3
    logs = (run_dir / "submitit" / f"{job}_0_log.out").read_text()
    # from the newest RAM step committed before the hang (the save and its copy to the peer node take ~1 s)
    assert "restart 1" in logs and ("resuming at step 10" in logs or "resuming at step 20" in logs)


@pytest.mark.timeout(400)
def test_a_slow_node_is_reported_as_straggler(slurm_cluster: Any, tmp_path: Path) -> None:
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "straggler",
        *THREE_NODES,
        "health.straggler_every=10",
        "health.straggler_patience=2",
        "+cluster.env.HPCTRAIN_TEST_SLOW_HOST=n2",
    )
    assert wait_done(slurm_cluster, run_dir) == {job: "COMPLETED"}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    stragglers = [e for e in events if e["event"] == "straggler"]
    assert stragglers and {e["host"] for e in stragglers} == {"n2"}
    assert all(e["slowdown"] > 2 for e in stragglers)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("health/probe_max_over_median", 0) for m in metrics) > 2
