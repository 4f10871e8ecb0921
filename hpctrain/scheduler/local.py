"""The local executor: the job's tasks are processes on this machine, with no queue and no nodes to manage.

So there is nothing to requeue, resubmit or drain: those answer False (or refuse) and training stops or
fails as it would without a scheduler; and its capabilities are those of one machine the user watches.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.scheduler.base import Allocation, Capabilities, JobSpec, Scheduler

if TYPE_CHECKING:
    import submitit

    from hpctrain.config.schema import ClusterConfig

log = logging.getLogger(__name__)


def local_parameters(cluster: ClusterConfig, job: JobSpec) -> dict[str, Any]:
    """submitit's local executor parameters. With `cluster.gpu_type` a GPU, the job gets its GPUs: submitit
    sets CUDA_VISIBLE_DEVICES to the GPUs requested, and to nothing when none are, so without `gpus_per_node`
    a GPU workstation would train on its CPUs (the checks warn when GPUs are visible and gpu_type=cpu)."""
    params: dict[str, Any] = {
        "tasks_per_node": job.tasks_per_node,
        "nodes": 1,
        "timeout_min": cluster.time_min,
        "signal_delay_s": cluster.signal_delay_s,
    }
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
    return params


class LocalScheduler(Scheduler):
    name = "local"
    capabilities = Capabilities(
        multi_node=False,
        runs_here=True,
        warning_signal=False,
        requeue=False,
        confines_cpus=False,
        containers=False,
        srun_args=False,
        log_path_patterns=False,
    )

    def executor(self, cluster: ClusterConfig, job: JobSpec) -> submitit.Executor:
        import submitit

        executor = submitit.LocalExecutor(folder=job.folder)
        executor.update_parameters(**local_parameters(cluster, job))
        return executor

    def script(self, cluster: ClusterConfig, job: JobSpec) -> None:
        return None

    def partition_nodes(self, partition: str | None) -> list[str]:
        return []

    def resubmit(self, folder: Path, job_id: str, exclude: list[str]) -> str:
        raise NotImplementedError("the local executor has no queue to resubmit a job to")

    def cancel_requeue(self, job_id: str) -> bool:
        return True  # nothing requeues a local job

    def accounting(self, job_ids: list[str], timeout_s: float = 60) -> list[Allocation] | None:
        return None  # no queue, no records: the run's own files tell when a local job ran

    def requeue_self(self) -> bool:
        return False

    def end_self(self) -> bool:
        return False  # the local executor's job ends with its process

    def drain(self, hosts: list[str], reason: str) -> bool:
        log.warning("not draining %s: the local executor has no nodes to take out of service", hosts)
        return False

    def job_context(self) -> dict[str, Any]:
        return {
            "job_id": os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
            "restart_count": 0,
            "nodelist": socket.gethostname(),
            "num_nodes": 1,
        }
