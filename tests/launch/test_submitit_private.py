"""The one private submitit function hpctrain calls, pinned: `submitit.slurm.slurm._make_sbatch_string`.

submitit has no public sbatch renderer, and the dry-run plan must show the script that would really be
submitted, so hpctrain/scheduler/slurm.py renders the preview with the function SlurmExecutor itself uses.
These tests fail first, with what to look at, when a submitit release changes its signature or its output,
or stops using it for the script it submits. After such a release: review the change, update hpctrain's
call if needed, then regenerate the goldens with `HPCTRAIN_UPDATE_GOLDEN=1 pytest tests/launch`.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest
import submitit
from submitit.slurm.slurm import _make_sbatch_string

from hpctrain.checks.runner import check_config
from hpctrain.launch.executor import build_executor, sbatch_preview

GOLDEN = Path(__file__).parent / "golden" / "submitit_full.sbatch"
WHAT_TO_DO = (
    f"submitit {submitit.__version__} changed its private _make_sbatch_string, which hpctrain's sbatch "
    "preview calls (hpctrain/scheduler/slurm.py, SlurmScheduler.script); review the change there"
)

# (name, default) of every parameter, in order, as of submitit 1.5.4; "" marks a required one.
SIGNATURE = (
    ("command", ""),
    ("folder", ""),
    ("job_name", "submitit"),
    ("partition", None),
    ("time", 5),
    ("nodes", 1),
    ("ntasks_per_node", None),
    ("cpus_per_task", None),
    ("cpus_per_gpu", None),
    ("num_gpus", None),
    ("gpus_per_node", None),
    ("gpus_per_task", None),
    ("qos", None),
    ("setup", None),
    ("teardown", None),
    ("mem", None),
    ("mem_per_gpu", None),
    ("mem_per_cpu", None),
    ("signal_delay_s", 90),
    ("comment", None),
    ("constraint", None),
    ("exclude", None),
    ("account", None),
    ("gres", None),
    ("mail_type", None),
    ("mail_user", None),
    ("nodelist", None),
    ("dependency", None),
    ("exclusive", None),
    ("array_parallelism", 256),
    ("wckey", "submitit"),
    ("stderr_to_stdout", False),
    ("map_count", None),
    ("additional_parameters", None),
    ("srun_args", None),
    ("use_srun", True),
)

# Every parameter by name, none at its default but num_gpus (deprecated: it overwrites gpus_per_node).
FULL = dict(
    command="python -u -m submitit.core._submit /runs/full/RUNID/submitit",
    folder="/runs/full/RUNID/submitit",
    job_name="hpctrain-full-RUNID",
    partition="gpu",
    time=90,
    nodes=2,
    ntasks_per_node=8,
    cpus_per_task=12,
    cpus_per_gpu=12,
    num_gpus=None,
    gpus_per_node=8,
    gpus_per_task=1,
    qos="high",
    setup=["module load cuda"],
    teardown=["echo done $?"],
    mem="480GB",
    mem_per_gpu="60GB",
    mem_per_cpu="5GB",
    signal_delay_s=120,
    comment="hpctrain",
    constraint="a100",
    exclude="node07",
    account="llm",
    gres="gpu:8",
    mail_type="FAIL",
    mail_user="me@example.org",
    nodelist="node[01-02]",
    dependency="afterok:1",
    exclusive=True,
    array_parallelism=4,
    wckey="hpctrain",
    stderr_to_stdout=True,
    map_count=3,
    additional_parameters={"requeue": True},
    srun_args=["--cpu-bind=none"],
    use_srun=True,
)


def test_the_signature_is_the_one_hpctrain_was_written_against() -> None:
    params = inspect.signature(_make_sbatch_string).parameters.values()
    found = tuple((p.name, "" if p.default is inspect.Parameter.empty else p.default) for p in params)
    assert found == SIGNATURE, f"{WHAT_TO_DO}: signature now {found}"
    assert [p.name for p in params] == list(FULL), WHAT_TO_DO


def test_the_full_parameter_set_renders_as_pinned() -> None:
    text = _make_sbatch_string(**FULL)
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"{WHAT_TO_DO}: its output changed (golden {GOLDEN.name})"


@pytest.mark.usefixtures("fake_sbatch")
def test_the_preview_is_the_script_slurm_executor_submits(compose_cfg, tmp_path: Path) -> None:
    """Through submitit's public path (submit, with an sbatch that only answers a job id; submitit's executor
    also insists on finding an srun, which nothing here runs: a fresh machine has no Slurm yet)."""
    cfg = compose_cfg(
        "+experiment=gpt3_1.3b_1node",
        "cluster.partition=gpu",
        "cluster.account=llm",
        "cluster.setup=[module load cuda/12.4]",
        "+cluster.sbatch_extra.mail-type=FAIL",
        "dry_run=true",
    )
    layout = check_config(cfg).layout
    folder = tmp_path / "run" / "submitit"
    job = build_executor(cfg, layout, "RUNID", folder).submit(print, "never runs")
    assert job.job_id == "4242"
    submitted = (folder / "4242_submission.sh").read_text()
    assert sbatch_preview(cfg, layout, "RUNID", folder) == submitted, WHAT_TO_DO
    assert f"{sys.executable} -m hpctrain.launch.supervise {folder.parent} $SLURM_JOB_ID $?" in submitted
