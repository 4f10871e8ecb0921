"""The batch systems hpctrain runs on, behind one interface (`base.Scheduler`), picked by `scheduler_for`; what
each can do for a run is its `capabilities` (`base.Capabilities`), which the checks and the launcher ask."""

from __future__ import annotations

import os
from enum import Enum

from hpctrain.scheduler.base import Capabilities, JobSpec, Scheduler
from hpctrain.scheduler.local import LocalScheduler
from hpctrain.scheduler.slurm import SlurmScheduler

BACKENDS: dict[str, type[Scheduler]] = {"slurm": SlurmScheduler, "local": LocalScheduler}

__all__ = ["BACKENDS", "Capabilities", "JobSpec", "Scheduler", "scheduler_for"]


def scheduler_for(executor: str | Enum | None = None) -> Scheduler:
    """The backend of `cluster.executor` (a name or the config's enum); None: the one this process runs
    under, from the environment (submitit's SUBMITIT_EXECUTOR in a task, else Slurm inside a Slurm job)."""
    if executor is None:
        executor = os.environ.get("SUBMITIT_EXECUTOR") or ("slurm" if os.environ.get("SLURM_JOB_ID") else "local")
    name = str(getattr(executor, "value", executor))
    if name not in BACKENDS:
        raise ValueError(f"no scheduler {name!r}: hpctrain has {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()
