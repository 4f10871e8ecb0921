"""Scheduler capabilities instead of executor names (issue 47, item 5): a rule that holds for some batch systems only
asks the backend (`Scheduler.capabilities`), so a backend with other answers gets other decisions.

Each backend's answers are checked against what it really does (its script, its executor's parameters); a toy
backend, the real one with one answer changed, registered in BACKENDS under the config's executor name, flips the
real checks' decision; and no code outside hpctrain/scheduler/ branches on the executor's name.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest
import submitit

from hpctrain.checks.runner import check_config, run_checks
from hpctrain.launch.executor import job_spec, sbatch_preview
from hpctrain.launch.plan_view import build_plan
from hpctrain.launch.rundir import RunDir
from hpctrain.scheduler import BACKENDS, Capabilities, JobSpec, Scheduler, scheduler_for
from hpctrain.scheduler.local import LocalScheduler, local_parameters
from hpctrain.scheduler.slurm import SlurmScheduler

REPO = Path(__file__).resolve().parents[2]
DEV = ("cluster=dev",)  # the Slurm test cluster's file: executor slurm, 2 nodes of 2 CPU tasks


def _toy(monkeypatch: pytest.MonkeyPatch, name: str, **answers: bool) -> type[Scheduler]:
    """Register, under the executor name `name`, the real backend with the given capabilities changed."""
    real = BACKENDS[name]
    toy = type(f"Toy{real.__name__}", (real,), {"capabilities": replace(real.capabilities, **answers)})
    monkeypatch.setitem(BACKENDS, name, toy)
    return toy


def _findings(cfg, kind: str) -> dict[str, list[str]]:
    """The real checks' errors or warnings, key -> messages."""
    report = run_checks(cfg)
    found: dict[str, list[str]] = {}
    for problem in getattr(report, kind):
        found.setdefault(problem.key, []).append(problem.message)
    return found


# ------------------------------------------------------------------ each backend's answers, against what it does


def test_every_backend_answers_every_question() -> None:
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert isinstance(backend.capabilities, Capabilities), name
    assert {f.name for f in fields(Capabilities)} == {
        "multi_node",
        "runs_here",
        "warning_signal",
        "requeue",
        "confines_cpus",
        "containers",
        "srun_args",
        "log_path_patterns",
    }


def test_slurm_does_what_it_answers(compose_cfg, tmp_path: Path) -> None:
    """Every answer is yes, each visible in the batch script the submission writes."""
    assert SlurmScheduler.capabilities == Capabilities(
        multi_node=True,
        runs_here=False,
        warning_signal=True,
        requeue=True,
        confines_cpus=True,
        containers=True,
        srun_args=True,
        log_path_patterns=True,
    )
    cfg = compose_cfg(
        *DEV,
        "cluster.nodes=2",
        "cluster.cpus_per_task=3",
        "cluster.srun_args=['--cpu-bind=none']",
        "cluster.container.runtime=pyxis",
        "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'",
        "dry_run=true",
    )
    layout = check_config(cfg).layout
    text = sbatch_preview(cfg, layout, "RUNID", tmp_path / "submitit")
    job = job_spec(cfg, "RUNID", layout, tmp_path / "submitit")
    assert text is not None and job.cpus_per_task % 3 == 0  # 3 per rank, of each task's ranks
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "#SBATCH --nodes=2\n" in text  # multi_node
    assert f"#SBATCH --signal=USR2@{cfg.cluster.signal_delay_s}\n" in text  # warning_signal
    assert "#SBATCH --requeue\n" in text  # requeue (cluster.requeue)
    assert f"#SBATCH --cpus-per-task={job.cpus_per_task}\n" in text  # confines_cpus
    assert "--container-image=" in srun  # containers
    assert "--cpu-bind=none" in srun  # srun_args
    assert re.search(r"#SBATCH --output=\S*%j", text)  # log_path_patterns


def test_local_does_what_it_answers(compose_cfg, tmp_path: Path) -> None:
    """One machine, no batch script: one node whatever is asked, no CPU binding, no srun, no requeue."""
    assert LocalScheduler.capabilities == Capabilities(
        multi_node=False,
        runs_here=True,
        warning_signal=False,
        requeue=False,
        confines_cpus=False,
        containers=False,
        srun_args=False,
        log_path_patterns=False,
    )
    cfg = compose_cfg("cluster.cpus_per_task=3")
    job = JobSpec(name="j", folder=tmp_path / "submitit", run_dir=tmp_path, nodes=2, tasks_per_node=2, cpus_per_task=3)
    params = local_parameters(cfg.cluster, job)
    assert params["nodes"] == 1  # multi_node: no
    assert "cpus_per_task" not in params  # confines_cpus: no
    assert LocalScheduler().script(cfg.cluster, job) is None  # no batch script: no srun, no log patterns
    assert isinstance(LocalScheduler().executor(cfg.cluster, job), submitit.LocalExecutor)  # runs_here
    assert LocalScheduler().requeue_self() is False  # requeue: no (and so no stop at the signal to go on after)


def test_a_backend_that_warns_before_its_time_limit_requeues() -> None:
    """A backend that warns before its time limit also requeues: the stop at the signal goes on in a next allocation."""
    for backend in BACKENDS.values():
        assert backend.capabilities.requeue or not backend.capabilities.warning_signal, backend.name


# ------------------------------------------------------------------ a toy backend's answers change the decisions

# (config, backend, the answer changed, errors or warnings, the key the real backend's answer raises)
DECISIONS = [
    pytest.param((), "local", {"multi_node": True}, "errors", "cluster.nodes", id="one-machine"),
    pytest.param((), "local", {"multi_node": True}, "errors", "cluster.spare_nodes", id="no-spares"),
    pytest.param((), "local", {"runs_here": False}, "errors", "cluster.gpus_per_node", id="this-machines-gpus"),
    pytest.param((), "local", {"containers": True}, "errors", "cluster.container.runtime", id="containers"),
    pytest.param(DEV, "slurm", {"warning_signal": False}, "warnings", "cluster.signal_delay_s", id="signal-lead"),
    pytest.param(DEV, "slurm", {"requeue": False}, "warnings", "cluster.time_min", id="requeue-time"),
    pytest.param(DEV, "slurm", {"confines_cpus": False}, "warnings", "train.threads_per_rank", id="cpus"),
    pytest.param(DEV, "slurm", {"srun_args": False}, "errors", "cluster.srun_args", id="srun-args"),
    pytest.param(DEV, "slurm", {"log_path_patterns": False}, "errors", "run.name", id="log-patterns"),
]
# What makes each rule fire under the real backend
TRIGGERS = {
    "cluster.nodes": ["cluster.nodes=2"],
    "cluster.spare_nodes": ["cluster.spare_nodes=1", "launcher.in_allocation=true"],
    "cluster.gpus_per_node": ["cluster.gpu_type=h100"],  # with CUDA_VISIBLE_DEVICES empty: no GPU here
    "cluster.container.runtime": ["cluster.container.runtime=apptainer", "cluster.container.image=/images/pt.sif"],
    "cluster.signal_delay_s": ["cluster.signal_delay_s=10"],
    "cluster.time_min": ["cluster.time_min=5"],
    "train.threads_per_rank": ["train.threads_per_rank=4", "cluster.cpus_per_task=1"],
    "cluster.srun_args": ["cluster.srun_args=['--export=NONE']"],
    "run.name": ["run.name=a%b"],
}


@pytest.mark.parametrize("base,name,answers,kind,key", DECISIONS)
def test_a_backend_with_other_answers_gets_other_decisions(
    compose_cfg, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, base, name, answers, kind, key
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the same answer on a machine with GPUs
    cfg = compose_cfg(*base, *TRIGGERS[key], f"run.root={tmp_path}")
    assert cfg.cluster.executor.value == name
    assert key in _findings(cfg, kind), f"the real {name} backend's rule no longer fires"
    _toy(monkeypatch, name, **answers)
    assert key not in _findings(cfg, kind), f"{name} answering {answers} still gets the {key} finding"


def test_the_signal_lead_is_measured_where_the_backend_warns(compose_cfg, monkeypatch, tmp_path: Path) -> None:
    """On the tasks: the run checks its measured stop against cluster.signal_delay_s where the backend sends the
    warning signal (a local run does not, until a backend that runs here says it does)."""
    import torch

    from hpctrain.parallel.engine import StepStats
    from hpctrain.tracking.tracker import Tracker
    from hpctrain.train.progress import StepReporter

    cfg = compose_cfg("cluster.signal_delay_s=30", "tracking.mode=disabled", f"run.root={tmp_path}")
    save = {"event": "save_committed", "tier": "shared", "step": 1, "bytes": 1, "blocked_s": 0.1, "total_s": 40.0}

    def events() -> list[str]:
        tracker = Tracker(cfg, tmp_path, "lead", {})
        reporter = StepReporter(cfg, 1024, 2, torch.device("cpu"), 0, stop_tier="shared")
        reporter.step(tracker, 1, 8, StepStats(loss=1.0, grad_norm=1.0), 1e-3, 2.0, [save], ({}, []))
        path = tmp_path / "events.jsonl"
        return [json.loads(line)["event"] for line in path.read_text().splitlines()] if path.exists() else []

    assert "timeout_inconsistent" not in events()
    _toy(monkeypatch, "local", warning_signal=True, requeue=True)
    assert "timeout_inconsistent" in events()


def test_the_plans_batch_script_is_the_backends(compose_cfg, monkeypatch, tmp_path: Path) -> None:
    """The dry run shows what the run's backend renders, as the submission does: Slurm's script, none for local,
    and a new backend's own."""
    run = RunDir(run_id="RUNID", path=tmp_path / "run", resumed=False)
    local = compose_cfg(f"run.root={tmp_path}")
    assert "batch_script" not in build_plan(local, run_checks(local), run)
    slurm = compose_cfg(*DEV, f"run.root={tmp_path}")
    report = run_checks(slurm)
    script = SlurmScheduler().script(slurm.cluster, job_spec(slurm, "RUNID", report.layout, run.submitit_folder))
    assert build_plan(slurm, report, run)["batch_script"] == script

    class Scripted(LocalScheduler):
        def script(self, cluster, job: JobSpec) -> str:
            return f"#!/bin/sh\n# {job.nodes} node(s) x {job.tasks_per_node} task(s)\n"

    monkeypatch.setitem(BACKENDS, "local", Scripted)
    report = run_checks(local)
    job = job_spec(local, "RUNID", report.layout, run.submitit_folder)
    assert build_plan(local, report, run)["batch_script"] == Scripted().script(local.cluster, job)
    assert isinstance(scheduler_for("local"), Scripted)


# ------------------------------------------------------------------ no executor names outside the scheduler

# The acceptance grep: `git grep -n "executor == \|executor_name\|\.executor in" hpctrain | grep -v scheduler/`
ACCEPTANCE = re.compile(r"executor == |executor_name|\.executor in")
# Wider: a comparison with a backend's name or enum member, however spelled
BRANCH = re.compile(r"""Executor\.(local|slurm)\b|[!=]=\s*["'](local|slurm)["']|SUBMITIT_EXECUTOR["']\)\s*[!=]=""")
# Documented exceptions: file -> why it still names an executor
EXCEPTIONS = {
    "hpctrain/config/schema.py": "defines `Executor` and the default `cluster.executor` (local)",
    "hpctrain/config/layout.py": "the layout error's suggested job size (one node for local): config sits below the "
    "scheduler seam, whose backends import the config's types, so it cannot ask a backend without an import cycle",
}


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for path in sorted((REPO / "hpctrain").rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and "scheduler" not in path.relative_to(REPO).parts
    }


def test_no_code_outside_the_scheduler_branches_on_the_executors_name() -> None:
    sources = _sources()
    acceptance = [
        f"{name}: {line.strip()}"
        for name, text in sources.items()
        for line in text.splitlines()
        if ACCEPTANCE.search(line)
    ]
    assert acceptance == []
    branches = {
        name: [line.strip() for line in text.splitlines() if BRANCH.search(line)] for name, text in sources.items()
    }
    found = {name: lines for name, lines in branches.items() if lines}
    assert set(found) - set(EXCEPTIONS) == set(), {k: v for k, v in found.items() if k not in EXCEPTIONS}
    assert set(EXCEPTIONS) <= set(found), "an exception no longer names an executor: take it off the list"
