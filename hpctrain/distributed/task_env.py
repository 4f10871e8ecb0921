"""The environment variables every task gets before it touches torch.distributed.

A pure function of the config (and, with parallel.compile, of the node's scratch directory, read on the node
unless given), so the dry-run plan prints what the tasks will set. Variables the user put in cluster.env win
over the defaults here. The same for every executor (local or Slurm): a local
run on a GPU box uses NCCL too. No HPCTRAIN_RUN_ID: the task sets these from its own config, so such a
variable could only repeat `cfg.run.id`, which every task already reads there.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpctrain.distributed.nccl_env import nccl_environment

if TYPE_CHECKING:
    from hpctrain.config.schema import Config

# Collectives each process keeps in torch's flight recorder (NCCL and gloo): the hang watchdog reads it to
# tell a rank waiting for a peer from a stuck one, and a post-mortem needs the last ones of every rank.
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_environment() -> dict[str, str]:
    """torch's flight recorder on, and NCCL's watchdog dumps it when a collective times out.

    TORCH_FR_BUFFER_SIZE is the current name: torch 2.13 warns in every task's stderr when it reads the
    deprecated TORCH_NCCL_TRACE_BUFFER_SIZE."""
    return {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def node_local_tmp(environ: Mapping[str, str] = os.environ) -> str:
    """The node's scratch directory for this job: the site's per-job node-local directory ($SLURM_TMPDIR where
    a prolog makes one, $TMPDIR), else /tmp (private to the job under Slurm's job_container/tmpfs). It lasts as
    long as the allocation, so workers restarted inside it find what the previous ones left there."""
    return environ.get("SLURM_TMPDIR") or environ.get("TMPDIR") or "/tmp"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container without a passwd entry for this uid
        return f"uid{os.getuid()}"


def compile_cache_environment(node_tmp: str, user: str, gpu: bool) -> dict[str, str]:
    """torch.compile's caches on node-local disk (parallel.compile): Inductor's (FX graphs, AOTAutograd, the
    C++/Triton kernels it builds) and, on GPUs, Triton's own, which would otherwise go to ~/.triton on the
    shared home file system. A restart inside the allocation then loads the compiled blocks instead of
    compiling them again. One directory per user for all the node's ranks: entries are content-addressed
    and written atomically (temporary file, then rename), so ranks share them without per-rank keys."""
    root = os.path.join(node_tmp, f"hpctrain-compile-{user}")
    env = {"TORCHINDUCTOR_CACHE_DIR": root}
    if gpu:
        env["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    return env


ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch 2.9's name, and the older one


def allocator_environment(gpu: bool, user_env: Mapping[str, Any]) -> dict[str, str]:
    """CUDA's caching allocator with expandable segments on GPUs (torchtitan's and Megatron's default): FSDP2's
    all-gather buffers and activations change size every layer, and fixed segments fragment until a run that fits
    on paper fails with "reserved but unallocated" memory. A site's own setting in cluster.env (either name) wins."""
    if not gpu or any(name in user_env for name in ALLOC_CONF):
        return {}
    return {ALLOC_CONF[0]: "expandable_segments:True"}


def task_environment(cfg: Config, node_tmp: str | None = None) -> dict[str, str]:
    """`node_tmp`: the node's scratch directory (default: `node_local_tmp()` of this process)."""
    threads = str(cfg.train.threads_per_rank)
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
    }
    # What the config fixes; each task on a GPU adds what its node reports (compute HCAs, nearest first).
    env.update(nccl_environment(cfg.cluster.nccl, 0, None, None))
    env.update(flight_recorder_environment())
    # NCCL's heartbeat monitor ends a process whose NCCL watchdog thread is stuck (in a CUDA call on a wedged
    # GPU) this long; torch's 480 s is below health.hang_timeout_s, so it killed the rank before hpctrain's
    # watchdog left its stacks and failure record. The collective timeout outlasts the hang limits (checked).
    env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(int(cfg.launcher.collective_timeout_s))
    gpu = cfg.cluster.gpu_type != "cpu"
    if cfg.parallel.compile:
        env.update(compile_cache_environment(node_tmp or node_local_tmp(), _user(), gpu))
    env.update(allocator_environment(gpu, cfg.cluster.env))
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    return env
