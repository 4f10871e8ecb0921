"""Slurm: submission through submitit's SlurmExecutor, and the scontrol / sinfo / sbatch calls hpctrain makes.

The sbatch preview renders through submitit's private `_make_sbatch_string`: submitit has no public sbatch
renderer, and that function is what `SlurmExecutor` itself writes the script with, so the preview is the
submitted script. tests/launch/test_submitit_private.py pins its signature and output, and checks the preview
against the script SlurmExecutor really submits, so a submitit release that changes it fails there first.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.scheduler import container as containers
from hpctrain.scheduler.base import Allocation, Capabilities, JobSpec, Scheduler

if TYPE_CHECKING:
    import submitit

    from hpctrain.config.schema import ClusterConfig

log = logging.getLogger(__name__)
TIMEOUT_S = 60  # for every Slurm command: a wedged slurmctld must not hang the caller for ever
# sacct's fields for `accounting`, in this order; -D keeps every run of a requeued job, -X the allocation only.
# Suspended: the job's time suspended (`scontrol suspend`), inside Start-End (the goodput ledger's "suspended").
SACCT_FIELDS = (
    "JobIDRaw",
    "State",
    "Submit",
    "Eligible",
    "Start",
    "End",
    "NNodes",
    "NodeList",
    "ExitCode",
    "Reason",
    "Suspended",
)


def slurm_parameters(cluster: ClusterConfig, job: JobSpec) -> dict[str, Any]:
    """submitit's Slurm parameters (sbatch option names) from conf/cluster; the container's srun options and
    setup lines come after the site's own (hpctrain/scheduler/container.py)."""
    c = cluster
    params: dict[str, Any] = {
        "job_name": job.name,
        "nodes": job.nodes,
        "ntasks_per_node": job.tasks_per_node,
        "cpus_per_task": job.cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "setup": [*c.setup, *containers.setup_lines(c.container)],
        "srun_args": [*c.srun_args, *containers.srun_args(c.container, job.run_dir)],
        "stderr_to_stdout": False,
    }
    if job.after:  # `$?` is srun's exit code on the line right after it
        params["teardown"] = [" ".join([*map(shlex.quote, job.after), "$SLURM_JOB_ID $?"])]
    if job.gpus_per_node:
        params["gpus_per_node"] = job.gpus_per_node
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
    if job.survive_node_loss:  # neither the job nor the step ends when a node dies
        extra["no_kill"] = True
        params["srun_args"].append("--no-kill")
    extra.update(dict(c.sbatch_extra))
    if extra:
        params["additional_parameters"] = extra
    return params


def python_command(cluster: ClusterConfig, job: JobSpec) -> str:
    """What srun starts the tasks' interpreter with: the container's, or this process' own (submitit's default)."""
    return containers.python_command(cluster.container, job.run_dir, gpus=job.gpus_per_node > 0) or shlex.quote(
        sys.executable
    )


def _own_job_id() -> str | None:
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID") and f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return array or env.get("SLURM_JOB_ID")


def _run(args: list[str], check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, check=check)


class SlurmScheduler(Scheduler):
    name = "slurm"
    capabilities = Capabilities(
        multi_node=True,
        runs_here=False,
        warning_signal=True,  # --signal=USR2@<cluster.signal_delay_s>
        requeue=True,  # --requeue, scontrol requeue
        confines_cpus=True,  # --cpus-per-task
        containers=True,  # srun --container-image (pyxis), or srun apptainer exec
        srun_args=True,
        log_path_patterns=True,  # --output=<folder>/%j_%t_log.out
    )

    def executor(self, cluster: ClusterConfig, job: JobSpec) -> submitit.Executor:
        import submitit

        executor = submitit.SlurmExecutor(
            folder=job.folder, max_num_timeout=cluster.max_num_timeout, python=python_command(cluster, job)
        )
        executor.update_parameters(**slurm_parameters(cluster, job))
        return executor

    def script(self, cluster: ClusterConfig, job: JobSpec) -> str:
        # Private, pinned by tests/launch/test_submitit_private.py: see the module docstring.
        from submitit.slurm.slurm import _make_sbatch_string

        command = " ".join([python_command(cluster, job), "-u -m submitit.core._submit", shlex.quote(str(job.folder))])
        return _make_sbatch_string(command=command, folder=job.folder, **slurm_parameters(cluster, job))

    def partition_nodes(self, partition: str | None) -> list[str]:
        try:
            out = _run(["sinfo", "-h", "-o", "%P|%N"], check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        lists = [
            nodes
            for name, _, nodes in (line.partition("|") for line in out.splitlines())
            if (name.rstrip("*") == partition if partition else name.endswith("*")) and nodes
        ]
        if not lists:
            return []
        hosts = _run(["scontrol", "show", "hostnames", ",".join(lists)])
        return sorted(set(hosts.stdout.split())) if hosts.returncode == 0 else []

    def resubmit(self, folder: Path, job_id: str, exclude: list[str]) -> str:
        """sbatch --hold the job's script, give the new id the same pickle (submitit's file names), release."""
        script = folder / f"{job_id}_submission.sh"
        # Not this run's requeue count: sbatch passes the environment on, and Slurm sets SLURM_RESTART_COUNT
        # only once the new job is requeued itself (a stale one would name its records after this run's).
        fresh = {k: v for k, v in os.environ.items() if k != "SLURM_RESTART_COUNT"}
        out = subprocess.run(
            ["sbatch", "--hold", "--parsable"]
            + ([f"--exclude={','.join(exclude)}"] if exclude else [])
            + [str(script)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=True,
            env=fresh,
        ).stdout.strip()
        new_id = out.split(";")[0]
        shutil.copy(folder / f"{job_id}_submitted.pkl", folder / f"{new_id}_submitted.pkl")
        shutil.copy(script, folder / f"{new_id}_submission.sh")
        _run(["scontrol", "release", new_id], check=True)
        return new_id

    def cancel_requeue(self, job_id: str) -> bool:
        """`Requeue=0` on the running job, so a NODE_FAIL that follows does not put it back in the queue; False
        when that failed or came too late: slurmctld requeued the job already (its restart count went past the
        one this batch script runs as; seen on the dev cluster 0.3 s before the update)."""
        result = _run(["scontrol", "update", f"jobid={job_id}", "requeue=0"])
        if result.returncode:
            log.error("scontrol update jobid=%s requeue=0 failed: %s", job_id, result.stderr.strip())
            return False
        shown = _run(["scontrol", "show", "job", "-o", job_id]).stdout
        restarts = re.search(r"\bRestarts=(\d+)", shown)
        return restarts is not None and int(restarts.group(1)) <= int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def accounting(self, job_ids: list[str], timeout_s: float = TIMEOUT_S) -> list[Allocation] | None:
        """sacct's record of each run, with times as epoch seconds (SLURM_TIME_FORMAT=%s: no time zone to
        guess); [] when sacct fails or knows none of them (a cluster without slurmdbd)."""
        if not job_ids:
            return []
        command = ["sacct", "-X", "-D", "-P", "-n", "-o", ",".join(SACCT_FIELDS), "-j", ",".join(job_ids)]
        try:
            out = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
                env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
            )
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("sacct failed: %s", exc)
            return []
        if out.returncode:
            log.warning("sacct failed: %s", out.stderr.strip())
            return []
        return parse_sacct(out.stdout)

    def requeue_self(self) -> bool:
        job_id = _own_job_id()
        if not job_id:
            return False
        result = _run(["scontrol", "requeue", job_id])
        if result.returncode:
            log.error("scontrol requeue %s failed: %s", job_id, result.stderr.strip())
            return False
        log.info("requeued job %s", job_id)
        return True

    def end_self(self) -> bool:
        """scancel: under --no-kill a job whose batch host died keeps its other nodes until the time limit
        (measured on the dev cluster: the batch step never reports its end)."""
        job_id = _own_job_id()
        if not job_id:
            return False
        result = _run(["scancel", job_id])
        if result.returncode:
            log.error("scancel %s failed: %s", job_id, result.stderr.strip())
            return False
        log.info("ended job %s (its batch host is gone)", job_id)
        return True

    def drain(self, hosts: list[str], reason: str) -> bool:
        result = _run(["scontrol", "update", f"nodename={','.join(hosts)}", "state=drain", f"reason={reason}"])
        if result.returncode:
            log.warning("could not drain %s: %s", hosts, result.stderr.strip())
        return result.returncode == 0

    def job_context(self) -> dict[str, Any]:
        env = os.environ
        return {
            "job_id": env.get("SLURM_JOB_ID"),
            "restart_count": int(env.get("SLURM_RESTART_COUNT", 0)),
            "nodelist": env.get("SLURM_JOB_NODELIST"),
            "num_nodes": env.get("SLURM_JOB_NUM_NODES"),
        }


def parse_sacct(text: str) -> list[Allocation]:
    """`sacct -X -D -P -n -o SACCT_FIELDS` with epoch times -> one Allocation per line, oldest start first
    ("CANCELLED by 0" keeps its first word; "None assigned": no nodes yet). Lines without the last field
    (Suspended: the fields before it was asked for) read as never suspended."""
    runs = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) == len(SACCT_FIELDS) - 1:
            fields.append("")
        if len(fields) != len(SACCT_FIELDS):
            continue
        job, state, submit, eligible, start, end, nodes, node_list, exit_code, reason, suspended = fields
        runs.append(
            Allocation(
                job_id=job,
                state=state.split()[0] if state else "",
                submit=_epoch(submit),
                eligible=_epoch(eligible),
                start=_epoch(start),
                end=_epoch(end),
                nodes=int(nodes) if nodes.isdigit() else 0,
                node_list="" if node_list in ("None assigned", "(null)") else node_list,
                exit_code=exit_code,
                reason=reason,
                suspended_s=_elapsed(suspended),
            )
        )
    return sorted(runs, key=lambda r: (r.start is None, r.start or r.submit or 0))


def _elapsed(value: str) -> float:
    """sacct's elapsed time, [D-]HH:MM:SS (or MM:SS, or MM:SS.mmm) -> seconds; 0 when empty or unreadable."""
    days, _, clock = value.strip().rpartition("-")
    try:
        seconds = 0.0
        for part in clock.split(":"):
            seconds = seconds * 60 + float(part)
        return seconds + 86400 * int(days or 0)
    except ValueError:
        return 0.0


def _epoch(value: str) -> float | None:
    """sacct's time with SLURM_TIME_FORMAT=%s; "Unknown" (not yet) and "None" -> None."""
    return float(value) if value.isdigit() else None
