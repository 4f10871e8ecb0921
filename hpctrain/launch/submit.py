"""Submit a run through submitit and, for the local executor, follow it to the end.

A Slurm submission returns at once (a login shell is never blocked) and says where to look; a local run
streams rank 0's output as it trains, since the user is waiting for it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import submitit
from omegaconf import OmegaConf

from hpctrain.config.layout import Layout
from hpctrain.config.schema import Executor
from hpctrain.launch.executor import build_executor
from hpctrain.launch.rundir import RunDir, create_run_dir
from hpctrain.records.jobs import append_job
from hpctrain.train.task import TrainTask


def submit(cfg: Any, layout: Layout, run: RunDir, plan: dict[str, Any]) -> submitit.Job:
    create_run_dir(cfg, run)
    run.files.plan.write_text(json.dumps(plan, indent=1))
    if "memory_per_gpu_bytes" in plan:
        from hpctrain.launch.plan_chart import have_matplotlib, write_chart

        if have_matplotlib():
            write_chart(plan, run.files.plan_chart)
    executor = build_executor(cfg, layout, run.run_id, run.submitit_folder)
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    job = executor.submit(TrainTask(config=config, run_dir=str(run.path), layout=layout))
    append_job(run.path, job.job_id, cfg.cluster.executor.value, resumed=run.resumed)
    return job


def launch(cfg: Any, layout: Layout, run: RunDir, plan: dict[str, Any]) -> tuple[int, str]:
    """Submit; follow a local job. Returns the exit code and the job id."""
    job = submit(cfg, layout, run, plan)
    if cfg.cluster.executor == Executor.local:
        print(f"local job {job.job_id}: {layout.world_size} ranks, logs in {run.submitit_folder}", flush=True)
        code = follow(job)
        print(f"run directory: {run.path}", flush=True)
        return code, str(job.job_id)
    per_node = "1 agent starting" if cfg.launcher.in_allocation else "with"
    print(f"submitted job {job.job_id} ({layout.nodes} nodes, each {per_node} {layout.gpus_per_node} ranks)")
    print(f"follow it with: tail -F {job.paths.stdout}  (squeue -j {job.job_id})")
    print(f"run directory: {run.path}", flush=True)
    return 0, str(job.job_id)


def follow(job: submitit.Job, poll_s: float = 0.5) -> int:
    """Echo rank 0's stdout while the job runs; on failure show each failed task's error."""
    stdout = Path(job.paths.stdout)
    offset = 0

    def pump() -> None:
        nonlocal offset
        if stdout.exists():
            with open(stdout, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()

    try:
        while not job.done():
            pump()
            time.sleep(poll_s)
        pump()
        job.results()
        return 0
    except KeyboardInterrupt:
        job.cancel()
        print("interrupted: job cancelled", file=sys.stderr)
        return 130
    except submitit.core.utils.UncompletedJobError as exc:
        print(f"job {job.job_id} failed:\n{_tail(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # a task raised: submitit re-raises it with the task's traceback
        print(f"job {job.job_id} failed: {_tail(str(exc))}", file=sys.stderr)
        return 1


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])
