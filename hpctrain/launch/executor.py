"""The run's job, in the terms every scheduler backend takes (`JobSpec`), and its executor and script preview.

The backend (hpctrain/scheduler/) turns the same JobSpec and `cluster` section both into the real executor
and into the dry-run preview, so the preview is the script that would be submitted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.config.layout import Layout
from hpctrain.scheduler import JobSpec, scheduler_for
from hpctrain.scheduler.slurm import SlurmScheduler

if TYPE_CHECKING:
    import submitit

SUPERVISOR = "hpctrain.launch.supervise"  # runs after the tasks: resubmit a failed job or stop with a report


def job_spec(run_name: str, run_id: str, layout: Layout, folder: Path) -> JobSpec:
    """The job for a run; `folder` is the run's submitit folder (its parent is the run directory)."""
    return JobSpec(name=f"hpctrain-{run_name}-{run_id}", folder=folder, nodes=layout.nodes,
                   tasks_per_node=layout.gpus_per_node, after=(sys.executable, "-m", SUPERVISOR, str(folder.parent)))


def sbatch_preview(cfg: Any, layout: Layout, run_id: str, folder: Path) -> str:
    """The sbatch script Slurm would get for this run (whatever cluster.executor says)."""
    return SlurmScheduler().script(cfg.cluster, job_spec(cfg.run.name, run_id, layout, folder))


def build_executor(cfg: Any, layout: Layout, run_id: str, folder: Path) -> "submitit.Executor":
    return scheduler_for(cfg.cluster.executor).executor(cfg.cluster, job_spec(cfg.run.name, run_id, layout, folder))
