"""Submit a run through submitit and, when its tasks run on this machine (the local executor), follow it to the end.

A Slurm submission returns at once (a login shell is never blocked) and says where to look; a local run
streams rank 0's output as it trains, since the user is waiting for it. A local job that fails ends with what
failed (the rank, the step and the error, from the run's failure records), the failed task's log file (which
holds the traceback) and the run directory; never with a traceback on the console.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from omegaconf import OmegaConf

from hpctrain.bounded import Unreadable, read_text
from hpctrain.config.layout import Layout
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Config, as_node
from hpctrain.launch.executor import build_executor
from hpctrain.launch.rundir import RunDir, create_run_dir
from hpctrain.launch.secrets import export, without_redacted
from hpctrain.records.jobs import append_job
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for
from hpctrain.train.task import TrainTask


def submit(
    cfg: Config, layout: Layout, run: RunDir, plan: dict[str, Any], secrets: dict[str, str] | None = None
) -> submitit.Job:
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
        plain = OmegaConf.to_container(as_node(cfg), resolve=True, enum_to_str=True)
        assert isinstance(plain, dict)  # a DictConfig's container
        config = without_redacted({str(k): v for k, v in plain.items()})
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
        raise ConfigError(
            [
                Problem(
                    "cluster.executor",
                    f"cluster.executor=slurm, but this machine has no Slurm client ({exc})",
                    "submit from a Slurm login node, or run here with cluster=local",
                )
            ]
        ) from None
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


def refused_submission(cfg: Config, exc: BaseException) -> Problem:
    """The scheduler's refusal as a problem: its own message, the key that sets what it refused, the fix."""
    if isinstance(exc, OSError):
        message = f"the job could not be submitted: {exc}"
        if getattr(exc, "filename", None) in ("sbatch", b"sbatch") or "sbatch" in str(exc):
            return Problem(
                "cluster.executor",
                message + " (no sbatch on this machine)",
                "submit from a Slurm login node, or run here with cluster=local",
            )
        return Problem("cluster", message, "check the run directory's file system and the cluster settings")
    said = _scheduler_message(str(exc))
    if re.search(_UNREACHABLE, said, re.IGNORECASE):
        return Problem(
            "cluster.executor",
            f"the scheduler did not take the job: {said}",
            "Slurm's controller did not answer (scontrol ping says whether it is up): submit again "
            "when it does, with the same command",
        )
    extra = {str(k): v for k, v in dict(cfg.cluster.sbatch_extra).items()}
    named = [k for k in extra if re.search(rf"\b{re.escape(k)}\b", said, re.IGNORECASE)]
    if named:
        key = f"cluster.sbatch_extra.{named[0]}"
    else:
        key = next(
            (k for pattern, k in _REFUSAL_KEYS if re.search(pattern, said, re.IGNORECASE)),
            "cluster.sbatch_extra" if extra else "cluster",
        )
        gres = [k for k in extra if re.search(r"gres|gpu", k, re.IGNORECASE)]
        if key == "cluster.gpus_per_node" and gres:  # the GPUs asked for through sbatch_extra
            key = f"cluster.sbatch_extra.{gres[0]}"
    value = _value_of(cfg, key)
    hint = {
        "cluster.gpus_per_node": " (sbatch --gpus-per-node; cluster.gpu_type=cpu asks for no GPUs)",
        "cluster.time_min": " (the partition's MaxTime)",
        "cluster.mem_gb": " (0: the partition's default)",
        "cluster.nodes": " (or what each node is asked for: cluster.gpus_per_node, cluster.cpus_per_task, "
        "cluster.mem_gb, cluster.constraint)",
    }
    return Problem(
        key,
        f"the scheduler refused the job: {said}" + (f" ({key}={value})" if value is not None else ""),
        f"change {key}{hint.get(key, '')} to a value this cluster accepts (sinfo and scontrol show "
        "partition list what it has); dry_run=true shows the sbatch script hpctrain submits",
    )


def _scheduler_message(text: str) -> str:
    """sbatch's own words (its `sbatch: error:` lines), without submitit's wrapping."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return " ".join(errors or lines[-3:]) or "(no message)"


def _value_of(cfg: Config, key: str) -> Any:
    value = OmegaConf.select(as_node(cfg), key, default=None)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def launch(
    cfg: Config, layout: Layout, run: RunDir, plan: dict[str, Any], secrets: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Submit; follow a local job. Returns the exit code, the job id and, for a failed local job, what failed
    (as printed: a sweep's table shows it too)."""
    job = submit(cfg, layout, run, plan, secrets)
    backend = scheduler_for(cfg.cluster.executor)
    if backend.capabilities.runs_here:  # the user waits at the console
        print(f"{backend.name} job {job.job_id}: {layout.world_size} ranks, logs in {run.submitit_folder}", flush=True)
        ranks_per_task = layout.gpus_per_node if cfg.launcher.in_allocation else 1
        code, failure = follow(job, explain=lambda exc: explain_failure(run.path, job, exc, ranks_per_task))
        if code == 0:
            print(f"run directory: {run.path}", flush=True)
        return code, str(job.job_id), failure
    per_node = "1 agent starting" if cfg.launcher.in_allocation else "with"
    print(f"submitted job {job.job_id} ({layout.nodes} nodes, each {per_node} {layout.gpus_per_node} ranks)")
    print(f"follow it with: tail -F {job.paths.stdout}  (squeue -j {job.job_id})")
    print(f"run directory: {run.path}", flush=True)
    return 0, str(job.job_id), ""


def follow(
    job: submitit.Job, poll_s: float = 0.5, explain: Callable[[BaseException | None], str] | None = None
) -> tuple[int, str]:
    """Echo rank 0's stdout while the job runs; on failure say what failed (`explain`: from the task's exception,
    the lines to print), never with a traceback: that stays in the task's log file. Returns the exit code and
    what was said of a failure."""
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
        return 0, ""
    except KeyboardInterrupt:
        job.cancel()
        print("interrupted: job cancelled", file=sys.stderr)
        return 130, "interrupted: job cancelled"
    except Exception as exc:  # noqa: BLE001  (a task raised, submitit re-raising it; or it never finished)
        text = explain(exc) if explain is not None else f"{_last_error(str(exc))}\nlogs: {Path(job.paths.stderr)}"
        print(f"hpctrain: job {job.job_id} failed: " + text.replace("\n", "\n  "), file=sys.stderr, flush=True)
        return 1, text


def explain_failure(run_dir: Path, job: submitit.Job, exc: BaseException | None, ranks_per_task: int = 1) -> str:
    """Which rank failed at which step with what (the run's failure records of the job's last attempt; when no
    rank left its own, the ranks that left none and what the task said), why the run stopped (FAILED.json, when
    this job wrote it), the failed task's log file (its traceback is there), the run directory. Lines of text;
    whatever is missing or damaged on disk is left out, never raised."""
    job_id = str(job.job_id)
    lines: list[str] = []
    records, key, world = _failure_records(run_dir, job_id)
    own = [r for r in records if not r.get("peer")]
    task_said = _task_error(exc) if exc is not None else ""
    root_rank: int | None = None
    if own:
        r = own[0]
        root_rank = _int(r.get("rank"))
        lines.append(
            f"rank {r.get('rank')} failed at step {r.get('step')}: {r.get('type')}: "
            f"{_first_lines(str(r.get('message', '')))}"
        )
        record = RunPaths(run_dir).failures(key) / f"rank{r.get('rank')}.json"
        lines.append(f"failure record: {record}")
    else:
        died = _exited_rank(str(exc or ""))
        silent = sorted(set(range(world)) - {_int(r.get("rank")) for r in records}) if world else []
        if died is not None:
            root_rank = died[0]
            lines.append(
                f"rank {died[0]} "
                + (f"was killed by signal {-died[1]}" if died[1] < 0 else f"exited with code {died[1]}")
                + " without a failure record"
            )
        elif records and silent:
            root_rank = silent[0]
            lines.append(
                f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} ended without a "
                "failure record (killed, or the process exited)"
            )
        if records:
            r = records[0]
            lines.append(
                f"rank {r.get('rank')} lost its peers at step {r.get('step')}: {r.get('type')}: "
                f"{_first_lines(str(r.get('message', '')), 1)}"
            )
        if not lines:
            lines.append(task_said or "the job ended without a result")
    stopped = _stopped(run_dir, job_id)
    if stopped:
        lines.append(f"the run stopped: {stopped}")
    lines.append(f"task log: {_task_log(job, exc, root_rank, ranks_per_task)}")
    lines.append(f"run directory: {run_dir}")
    return "\n".join(lines)


def _failure_records(run_dir: Path, job_id: str) -> tuple[list[dict[str, Any]], str, int]:
    """The records of the job's last attempt that left any (oldest first), its key, and its world size (from
    its host map; 0 when unknown). Damaged records are skipped."""
    from hpctrain.records.failures import last_attempt

    try:
        key = last_attempt(run_dir, job_id)
    except Exception:  # noqa: BLE001  (a damaged record among the restarts: the first attempt's)
        key = job_id
    folder = RunPaths(run_dir).failures(key)
    records = []
    for path in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(read_text(path, RECORD_BYTES))
        except (Unreadable, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    records.sort(key=lambda r: float(r["time"]) if isinstance(r.get("time"), (int, float)) else 0.0)
    try:
        hosts = json.loads(read_text(RunPaths(run_dir).hosts(key), RECORD_BYTES))
    except (Unreadable, ValueError):
        hosts = []
    return records, key, len(hosts) if isinstance(hosts, list) else 0


RECORD_BYTES = 2**20  # a failure record, a host map, FAILED.json: kilobytes


def _stopped(run_dir: Path, job_id: str) -> str:
    """Why the workers stopped the run (FAILED.json), when this job wrote it."""
    try:
        report = json.loads(read_text(RunPaths(run_dir).failed, RECORD_BYTES))
    except (Unreadable, ValueError):
        return ""
    if not isinstance(report, dict) or str(report.get("job_id")) != job_id:
        return ""
    return str(report.get("why") or "")


def _task_log(job: submitit.Job, exc: BaseException | None, rank: int | None, ranks_per_task: int) -> Path:
    """The stderr log of the task that held the failed rank; else of the first task that failed."""
    tasks = max(int(getattr(job, "num_tasks", 1) or 1), 1)
    if rank is not None and 0 <= rank // max(ranks_per_task, 1) < tasks:
        return Path(job.task(rank // max(ranks_per_task, 1)).paths.stderr) if tasks > 1 else Path(job.paths.stderr)
    match = re.search(r"task[=:]\s*(\d+)", str(exc or ""))
    if match and int(match.group(1)) < tasks and tasks > 1:
        return Path(job.task(int(match.group(1))).paths.stderr)
    return Path(job.paths.stderr)


def _task_error(exc: BaseException) -> str:
    """What a task's exception says, without its traceback or submitit's hint: the last exception line of the
    trace submitit carries (the class without its module), or the first line of an uncompleted job's error."""
    return (
        _last_error(str(exc))
        if isinstance(exc, submitit.core.utils.FailedJobError)
        else (_first_lines(f"{type(exc).__name__}: {exc}", 1))
    )


def _last_error(text: str) -> str:
    body = text.split("----------------------")
    trace = body[1] if len(body) >= 3 else text
    lines = trace.strip("\n").splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    rest = lines[frames[-1] + 1 :] if frames else lines
    rest = [line for line in rest if line.strip() and not line.startswith(" ")] or rest
    if not rest:
        return "the task failed"
    first, more = rest[0], rest[1:]
    name, sep, message = first.partition(": ")
    if sep and re.fullmatch(r"[\w.]+", name):
        first = f"{name.rsplit('.', 1)[-1]}: {message}"
    return _first_lines("\n".join([first] + more), 12)


def _exited_rank(text: str) -> tuple[int, int] | None:
    """torchelastic's root cause (a worker that exited or was killed): its rank and exit code."""
    match = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", text, re.DOTALL)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _first_lines(text: str, n: int = 3) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n]) + (" ..." if len(lines) > n else "")


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
