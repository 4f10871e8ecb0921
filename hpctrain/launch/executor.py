"""The run's job, in the terms every scheduler backend takes (`JobSpec`), and its executor and script preview.

The run's backend (hpctrain/scheduler/, by `cluster.executor`) turns the same JobSpec and `cluster` section both
into the real executor and into the dry-run preview, so the preview is the script that would be submitted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.config.layout import Layout
from hpctrain.scheduler import JobSpec, scheduler_for

if TYPE_CHECKING:
    import submitit

    from hpctrain.config.schema import Config

SUPERVISOR = "hpctrain.launch.supervise"  # runs after the tasks: resubmit a failed job or stop with a report


def job_spec(cfg: Config, run_id: str, layout: Layout, folder: Path) -> JobSpec:
    """The job for a run; `folder` is the run's submitit folder (its parent is the run directory).

    With `launcher.in_allocation` a node runs one task, its elastic agent, which starts the node's ranks
    (and gets their CPUs), and the job also asks for `cluster.spare_nodes` hot spares; otherwise one task
    per rank."""
    ranks_per_task = layout.gpus_per_node if cfg.launcher.in_allocation else 1
    spares = cfg.cluster.spare_nodes if cfg.launcher.in_allocation else 0
    return JobSpec(
        name=f"hpctrain-{cfg.run.name}-{run_id}",
        folder=folder,
        run_dir=folder.parent,
        nodes=layout.job_nodes + spares,  # every replica group's nodes (recovery=replicas)
        tasks_per_node=layout.gpus_per_node // ranks_per_task,
        gpus_per_node=0 if cfg.cluster.gpu_type == "cpu" else layout.gpus_per_node,
        cpus_per_task=cfg.cluster.cpus_per_task * ranks_per_task,
        survive_node_loss=bool(cfg.launcher.in_allocation and (spares or cfg.elastic.min_nodes or layout.replicas > 1)),
        after=(sys.executable, "-m", SUPERVISOR, str(folder.parent)),
    )


def sbatch_preview(cfg: Config, layout: Layout, run_id: str, folder: Path) -> str | None:
    """The batch script the run's backend submits for this run (Slurm's sbatch script); None where the backend
    submits none (the local executor)."""
    return scheduler_for(cfg.cluster.executor).script(cfg.cluster, job_spec(cfg, run_id, layout, folder))


def build_executor(cfg: Config, layout: Layout, run_id: str, folder: Path) -> submitit.Executor:
    return scheduler_for(cfg.cluster.executor).executor(cfg.cluster, job_spec(cfg, run_id, layout, folder))
