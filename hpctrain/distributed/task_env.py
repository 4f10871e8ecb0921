"""The environment variables every task gets before it touches torch.distributed.

A pure function of the config, so the dry-run plan prints exactly what the tasks will set. Variables the
user put in cluster.env win over the defaults here.
"""

from __future__ import annotations

from typing import Any

from hpctrain.config.schema import Executor
from hpctrain.distributed.nccl_env import nccl_environment


def task_environment(cfg: Any) -> dict[str, str]:
    threads = str(cfg.train.threads_per_rank)
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
        "HPCTRAIN_RUN_ID": str(cfg.run.id or ""),
    }
    if cfg.cluster.executor == Executor.slurm:
        # What the config fixes; each task adds what its node reports (active HCAs, nearest first, RoCE GID).
        env.update(nccl_environment(cfg.cluster.nccl, 0, None, None))
        # A failed collective leaves a trace of the last ones for post-mortems (the flight recorder).
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"
        if cfg.parallel.tp > 1:
            # Orders TP communication kernels before compute on one queue so they overlap as scheduled.
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    return env
