"""Where this task sits in the job, and joining torch.distributed.

Ranks come from the variables an elastic agent (hpctrain's own, distributed/elastic.py, or torchrun) sets,
else from submitit's JobEnvironment (Slurm or the local executor, one task per rank), else a single process.
Without an agent, the rendezvous address is the job's first node and the port is derived from the job id,
so every task of a job computes the same address without talking to the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hpctrain.records.failures import attempt_key
from hpctrain.scheduler import scheduler_for

if TYPE_CHECKING:
    import submitit

PORT_RANGE = (20000, 60000)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    hostname: str
    job_id: str
    restart: int = 0  # restarts of the workers inside this job's allocation (the elastic agent counts them)
    requeue: int = 0  # the job's runs before this one: the scheduler requeued it this often (same job id)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def attempt(self) -> str:
        """The key of this attempt's records (failures, hangs, health): the job, and the restart in it."""
        return attempt_key(self.job_id, self.restart, self.requeue)


def port_for_job(job_id: str) -> int:
    """A port every task of the job derives alike; different jobs on one node rarely collide."""
    lo, hi = PORT_RANGE
    return lo + int(hashlib.sha1(job_id.encode()).hexdigest(), 16) % (hi - lo)


def discover() -> DistEnv:
    """This task's place, and the job's run (`requeue`) from its scheduler."""
    return dataclasses.replace(_discover(), requeue=int(scheduler_for().job_context().get("restart_count") or 0))


def _discover() -> DistEnv:
    hostname = socket.gethostname()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # an elastic agent's worker (or torchrun)
        world = int(os.environ["WORLD_SIZE"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return DistEnv(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=world,
            local_world_size=local_world,
            node_rank=int(os.environ.get("GROUP_RANK", 0)),
            num_nodes=max(1, world // local_world),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", 29500)),
            hostname=hostname,
            # hpctrain's agents name the scheduler's job; plain torchrun has only its run id
            job_id=os.environ.get("HPCTRAIN_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "torchrun"),
            # the restarts before the agent's current launch (its store moved), then the launch's own
            restart=int(os.environ.get("HPCTRAIN_RESTART_BASE", 0))
            + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
    if os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit

        je = submitit.JobEnvironment()
        master = first_node_address(je)
        return DistEnv(
            rank=je.global_rank,
            local_rank=je.local_rank,
            world_size=je.num_tasks,
            local_world_size=je.num_tasks // je.num_nodes,
            node_rank=je.node,
            num_nodes=je.num_nodes,
            master_addr=master,
            master_port=int(os.environ.get("MASTER_PORT") or port_for_job(str(je.job_id))),
            hostname=hostname,
            job_id=str(je.job_id),
        )
    return DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", port_for_job(str(os.getpid())), hostname, str(os.getpid()))


def first_node_address(je: submitit.JobEnvironment) -> str:
    """The job's first node as every node reaches it: its routable address, loopback for the local executor
    (the process group's rendezvous without agents)."""
    return node_addresses(je)[0]


def node_addresses(je: submitit.JobEnvironment) -> tuple[str, ...]:
    """Every node of the job as the others reach it, by node index (the agents' rendezvous store starts on
    the first and moves along them when its host dies)."""
    if not scheduler_for().capabilities.multi_node:  # the job's one node is this machine
        return ("127.0.0.1",)
    return tuple(_host_address(h) for h in je.hostnames)


def _host_address(host: str) -> str:
    """Resolve a node's name the way the other nodes can reach it (never 127.0.0.1)."""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, socket.AF_INET)}  # AF_INET: a str
    except socket.gaierror:
        return host
    routable = sorted(a for a in addresses if not a.startswith("127."))
    return routable[0] if routable else host


def task_device(local_rank: int, cuda_devices: int | None = None) -> torch.device:
    """This task's device: one of the GPUs it sees (`cuda_devices`, default: ask CUDA), else the CPU.

    Sites that bind one GPU per task (srun --gpus-per-task, a cgroup per task) show each task a single
    device 0, so local rank 3 must use device 3 % 1 = 0: `cuda:local_rank` would not exist there.
    """
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device("cuda", local_rank % cuda_devices) if cuda_devices else torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """The default group's backends: NCCL for GPU tensors *and* gloo for CPU ones.

    A group created as plain "nccl" has a backend for cuda only, so any CPU tensor on it (a flag, a
    timing, all_gather_object's sizes) raises "No backend type associated with device type cpu" on the
    first step of a multi-GPU run; with both backends the same call works on GPU and CPU alike.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the job's process group (NCCL for GPU tensors, gloo for CPU ones)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1 or dist.is_initialized():
        return
    # Every group made later (mesh dims, pipeline pairs, checkpoint groups) takes torch's module default,
    # 10 min for NCCL and 30 for the rest, not the default group's: make it the job's collective timeout.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=timeout_s)
    if env.rank != 0:
        wait_for_listener(env.master_addr, env.master_port, timeout_s)
    dist.init_process_group(
        backend=process_group_backend(device),
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def wait_for_listener(host: str, port: int, timeout_s: float, poll_s: float = 0.01) -> None:
    """Return once rank 0's store takes connections. torch's store client, refused because it came first,
    backs off about 0.5 s before it tries again: after a restart every rank but 0 would pay that."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # torch's own connect gives the error, with its own wording
            time.sleep(poll_s)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
