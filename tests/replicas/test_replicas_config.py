"""recovery=replicas|diloco on the login node: the group's layout, the plan's lines, and the checks that refuse what
replica groups cannot run (each naming the key and the fix, nothing submitted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpctrain.checks.runner import run_checks
from hpctrain.config.layout import resolve_layout
from hpctrain.config.problems import ConfigError
from tests.conftest import run_hpctrain

README_COMMAND = "python -m hpctrain +experiment=175b recovery=replicas recovery.groups=4 cluster.spare_nodes=2"


def test_the_readme_command_plans_four_groups_of_the_175b_layout(tmp_path: Path) -> None:
    args = README_COMMAND.split()[3:]
    proc = run_hpctrain(*args, "dry_run=true", f"run.root={tmp_path}", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 replica groups x 128 nodes x 8 GPUs = 4096" in proc.stdout
    assert "global 3072 = 4 replica groups x micro-batch 4 x grad accum 12 x DP 16" in proc.stdout
    assert "#SBATCH --nodes=514" in proc.stdout  # every group's nodes and the 2 spares, one job
    assert "recovery=replicas" in proc.stdout and "expected" in proc.stdout


def test_a_group_is_the_layout_on_its_share_of_nodes_batch_and_dp(compose_cfg: Any) -> None:
    cfg = compose_cfg("+experiment=175b", "recovery=replicas", "recovery.groups=4")
    lay = resolve_layout(cfg)
    assert (lay.replicas, lay.nodes, lay.dp, lay.global_batch) == (4, 128, 16, 768)
    assert (lay.job_nodes, lay.job_global_batch) == (512, 3072)
    plain = resolve_layout(compose_cfg("+experiment=175b"))
    assert (plain.replicas, plain.nodes, plain.dp) == (1, 512, 64)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.nodes=3"], "cluster.nodes"),
        (["train.global_batch=15"], "train.global_batch"),
    ],
)
def test_what_the_groups_cannot_divide_is_refused_by_its_key(compose_cfg: Any, overrides: list[str], key: str) -> None:
    cfg = compose_cfg("+experiment=smoke", "cluster=dev", "recovery=replicas", "parallel.dp=-1", *overrides)
    with pytest.raises(ConfigError) as err:
        resolve_layout(cfg)
    assert key in [p.key for p in err.value.problems]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["launcher.in_allocation=false"], "launcher.in_allocation"),
        (["elastic.min_nodes=1"], "elastic.min_nodes"),
        (["recovery.min_replicas=3"], "recovery.min_replicas"),
        (["recovery.mode=sometimes"], "recovery.mode"),
        (["recovery.groups=1"], "recovery.groups"),
    ],
)
def test_the_checks_refuse_what_replica_groups_cannot_run(
    compose_cfg: Any, tmp_path: Path, overrides: list[str], key: str
) -> None:
    cfg = compose_cfg("+experiment=smoke", "cluster=dev", "recovery=replicas", f"run.root={tmp_path}", *overrides)
    report = run_checks(cfg)
    assert key in [e.key for e in report.errors], report.errors
