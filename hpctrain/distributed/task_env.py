"""The environment variables every task gets before it touches torch.distributed.

A pure function of the config, so the dry-run plan prints exactly what the tasks will set. Variables the
user put in cluster.env win over the defaults here.
"""

from __future__ import annotations

from typing import Any

from hpctrain.config.schema import Executor


def task_environment(cfg: Any) -> dict[str, str]:
    threads = str(cfg.train.threads_per_rank)
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
        "HPCTRAIN_RUN_ID": str(cfg.run.id or ""),
    }
    if cfg.cluster.executor == Executor.slurm:
        env.update({
            # Surface NCCL errors as exceptions (and a non-zero exit) instead of a silent hang.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            # A failed collective leaves a trace of the last ones for post-mortems.
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        })
        if cfg.parallel.tp > 1:
            # Orders TP communication kernels before compute on one queue so they overlap as scheduled.
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    return env
