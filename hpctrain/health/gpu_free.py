"""A restarted worker starts only on a GPU that its earlier attempt's worker has left.

When a worker is stuck in the driver on a hung GPU, SIGKILL cannot end it: torch's elastic agent waits a
moment, logs "abandoning" and starts the new workers anyway (torch/distributed/elastic/multiprocessing/api.py,
MultiprocessContext._close). The new worker on that GPU would then allocate next to the old one's memory and
context, and fail with an out-of-memory error or hang in the same driver state. So before its first CUDA
allocation a restarted worker asks nvidia-smi which processes hold its GPU; a worker of this run from an
earlier restart (read from its /proc environment) must be gone within `wait_s`, or this node is unhealthy and
the run leaves the allocation without it. Processes this one cannot identify (another user's, or none listed
inside a container's PID namespace) are not waited for.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hpctrain.health.preflight import UnhealthyNodes

QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
WAIT_S = 60.0  # an abandoned worker that has not let go by then will not
POLL_S = 2.0


@dataclass(frozen=True)
class ComputeApp:
    gpu_uuid: str
    pid: int
    used_mib: int | None


def parse_compute_apps(text: str) -> list[ComputeApp]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits` output.

    Used memory is "[N/A]" where the driver cannot tell (MIG, some containers)."""
    apps = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[1].isdigit():
            continue
        apps.append(ComputeApp(fields[0], int(fields[1]), int(fields[2]) if fields[2].isdigit() else None))
    return apps


def worker_restart(pid: int, run_id: str, proc: Path = Path("/proc")) -> int | None:
    """The restart number of `pid` when it is a worker of run `run_id` (torch's agent sets both in the
    workers' environment); None for any other process or one this process may not read."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    if env.get("TORCHELASTIC_RUN_ID") != run_id or not env.get("TORCHELASTIC_RESTART_COUNT", "").isdigit():
        return None
    return int(env["TORCHELASTIC_RESTART_COUNT"])


def earlier_workers(
    apps: list[ComputeApp],
    gpu_uuid: str,
    run_id: str,
    restart: int,
    restart_of: Callable[[int, str], int | None] = worker_restart,
) -> list[int]:
    """The processes on this GPU that are workers of this run from an earlier restart."""
    stale, own = [], gpu_uuid.removeprefix("GPU-")
    for app in apps:
        if app.gpu_uuid.removeprefix("GPU-") != own or app.pid == os.getpid():
            continue
        theirs = restart_of(app.pid, run_id)
        if theirs is not None and theirs < restart:
            stale.append(app.pid)
    return stale


def _compute_apps() -> list[ComputeApp] | None:
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(out.stdout) if out.returncode == 0 else None


def wait_for_free_gpu(device: torch.device, host: str, wait_s: float = WAIT_S) -> None:
    """Return once no earlier worker of this run holds `device` (at once on a first attempt, without an
    agent, or without nvidia-smi); raise UnhealthyNodes naming this host when one still does after `wait_s`.
    The run and the restart are the agent's own (TORCHELASTIC_*), as the other workers' environments hold them."""
    run_id, restart = os.environ.get("TORCHELASTIC_RUN_ID"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if device.type != "cuda" or run_id is None or restart == 0:
        return
    uuid = str(torch.cuda.get_device_properties(device).uuid)  # creates no CUDA context
    wait_for_earlier_workers(uuid, run_id, restart, host, wait_s, _compute_apps)


def wait_for_earlier_workers(
    gpu_uuid: str,
    run_id: str,
    restart: int,
    host: str,
    wait_s: float,
    apps: Callable[[], list[ComputeApp] | None],
    restart_of: Callable[[int, str], int | None] = worker_restart,
) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        found = apps()
        stale = earlier_workers(found, gpu_uuid, run_id, restart, restart_of) if found is not None else []
        if not stale:
            return
        if time.monotonic() >= deadline:
            raise UnhealthyNodes(
                [host],
                {
                    host: [
                        f"GPU {gpu_uuid} is still held by worker(s) {stale} of an earlier restart after {wait_s:.0f} s "
                        "(stuck in the driver: the GPU is likely hung)"
                    ]
                },
            )
        time.sleep(POLL_S)
