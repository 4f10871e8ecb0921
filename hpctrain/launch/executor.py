"""Build the submitit executor for a run, and preview the sbatch script it would write.

The Slurm parameters are computed once (`slurm_parameters`), used both to configure the real
SlurmExecutor and to render the dry-run preview through submitit's own sbatch writer, so the preview is
the script that would be submitted.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import submitit

from hpctrain.config.layout import Layout
from hpctrain.config.schema import Executor


def slurm_parameters(cfg: Any, layout: Layout, run_id: str, folder: Path) -> dict[str, Any]:
    """submitit's Slurm parameters (sbatch option names) from conf/cluster.

    The teardown line runs after srun returns (`$?` is srun's exit code there): the supervisor resubmits a
    failed job or stops it with a report (hpctrain/launch/supervise.py).
    """
    c = cfg.cluster
    run_dir = folder.parent
    params: dict[str, Any] = {
        "job_name": f"hpctrain-{cfg.run.name}-{run_id}",
        "nodes": layout.nodes,
        "ntasks_per_node": layout.gpus_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": list(c.setup),
        "srun_args": list(c.srun_args),
        "stderr_to_stdout": False,
        "teardown": [" ".join([shlex.quote(sys.executable), "-m hpctrain.launch.supervise", shlex.quote(str(run_dir)),
                               "$SLURM_JOB_ID $?"])],
    }
    if c.gpu_type != "cpu":
        params["gpus_per_node"] = layout.gpus_per_node
    if c.mem_gb > 0:
        params["mem"] = f"{c.mem_gb}GB"
    elif c.exclusive:
        params["mem"] = "0"  # all of each node's memory
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(c, key)
        if value:
            params[key] = value
    if c.exclusive:
        params["exclusive"] = True
    extra: dict[str, Any] = {}
    if c.requeue:
        extra["requeue"] = True
    extra.update(dict(c.sbatch_extra))
    if extra:
        params["additional_parameters"] = extra
    return params


def local_parameters(cfg: Any, layout: Layout) -> dict[str, Any]:
    """submitit's local executor parameters. With `cluster.gpu_type` a GPU, each task gets one GPU: submitit
    sets CUDA_VISIBLE_DEVICES to the GPUs requested, and to nothing when none are, so without `gpus_per_node`
    a GPU workstation would train on its CPUs (the checks warn when GPUs are visible and gpu_type=cpu)."""
    c = cfg.cluster
    params: dict[str, Any] = {"tasks_per_node": layout.gpus_per_node, "nodes": 1, "timeout_min": c.time_min,
                              "signal_delay_s": c.signal_delay_s}
    if c.gpu_type != "cpu":
        params["gpus_per_node"] = layout.gpus_per_node
    return params


def sbatch_preview(cfg: Any, layout: Layout, run_id: str, folder: Path) -> str:
    """The sbatch script submitit's SlurmExecutor would write for this run."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **slurm_parameters(cfg, layout, run_id, folder))


def build_executor(cfg: Any, layout: Layout, run_id: str, folder: Path) -> submitit.Executor:
    c = cfg.cluster
    if c.executor == Executor.local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(**local_parameters(cfg, layout))
        return executor
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=c.max_num_timeout)
    executor.update_parameters(**slurm_parameters(cfg, layout, run_id, folder))
    return executor
