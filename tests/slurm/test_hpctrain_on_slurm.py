"""hpctrain on the real multi-node Slurm dev cluster: training, USR2 and preemption requeues with exact resume,
a crashed rank restarted inside the allocation, a node dying (with agents and with resubmission), and a
deterministic failure that must not loop.

Each test submits with `python -m hpctrain ... cluster=dev` (which returns right after submission) and then
watches the job through sacct and the run directory, as a user would.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint.inspect import export_model, find
from hpctrain.records.history import ATTEMPT_MARKS
from hpctrain.tracking.wandb_file import run_info
from tests.conftest import run_hpctrain

pytestmark = [pytest.mark.slurm]

STEPS = 100
COMMON = [
    "+experiment=smoke",
    "cluster=dev",
    f"train.max_steps={STEPS}",
    "optim.warmup_steps=5",
    "train.log_every=10",
    "checkpoint.when_busy=wait",
]


# Each dev-cluster node's own RAM (a tmpfs per node): node-local, replicated to a peer node by hpctrain. A fresh
# folder per session and test, since node RAM outlives a test session while the cluster stays up.
RAM = f"/dev/shm/hpctrain-tests-{secrets.token_hex(4)}"


def tiers(root: Path, shared_every: int) -> str:
    return (
        f"checkpoint.tiers=[{{name: ram, path: {RAM}/{root.parent.name}, interval_steps: 10, keep_last: 2}},"
        f"{{name: shared, path: checkpoints, interval_steps: {shared_every}, keep_last: 1}}]"
    )


def submit(
    slurm_cluster: Any, tmp_path: Path, run_id: str, *overrides: str, shared_every: int = 1000
) -> tuple[str, Path]:
    """A run whose RAM tier saves every 10 steps; one that leaves the allocation (resubmission) lands on other
    nodes, whose RAM holds nothing of it: it resumes from the shared tier, so those tests save there too."""
    proc = run_hpctrain(
        *COMMON,
        f"run.root={tmp_path}",
        f"run.id={run_id}",
        tiers(tmp_path / run_id, shared_every),
        *overrides,
        cwd=tmp_path,
        timeout=60,
        env=slurm_cluster.env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run directory: "))
    return job, run_dir


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_states(slurm_cluster: Any, run_dir: Path) -> dict[str, str]:
    """Final or current state of every job of a run (resubmissions included)."""
    ids = [json.loads(line)["job_id"] for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    out = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(ids), check=False).stdout
    return {line.split("|")[0]: line.split("|")[1] for line in out.splitlines() if "|" in line}


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def finished(slurm_cluster: Any, run_dir: Path) -> bool:
    states = job_states(slurm_cluster, run_dir)
    if len(states) < len((run_dir / "jobs.jsonl").read_text().splitlines()):
        return False  # accounting has not seen a resubmission yet
    # NODE_FAIL and PREEMPTED are not final here: the job is requeued (sacct shows the latest attempt's state).
    return bool(states) and all(
        s in ("COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY") or s.startswith("CANCELLED") for s in states.values()
    )


def wait_done(slurm_cluster: Any, run_dir: Path, timeout: float = 300) -> dict[str, str]:
    wait_for(f"the jobs of {run_dir.name}", lambda: finished(slurm_cluster, run_dir), timeout, every=2)
    return job_states(slurm_cluster, run_dir)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = find(run_dir, tier="shared")
    return torch.load(export_model(ckpt, run_dir / "export" / "model.pt")[0])


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def restarts(slurm_cluster: Any, job: str) -> int:
    out = slurm_cluster.run("scontrol", "show", "job", job, check=False).stdout
    match = re.search(r"Restarts=(\d+)", out)
    return int(match.group(1)) if match else 0


@pytest.fixture(scope="module")
def reference(slurm_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the configuration the interruption tests use."""
    tmp = tmp_path_factory.mktemp("reference")
    _, run_dir = submit(slurm_cluster, tmp, "ref")
    states = wait_done(slurm_cluster, run_dir)
    assert set(states.values()) == {"COMPLETED"}, states
    return run_dir


@pytest.mark.timeout(400)
def test_two_nodes_two_tasks_train_to_completion(reference: Path) -> None:
    logs = "".join(p.read_text() for p in (reference / "submitit").glob("*_log.out"))
    ranks = re.findall(r"task rank (\d)/4 local \d on (\S+) ", logs)
    assert {r for r, _ in ranks} == {"0", "1", "2", "3"}
    assert len({host for _, host in ranks}) == 2
    assert last_step(reference) == STEPS and losses(reference)[STEPS] < losses(reference)[1]


def assert_exact_continuation(run_dir: Path, reference: Path) -> None:
    a, b = losses(reference), losses(run_dir)
    assert all(a[s] == b[s] for s in range(1, STEPS + 1)), [
        (s, a[s], b[s]) for s in range(1, STEPS + 1) if a[s] != b[s]
    ][:5]
    wa, wb = final_weights(reference), final_weights(run_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.timeout(400)
def test_usr2_saves_requeues_and_resumes_exactly(slurm_cluster: Any, reference: Path, tmp_path: Path) -> None:
    job, run_dir = submit(slurm_cluster, tmp_path, "usr2", "tracking=wandb", "tracking.mode=offline")
    wait_for("step 20", lambda: last_step(run_dir) >= 20, 200, every=0.5)
    slurm_cluster.run("scancel", "--signal=USR2", job)
    states = wait_done(slurm_cluster, run_dir)
    assert states == {job: "COMPLETED"}, states
    assert restarts(slurm_cluster, job) >= 1
    logs = "".join(p.read_text() for p in (run_dir / "submitit").glob(f"{job}_0_log.out"))
    saved = int(re.search(r"time limit, preemption or a user's signal \(SIGUSR2\) at step (\d+)", logs).group(1))
    assert f"resuming at step {saved}" in logs
    assert_exact_continuation(run_dir, reference)
    # One W&B run across the requeue: the same id in both attempts, history continuing after the saved step.
    runs = [run_info(p) for p in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]
    assert len(runs) == 2 and {r["run_id"] for r in runs} == {"usr2"}
    steps = [[h["_step"] for h in r["history"] if "loss" in h] for r in runs]
    assert steps[0] == list(range(1, saved + 1)) and steps[1] == list(range(saved + 1, STEPS + 1))
    assert not (run_dir / "hangs").exists()  # the requeue's SIGTERM during the stop's save is not a hang
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # each attempt says when it trained again ("attempt"); the stop saved where a requeue on other nodes finds it
    # and each attempt's end, with the goodput ledger as it stood (issue 18)
    assert [e["event"] for e in events] == [
        "attempt",
        "ledger",
        "stop",
        "attempt_end",
        "ledger",
        "resume",
        "attempt",
        "ledger",
        "attempt_end",
        "ledger",
    ] and events[5]["step"] == saved


@pytest.mark.timeout(400)
def test_partition_preemption_requeues_and_resumes_exactly(slurm_cluster: Any, reference: Path, tmp_path: Path) -> None:
    job, run_dir = submit(slurm_cluster, tmp_path, "preempted")
    wait_for("step 20", lambda: last_step(run_dir) >= 20, 200, every=0.5)
    urgent = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "-p",
        "urgent",
        "-N",
        "4",
        "--exclusive",
        "-t",
        "5",
        f"--output={tmp_path}/urgent.out",
        "--wrap",
        "sleep 5",
    ).stdout.strip()
    states = wait_done(slurm_cluster, run_dir)
    assert states == {job: "COMPLETED"}, states
    urgent_state = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", urgent).stdout.strip()
    assert urgent_state == "COMPLETED"
    logs = (run_dir / "submitit" / f"{job}_0_log.out").read_text()
    assert "(SIGUSR2) at step" in logs and "resuming at step" in logs
    assert_exact_continuation(run_dir, reference)


def running_with_victim(
    slurm_cluster: Any, tmp_path: Path, run_id: str, *overrides: str, shared_every: int = 1000
) -> tuple[str, Path, str, int]:
    """A run that has trained 20 steps, the last node of its job (to fail) and the step it reached."""
    job, run_dir = submit(slurm_cluster, tmp_path, run_id, *overrides, shared_every=shared_every)
    wait_for("step 20", lambda: last_step(run_dir) >= 20, 200, every=0.5)
    node = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    victim = slurm_cluster.run("scontrol", "show", "hostnames", node).stdout.split()[-1]
    return job, run_dir, victim, last_step(run_dir)


@pytest.mark.timeout(400)
def test_a_crashed_rank_is_restarted_inside_the_allocation_exactly(
    slurm_cluster: Any, reference: Path, tmp_path: Path
) -> None:
    """Rank 3 (second node) raises at step 15: the agents restart all four workers in the same job (no
    sbatch, no requeue), from the RAM tier's step 10, and the run ends as the uninterrupted one. The job's
    hot spare stays out (every node is alive) and leaves when the run ends."""
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "crash",
        "cluster.spare_nodes=1",
        "+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=15:rank=3:once'",
    )
    states = wait_done(slurm_cluster, run_dir)
    assert states == {job: "COMPLETED"} and restarts(slurm_cluster, job) == 0, states
    logs = (run_dir / "submitit" / f"{job}_0_log.out").read_text()
    assert "restart 1" in logs and "resuming at step 10" in logs
    spare = (run_dir / "submitit" / f"{job}_2_log.err").read_text()  # its nodes were all alive: it stayed out
    assert "hot spare, waiting" in spare and "takes slot" not in spare
    assert_exact_continuation(run_dir, reference)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    attempt = [e for e in events if e["event"] == "attempt" and e["restart"] == 1]
    failed_at = min(json.loads(p.read_text())["time"] for p in (run_dir / "failures" / job).glob("rank*.json"))
    assert attempt and attempt[0]["first_step"] - failed_at < 60  # seconds, not a trip through the queue
    marks = [attempt[0][mark] for mark in ATTEMPT_MARKS]  # the restart's start-up, part by part
    assert marks == sorted(marks) and marks[0] > failed_at, attempt[0]


@pytest.mark.timeout(500)
def test_a_deterministic_failure_is_retried_once_then_reported(slurm_cluster: Any, tmp_path: Path) -> None:
    """One task per rank (launcher.in_allocation=false): the supervisor resubmits without the failed node,
    once; the same error at the same step again stops the run (inside the allocation: tests/e2e)."""
    job, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "broken",
        "+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=15:rank=3'",
        "launcher.max_restarts=3",
        "launcher.in_allocation=false",
        shared_every=10,
    )
    report = wait_for("the failure report", lambda: (run_dir / "FAILED.json").exists(), 300, every=2)
    assert report
    states = wait_done(slurm_cluster, run_dir)
    assert len(states) == 2 and set(states.values()) == {"FAILED"}, states  # one resubmission, no loop
    failed = json.loads((run_dir / "FAILED.json").read_text())
    assert "deterministic" in failed["why"] and failed["signature"]["step"] == 15
    assert failed["signature"]["type"] == "InjectedFault" and failed["signature"]["rank"] == 3
    attempt = json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[0])
    blamed = attempt["blamed"]
    second = attempt["resubmitted_as"]
    nodes = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", second).stdout.strip()
    assert not set(blamed) & set(slurm_cluster.run("scontrol", "show", "hostnames", nodes).stdout.split())
    logs = (run_dir / "submitit" / f"{second}_0_log.out").read_text()
    assert "resuming at step 10" in logs


@pytest.mark.timeout(400)
def test_a_sweep_submits_one_job_per_point_and_returns(slurm_cluster: Any, tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_hpctrain(
        "-m",
        "+experiment=smoke",
        "cluster=dev",
        "train.max_steps=20",
        "optim.warmup_steps=2",
        "tracking=wandb",
        "tracking.mode=offline",
        "optim.lr=1e-3,2e-3,3e-3",
        f"run.root={tmp_path}",
        cwd=tmp_path,
        timeout=120,
        env=slurm_cluster.env(),
    )
    returned = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sweep: 3 points" in proc.stdout and returned < 30  # submits and returns; never waits for the jobs
    table = json.loads(next((tmp_path / "sweeps").glob("*/sweep.json")).read_text())
    assert len({r["job_id"] for r in table}) == 3 and len({r["run_dir"] for r in table}) == 3
    for row in table:
        run_dir = Path(row["run_dir"])
        assert wait_done(slurm_cluster, run_dir) == {row["job_id"]: "COMPLETED"}
    infos = [run_info(next(Path(r["run_dir"]).glob("wandb/offline-run-*/run-*.wandb"))) for r in table]
    assert len({i["run_id"] for i in infos}) == 3 and len({i["group"] for i in infos}) == 1


def kill_node_until_done(
    slurm_cluster: Any, run_dir: Path, job: str, victim: str, silent: bool = False
) -> tuple[dict[str, str], int]:
    """Kill a whole node (slurmd and every process in its namespace; `silent`: its link down first, as in a
    power loss), wait for the run to finish, bring the node back; the run's job states and how often Slurm
    requeued `job`."""
    subprocess.run(
        ["bash", str(slurm_cluster.script), "kill-node", victim, *(["--silent"] if silent else [])],
        check=True,
        capture_output=True,
    )
    try:
        states = wait_for(
            f"the run to finish without {victim}",
            lambda: (
                last_step(run_dir) == STEPS and finished(slurm_cluster, run_dir) and job_states(slurm_cluster, run_dir)
            ),
            400,
            every=2,
        )
        return states, restarts(slurm_cluster, job)
    finally:
        subprocess.run(["bash", str(slurm_cluster.script), "revive-node", victim], capture_output=True)


@pytest.mark.timeout(500)
def test_a_node_that_dies_is_left_out_and_the_run_finishes_once(slurm_cluster: Any, tmp_path: Path) -> None:
    """A whole node dies (slurmd and every process in its namespace) under one task per rank: the supervisor
    resubmits the job without the node and first turns Slurm's own requeue off, or leaves the job to Slurm
    when slurmctld requeued it first (NODE_FAIL: the path agents without a spare take too, bench_restart.py's
    node-requeue). Either way exactly one attempt trains at a time (issue 14: both did), and the run finishes."""
    job, run_dir, victim, before = running_with_victim(
        slurm_cluster, tmp_path, "nodedeath", "launcher.in_allocation=false", shared_every=10
    )
    states, requeued = kill_node_until_done(slurm_cluster, run_dir, job, victim)
    last_job = list(states)[-1]
    assert states[last_job] == "COMPLETED", states
    # whoever is first: the supervisor (it turns Slurm's requeue off) or slurmctld (the supervisor sees it)
    resubmitted = len(states) == 2 and requeued == 0
    assert resubmitted or (list(states) == [job] and requeued == 1), (states, requeued)
    assert (
        victim
        not in slurm_cluster.run(
            "scontrol",
            "show",
            "hostnames",
            slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", last_job).stdout.strip(),
        ).stdout.split()
    )
    steps = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    # One attempt after the other: the first ran to where the node died, the second from a checkpoint on.
    second = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[:second] == list(range(1, second + 1)) and steps[second:] == list(range(steps[second], STEPS + 1))
    assert steps[second] - 1 in range(0, STEPS, 10) and second - steps[second] + 1 <= 10 + 5, (second, steps[second])


@pytest.mark.timeout(500)
@pytest.mark.parametrize("silent", [False, True], ids=["dies", "loses-power"])
def test_without_a_spare_the_run_shrinks_to_min_nodes_with_the_same_batch(
    slurm_cluster: Any, reference: Path, tmp_path: Path, silent: bool
) -> None:
    """elastic.min_nodes=1: a node dies and the agent left goes on alone in the same job (sbatch and srun
    --no-kill): DP 4 -> 2, gradient accumulation 1 -> 2, so every step still trains on the same 16 samples.
    A node that loses power leaves its peers blocked, not failed: the agent left sees its beats stop and
    restarts the group (else only the hang watchdog, 600 s later, would)."""
    job, run_dir, victim, before = running_with_victim(slurm_cluster, tmp_path, "shrink", "elastic.min_nodes=1")
    states, requeued = kill_node_until_done(slurm_cluster, run_dir, job, victim, silent)
    assert states == {job: "COMPLETED"} and requeued == 0, (states, requeued)
    logs = (run_dir / "submitit" / f"{job}_0_log.out").read_text()
    assert "running on 1 of 2 nodes: DP 4 -> 2, gradient accumulation 1 -> 2 (global batch 16)" in logs
    agent = (run_dir / "submitit" / f"{job}_0_log.err").read_text()
    # A node without power: only its silence tells. A node whose processes died: its peers fail at once, though
    # on a loaded box its 3 s of silence may be noticed first; either way the group restarts without it.
    assert "has been silent" in agent or not silent
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["consumed_samples"] == 16 * r["step"] for r in rows)  # the samples of each step: unchanged
    steps = [r["step"] for r in rows]
    second = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[second:] == list(range(steps[second], STEPS + 1)) and steps[second] - 1 in range(0, STEPS, 10)
    ref, got = losses(reference), losses(run_dir)
    assert all(got[s] == ref[s] for s in range(1, steps[second]))  # before the loss: the same run
    assert abs(got[STEPS] - ref[STEPS]) < 0.05 * ref[STEPS]  # after: other reduction order, the same samples


@pytest.mark.timeout(500)
@pytest.mark.parametrize("victim_index", [1, 0], ids=["node1", "node0-store-and-batch-host"])
def test_a_hot_spare_takes_a_dead_nodes_place_in_the_same_job(
    slurm_cluster: Any, reference: Path, tmp_path: Path, victim_index: int
) -> None:
    """cluster.spare_nodes=1: the job has 3 nodes, 2 train. One dies (slurmd and every process): the spare
    claims its slot, joins the rendezvous, and the run goes on at the same size in the same job, its RAM state
    from the peers' replicas, ending bit-identical to the uninterrupted run. Node 0 is also the rendezvous
    store's host (the store moves to node 1) and Slurm's batch host (the batch script dies with it: hpctrain
    ends the job once the run is over, so Slurm shows it CANCELLED; the run itself has COMPLETED.json)."""
    job, run_dir = submit(slurm_cluster, tmp_path, "spare", "cluster.spare_nodes=1")
    wait_for("step 20", lambda: last_step(run_dir) >= 20, 200, every=0.5)
    nodes = slurm_cluster.run(
        "scontrol", "show", "hostnames", slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
    ).stdout.split()
    victim, spare = nodes[victim_index], nodes[2]
    killed = time.time()
    states, requeued = kill_node_until_done(slurm_cluster, run_dir, job, victim)
    assert list(states) == [job] and requeued == 0, (states, requeued)
    assert states[job] == "COMPLETED" if victim_index else states[job].startswith("CANCELLED"), states
    assert json.loads((run_dir / "COMPLETED.json").read_text())["job_id"] == job
    assert f"takes slot {victim_index}" in (run_dir / "submitit" / f"{job}_2_log.err").read_text()
    hosts = json.loads((run_dir / "failures" / f"{job}.1" / "hosts.json").read_text())
    assert victim not in hosts and spare in hosts and len(hosts) == 4
    assert_exact_continuation(run_dir, reference)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resume"][-1]  # the spare's RAM was empty: its peer's copy
    assert resumed["tier"] == "ram" and resumed["fetched_bytes"] > 0, resumed
    back = next(e for e in events if e["event"] == "attempt" and e["restart"] >= 1)
    assert back["first_step"] - killed < 30, back["first_step"] - killed  # the bound for a node death
