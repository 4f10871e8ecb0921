"""Submit a run through submitit and, for the local executor, follow it to the end.

A Slurm submission returns at once (a login shell is never blocked) and says where to look; a local run
streams rank 0's output as it trains, since the user is waiting for it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import submitit
from omegaconf import OmegaConf

from hpctrain.config.layout import Layout
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Executor
from hpctrain.launch.executor import build_executor
from hpctrain.launch.rundir import RunDir, create_run_dir
from hpctrain.launch.secrets import export, without_redacted
from hpctrain.records.jobs import append_job
from hpctrain.train.task import TrainTask


def submit(cfg: Any, layout: Layout, run: RunDir, plan: dict[str, Any],
           secrets: dict[str, str] | None = None) -> submitit.Job:
    """Write the run directory and submit its job. A submission the scheduler refuses raises ConfigError with
    the scheduler's own message and the key to change, and leaves the run directory as it found it (removed
    when this submission created it)."""
    undo = _Undo(run)
    try:
        create_run_dir(cfg, run)
        run.files.plan.write_text(json.dumps(plan, indent=1))
        if "memory_per_gpu_bytes" in plan:
            from hpctrain.launch.plan_chart import have_matplotlib, write_chart

            if have_matplotlib():
                write_chart(plan, run.files.plan_chart)
        executor = build_executor(cfg, layout, run.run_id, run.submitit_folder)
        config = without_redacted(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
        export(secrets or {})  # credentials reach the job through the environment sbatch passes on
        captured = io.StringIO()  # submitit prints sbatch's stderr itself before raising: it goes in our message
        with contextlib.redirect_stderr(captured):
            job = executor.submit(TrainTask(config=config, run_dir=str(run.path), layout=layout))
    except (submitit.core.utils.FailedJobError, OSError) as exc:
        undo()
        raise ConfigError([refused_submission(cfg, exc)]) from None
    except RuntimeError as exc:
        undo()
        if "srun" not in str(exc):  # submitit's SlurmExecutor on a machine without Slurm
            raise
        raise ConfigError([Problem("cluster.executor", f"cluster.executor=slurm, but this machine has no Slurm "
                                   f"client ({exc})", "submit from a Slurm login node, or run here with "
                                   "cluster=local")]) from None
    except BaseException:
        undo()
        raise
    append_job(run.path, job.job_id, cfg.cluster.executor.value, resumed=run.resumed)
    return job


class _Undo:
    """Puts a run directory back as it was before a submission that failed: removed if the submission created
    it; for a resume, config.yaml and plan.json as they were and the files the submission added removed."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.created = not run.path.exists()
        # The outermost directory this submission creates (run.root/run.name may be new too).
        self.top = run.path
        while not self.top.parent.exists():
            self.top = self.top.parent
        self.before: set[Path] = set()
        self.contents: dict[Path, bytes] = {}
        if not self.created:
            folders = [run.path, run.submitit_folder]
            self.before = {p for d in folders if d.is_dir() for p in d.iterdir()}
            self.contents = {p: p.read_bytes() for p in (run.files.config, run.files.plan) if p.is_file()}

    def __call__(self) -> None:
        run = self.run
        if self.created:
            shutil.rmtree(run.path, ignore_errors=True)
            for parent in run.path.parents:  # run.root/run.name made for it, if nothing else is there now
                if parent == self.top.parent:
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()
            return
        for folder in (run.path, run.submitit_folder):
            for p in list(folder.iterdir()) if folder.is_dir() else []:
                if p not in self.before and p.is_file():
                    p.unlink()
        if run.submitit_folder not in self.before:
            shutil.rmtree(run.submitit_folder, ignore_errors=True)
        for p, data in self.contents.items():
            p.write_bytes(data)


# Words of the scheduler's refusal -> the key that sets what it refused (first match wins).
_REFUSAL_KEYS = (
    (r"account|association", "cluster.account"),
    (r"partition", "cluster.partition"),
    (r"qos", "cluster.qos"),
    (r"time limit|time_limit|--time", "cluster.time_min"),
    (r"feature|constraint", "cluster.constraint"),
    (r"memory|--mem", "cluster.mem_gb"),
    (r"exclude|node name", "cluster.exclude"),
    (r"gres|generic resource|--gpus|gpus[-_ ]per", "cluster.gpus_per_node"),
    (r"node count|node configuration|nodes", "cluster.nodes"),
)
# The controller did not answer: nothing in the config is wrong.
_UNREACHABLE = r"contact slurm controller|connect(ion)? failure|socket timed out|timed out|slurm_load"


def refused_submission(cfg: Any, exc: BaseException) -> Problem:
    """The scheduler's refusal as a problem: its own message, the key that sets what it refused, the fix."""
    if isinstance(exc, OSError):
        message = f"the job could not be submitted: {exc}"
        if getattr(exc, "filename", None) in ("sbatch", b"sbatch") or "sbatch" in str(exc):
            return Problem("cluster.executor", message + " (no sbatch on this machine)",
                           "submit from a Slurm login node, or run here with cluster=local")
        return Problem("cluster", message, "check the run directory's file system and the cluster settings")
    said = _scheduler_message(str(exc))
    if re.search(_UNREACHABLE, said, re.IGNORECASE):
        return Problem("cluster.executor", f"the scheduler did not take the job: {said}",
                       "Slurm's controller did not answer (scontrol ping says whether it is up): submit again "
                       "when it does, with the same command")
    extra = {str(k): v for k, v in dict(cfg.cluster.sbatch_extra).items()}
    named = [k for k in extra if re.search(rf"\b{re.escape(k)}\b", said, re.IGNORECASE)]
    if named:
        key = f"cluster.sbatch_extra.{named[0]}"
    else:
        key = next((k for pattern, k in _REFUSAL_KEYS if re.search(pattern, said, re.IGNORECASE)),
                   "cluster.sbatch_extra" if extra else "cluster")
        gres = [k for k in extra if re.search(r"gres|gpu", k, re.IGNORECASE)]
        if key == "cluster.gpus_per_node" and gres:  # the GPUs asked for through sbatch_extra
            key = f"cluster.sbatch_extra.{gres[0]}"
    value = _value_of(cfg, key)
    hint = {"cluster.gpus_per_node": " (sbatch --gpus-per-node; cluster.gpu_type=cpu asks for no GPUs)",
            "cluster.time_min": " (the partition's MaxTime)", "cluster.mem_gb": " (0: the partition's default)",
            "cluster.nodes": " (or what each node is asked for: cluster.gpus_per_node, cluster.cpus_per_task, "
                             "cluster.mem_gb, cluster.constraint)"}
    return Problem(key, f"the scheduler refused the job: {said}" + (f" ({key}={value})" if value is not None else ""),
                   f"change {key}{hint.get(key, '')} to a value this cluster accepts (sinfo and scontrol show "
                   "partition list what it has); dry_run=true shows the sbatch script hpctrain submits")


def _scheduler_message(text: str) -> str:
    """sbatch's own words (its `sbatch: error:` lines), without submitit's wrapping."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " ".join(errors or lines[-3:]) or "(no message)"


def _value_of(cfg: Any, key: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def launch(cfg: Any, layout: Layout, run: RunDir, plan: dict[str, Any],
           secrets: dict[str, str] | None = None) -> tuple[int, str]:
    """Submit; follow a local job. Returns the exit code and the job id."""
    job = submit(cfg, layout, run, plan, secrets)
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
