"""Every experiment composes against the schema, passes the checks and prints a plan in a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.checks.runner import check_config
from hpctrain.models.params import built_dims, param_count
from tests.conftest import CONF_DIR, REPO, run_hpctrain

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def test_there_are_experiments_and_models() -> None:
    assert {"smoke", "175b"} <= set(EXPERIMENTS)
    assert {
        "tiny",
        "gpt3_125m",
        "gpt3_350m",
        "gpt3_760m",
        "gpt3_1.3b",
        "gpt3_2.7b",
        "gpt3_6.7b",
        "gpt3_13b",
        "gpt3_175b",
    } <= set(MODELS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_passes_checks(compose_cfg, experiment: str) -> None:
    cfg = compose_cfg(f"+experiment={experiment}", "dry_run=true")
    report = check_config(cfg)
    lay = report.layout
    assert lay.dp * lay.tp * lay.pp * lay.cp == lay.world_size == cfg.cluster.nodes * cfg.cluster.gpus_per_node
    assert lay.micro_batch * lay.grad_accum * lay.dp == cfg.train.global_batch


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_dry_run_exits_zero_and_submits_nothing(experiment: str, tmp_path: Path) -> None:
    proc = run_hpctrain(
        f"+experiment={experiment}", "dry_run=true", "plan.format=json", f"run.root={tmp_path}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert (
        plan["layout"]["dp"] * plan["layout"]["tp"] * plan["layout"]["pp"] * plan["layout"]["cp"] == plan["world_size"]
    )
    assert not any(tmp_path.iterdir()), "a dry run must create nothing"


# GPT-3 paper, Table 2.1, recomputed with the standard formula (vocab 50257, context 2048, tied head).
GPT3_PARAMS = {
    "gpt3_125m": 125e6,
    "gpt3_350m": 350e6,
    "gpt3_760m": 760e6,
    "gpt3_1.3b": 1.3e9,
    "gpt3_2.7b": 2.7e9,
    "gpt3_6.7b": 6.7e9,
    "gpt3_13b": 13e9,
    "gpt3_175b": 175e9,
}


@pytest.mark.parametrize("model", sorted(GPT3_PARAMS))
def test_gpt3_parameter_counts_match_the_paper(compose_cfg, model: str) -> None:
    m = compose_cfg(f"model={model}").model
    n = param_count(*built_dims(m))
    # The paper rounds to its headline sizes; the formula lands within 8% of each (125M is 125.2M...).
    assert abs(n - GPT3_PARAMS[model]) / GPT3_PARAMS[model] < 0.08


def test_175b_plan_matches_the_reference_case(tmp_path: Path) -> None:
    proc = run_hpctrain("+experiment=175b", "dry_run=true", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "DP 64 x TP 8 x PP 8" in out
    assert "stage 3" in out
    assert "global 3072 = micro-batch 4 x grad accum 12 x DP 64" in out
    params = int(out.split("parameters")[1].split("(")[0].strip().replace(",", ""))
    assert abs(params - 174.6e9) / 174.6e9 < 0.005
    for line in (
        "#SBATCH --nodes=512",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=USR2@",
        "#SBATCH --requeue",
    ):
        assert line in out
    assert not any(tmp_path.iterdir())


def test_readme_documents_the_public_keys() -> None:
    readme = (REPO / "README.md").read_text()
    for key in (
        "dry_run",
        "cluster.nodes",
        "cluster.gpus_per_node",
        "train.max_steps",
        "train.seed",
        "run.root",
        "run.resume",
        "parallel.dp",
        "parallel.tp",
        "parallel.pp",
        "zero.stage",
        "optim.lr",
        "+experiment=",
    ):
        assert key in readme, key
