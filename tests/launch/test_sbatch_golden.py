"""Golden files pin the sbatch scripts submitit writes for representative clusters.

Regenerate after an intended change with `HPCTRAIN_UPDATE_GOLDEN=1 pytest tests/launch` and review the diff.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hpctrain.checks.runner import check_config
from hpctrain.launch.executor import sbatch_preview

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "175b": ["+experiment=175b"],
    "gpt3_13b_16node": ["+experiment=gpt3_13b_16node"],
    "slurm_site": [
        "+experiment=gpt3_1.3b_1node",
        "cluster.partition=gpu",
        "cluster.account=llm",
        "cluster.qos=high",
        "cluster.constraint=a100",
        "cluster.exclude='node[07-08]'",
        "cluster.mem_gb=480",
        "cluster.setup=[module load cuda/12.4,source /opt/venv/bin/activate]",
        "+cluster.sbatch_extra.mail-type=FAIL",
    ],
    # docs/containers.md's two examples: neither runtime is on the dev cluster, so these files are what is checked
    "pyxis": [
        "+experiment=gpt3_1.3b_1node",
        "cluster.container.runtime=pyxis",
        "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'",
        "cluster.container.mounts=[/shared/datasets:/shared/datasets:ro,/home/me/hpctrain:/opt/hpctrain]",
        "cluster.container.workdir=/opt/hpctrain",
        "cluster.container.env=[HF_TOKEN,WANDB_API_KEY]",
        "cluster.container.args=[--no-container-mount-home]",
    ],
    "apptainer": [
        "+experiment=gpt3_1.3b_1node",
        "cluster.container.runtime=apptainer",
        "cluster.container.image=/shared/images/pytorch-24.05.sif",
        "cluster.container.mounts=[/shared/datasets:/shared/datasets:ro,/home/me/hpctrain:/opt/hpctrain]",
        "cluster.container.workdir=/opt/hpctrain",
        "cluster.container.env=[HF_TOKEN,WANDB_API_KEY]",
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_matches_golden(compose_cfg, name: str) -> None:
    cfg = compose_cfg(*CASES[name], "dry_run=true")
    layout = check_config(cfg).layout
    text = sbatch_preview(cfg, layout, "RUNID", Path("/runs") / name / "RUNID" / "submitit")
    text = text.replace(sys.executable, "PYTHON")
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_golden_175b_has_the_reference_resources() -> None:
    """One task per node, the node's elastic agent, with the node's 8 GPUs and its CPUs (8 ranks x 12)."""
    text = (GOLDEN / "175b.sbatch").read_text()
    for line in (
        "--nodes=512",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--cpus-per-task=96",
        "--signal=USR2@120",
        "--requeue",
        "--exclusive",
    ):
        assert f"#SBATCH {line}\n" in text
    assert "srun --unbuffered" in text and "submitit.core._submit" in text
