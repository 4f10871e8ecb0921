"""The scheduler seam: which backend answers, and what each one asks of its batch system.

The Slurm commands are stand-ins on PATH that log their arguments and print what a real one would, so the
exact calls are checked without a cluster (tests/slurm runs them on a real one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.config.schema import Executor
from hpctrain.scheduler import scheduler_for
from hpctrain.scheduler.local import LocalScheduler
from hpctrain.scheduler.slurm import SlurmScheduler

SLURM_VARIABLES = (
    "SUBMITIT_EXECUTOR",
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
)


@pytest.fixture
def slurm_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """fake(name, stdout="", code=0) puts a stand-in for a Slurm command on PATH; calls() lists the calls."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def fake(name: str, stdout: str = "", code: int = 0) -> None:
        (bin_dir / name).write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\nprintf '%s' '{stdout}'\nexit {code}\n")
        (bin_dir / name).chmod(0o755)

    fake.calls = lambda: log.read_text().splitlines() if log.exists() else []  # type: ignore[attr-defined]
    return fake


def test_the_backend_follows_the_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SLURM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert isinstance(scheduler_for(Executor.slurm), SlurmScheduler)
    assert isinstance(scheduler_for("local"), LocalScheduler)
    assert isinstance(scheduler_for(), LocalScheduler)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert isinstance(scheduler_for(), SlurmScheduler)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")  # submitit's own word wins: a local run in an allocation
    assert isinstance(scheduler_for(), LocalScheduler)
    with pytest.raises(ValueError, match="no scheduler 'pbs'"):
        scheduler_for("pbs")


def test_slurm_requeues_its_own_job(slurm_commands, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_commands("scontrol")
    assert not SlurmScheduler().requeue_self()  # not in a Slurm job
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert SlurmScheduler().requeue_self()
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert SlurmScheduler().requeue_self()
    assert slurm_commands.calls() == ["scontrol requeue 77", "scontrol requeue 70_3"]
    slurm_commands("scontrol", code=1)
    assert not SlurmScheduler().requeue_self()


def test_slurm_drains_nodes(slurm_commands) -> None:
    slurm_commands("scontrol")
    assert SlurmScheduler().drain(["n1", "n3"], "hpctrain pre-flight: n1: slow")
    assert slurm_commands.calls() == ["scontrol update nodename=n1,n3 state=drain reason=hpctrain pre-flight: n1: slow"]
    slurm_commands("scontrol", code=1)
    assert not SlurmScheduler().drain(["n1"], "x")


def test_slurm_lists_a_partitions_nodes(slurm_commands) -> None:
    slurm_commands("sinfo", "debug*|n[1-2]\nurgent|n[1-4]\n")
    slurm_commands("scontrol", "n1 n2")
    assert SlurmScheduler().partition_nodes(None) == ["n1", "n2"]
    assert SlurmScheduler().partition_nodes("urgent") == ["n1", "n2"]
    assert SlurmScheduler().partition_nodes("gone") == []
    assert slurm_commands.calls() == [
        "sinfo -h -o %P|%N",
        "scontrol show hostnames n[1-2]",
        "sinfo -h -o %P|%N",
        "scontrol show hostnames n[1-4]",
        "sinfo -h -o %P|%N",
    ]


def test_slurm_resubmits_the_same_script_and_pickle(slurm_commands, tmp_path: Path) -> None:
    folder = tmp_path / "submitit"
    folder.mkdir()
    (folder / "5_submission.sh").write_text("#!/bin/bash\n")
    (folder / "5_submitted.pkl").write_bytes(b"pickle")
    slurm_commands("sbatch", "6;cluster")
    slurm_commands("scontrol")
    assert SlurmScheduler().resubmit(folder, "5", ["n2", "n4"]) == "6"
    assert (folder / "6_submitted.pkl").read_bytes() == b"pickle" and (folder / "6_submission.sh").exists()
    assert slurm_commands.calls() == [
        f"sbatch --hold --parsable --exclude=n2,n4 {folder}/5_submission.sh",
        "scontrol release 6",
    ]


def test_the_job_context_comes_from_the_scheduler(slurm_commands, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert SlurmScheduler().job_context() == {"job_id": "9", "restart_count": 2, "nodelist": "n[1-2]", "num_nodes": "2"}
    assert LocalScheduler().job_context()["num_nodes"] == 1


def test_the_local_executor_has_no_queue_and_no_nodes(slurm_commands, tmp_path: Path) -> None:
    local = LocalScheduler()
    assert not local.requeue_self() and not local.drain(["n1"], "x") and local.partition_nodes(None) == []
    with pytest.raises(NotImplementedError):
        local.resubmit(tmp_path, "1", [])
    assert slurm_commands.calls() == []


def test_the_seam_and_the_records_import_neither_torch_nor_the_launcher() -> None:
    """The tasks reach the scheduler and the records without the login side, the login side without torch."""
    code = (
        "import sys, hpctrain.scheduler, hpctrain.records.failures, hpctrain.records.jobs, "
        "hpctrain.records.fingerprint; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('hpctrain.launch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
