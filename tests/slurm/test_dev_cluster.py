"""The Slurm dev cluster (slurm/dev-cluster.sh) runs real multi-node jobs: submitit + gloo across node namespaces."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import cloudpickle
import pytest
import submitit

pytestmark = pytest.mark.slurm

# The job functions below travel by value: the nodes cannot import this test module by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _allreduce_task() -> dict:
    """One task of a 2 nodes x 2 tasks job: gloo all_reduce of (rank + 1) over all tasks."""
    import os
    import socket

    import torch
    import torch.distributed as dist
    from submitit.helpers import TorchDistributedEnvironment

    torch.set_num_threads(1)
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60))
    try:
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    host = socket.gethostname()
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "hostname": host,
        "host_addr": socket.gethostbyname(host),
        "master_addr": env.master_addr,
        "master_ip": socket.gethostbyname(env.master_addr),
        "master_port": env.master_port,
        "sum": t.item(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _wait_done(job: submitit.Job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            state = job.state
            subprocess.run(["scancel", str(job.job_id)], check=False)
            out = "\n".join(f"--- task {t}\n{job.task(t).stdout()}\n{job.task(t).stderr()}" for t in range(4))
            pytest.fail(f"job {job.job_id} not done after {timeout_s}s (state {state}):\n{out}")
        time.sleep(0.5)


@pytest.mark.timeout(60, func_only=True)  # cluster start-up is bounded by the fixture
def test_cluster_shape(slurm_cluster):
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %P %t").stdout.split("\n")
    rows = {tuple(line.split()) for line in out if line.strip()}
    nodes = set(slurm_cluster.nodes)
    assert {r[0] for r in rows} == nodes
    assert {(n, "debug*") for n in nodes} | {(n, "urgent") for n in nodes} == {r[:2] for r in rows}
    assert all(r[2] in ("idle", "mix", "alloc", "comp") for r in rows), rows
    # the login side resolves every node to its bridge address
    for i, n in enumerate(slurm_cluster.nodes, start=1):
        assert socket.gethostbyname(n) == f"{slurm_cluster.subnet}.{10 + i}"


@pytest.mark.timeout(240, func_only=True)  # cluster start-up is bounded by the fixture
def test_submitit_gloo_allreduce_2x2(slurm_cluster, tmp_path):
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    # timeout_min > 10: below that submitit classes every signal as a timeout
    ex.update_parameters(
        nodes=2,
        tasks_per_node=2,
        cpus_per_task=1,
        timeout_min=30,
        slurm_partition="debug",
        name="hpctrain-dev-allreduce",
    )
    t0 = time.monotonic()
    job = ex.submit(_allreduce_task)
    _wait_done(job, timeout_s=180)
    results = job.results()
    elapsed = time.monotonic() - t0
    print(f"2x2 gloo all_reduce job {job.job_id}: submit-to-result {elapsed:.1f}s")

    assert len(results) == 4
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world_size"] for r in results} == {4}
    assert all(r["sum"] == 1 + 2 + 3 + 4 for r in results), results
    hosts = {r["hostname"] for r in results}
    assert len(hosts) == 2 and hosts <= set(slurm_cluster.nodes), hosts
    for h in hosts:
        assert sorted(r["local_rank"] for r in results if r["hostname"] == h) == [0, 1]
    # every task resolves its own name and the master's to bridge addresses, and all agree on the master
    subnet = slurm_cluster.subnet + "."
    assert all(r["host_addr"].startswith(subnet) for r in results), results
    assert len({(r["master_addr"], r["master_ip"], r["master_port"]) for r in results}) == 1
    assert results[0]["master_addr"] in hosts and results[0]["master_ip"].startswith(subnet)
    # accounting works (submitit reads states with sacct): the job is COMPLETED there
    deadline = time.monotonic() + 30
    while True:
        state = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", str(job.job_id)).stdout.strip()
        if state == "COMPLETED" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert state == "COMPLETED"


@pytest.mark.timeout(90, func_only=True)  # cluster start-up is bounded by the fixture
def test_accounting_sees_cancelled_job(slurm_cluster):
    """Without slurmdbd every state is UNKNOWN and a cancelled job never counts as done for submitit."""
    jid = (
        slurm_cluster.run("sbatch", "--parsable", "-N1", "-n1", "-t", "5", "-o", "/dev/null", "--wrap", "sleep 120")
        .stdout.strip()
        .split(";")[0]
    )
    try:
        deadline = time.monotonic() + 30
        while slurm_cluster.run("squeue", "-h", "-j", jid, "-o", "%T").stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.3)
    finally:
        slurm_cluster.run("scancel", jid)
    deadline = time.monotonic() + 40
    while True:
        state = slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", jid).stdout.strip()
        if state.startswith("CANCELLED") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert state.startswith("CANCELLED"), state
