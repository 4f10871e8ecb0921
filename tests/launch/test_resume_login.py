"""`run.resume=ID` on the login node: the run's own saved config, only resumable keys changed, the others refused
before anything is written (issue 29). The saved run is made by the launcher's own functions; every resume
goes through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpctrain.launch.rundir import create_run_dir, resolve_run_dir
from tests.conftest import run_hpctrain


def saved_run(compose_cfg, root: Path, run_id: str, *overrides: str) -> Path:
    """A run directory as a first submission leaves it (config.yaml, submitit/), made by the launcher's functions."""
    cfg = compose_cfg(f"run.root={root}", f"run.id={run_id}", *overrides)
    run = resolve_run_dir(cfg.run)
    create_run_dir(cfg, run)
    return run.path


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def plan_of(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_resume_alone_plans_the_runs_saved_config(compose_cfg, tmp_path: Path) -> None:
    """Resuming the +experiment=stdlib_bpe run with no overrides plans that run (vocabulary 4096), not the
    default smoke config (256)."""
    run_dir = saved_run(compose_cfg, tmp_path, "bpe", "+experiment=stdlib_bpe", "optim.lr=7e-4")
    before = files_of(run_dir)
    plan = plan_of(
        run_hpctrain(f"run.root={tmp_path}", "run.resume=bpe", "dry_run=true", "plan.format=json", cwd=tmp_path)
    )
    assert plan["model"]["vocab_size"] == 4096 and plan["run"]["name"] == "stdlib_bpe"
    assert plan["run"]["directory"] == str(run_dir) and plan["run"]["resumed"]
    assert files_of(run_dir) == before  # a dry run writes nothing


def test_a_resume_by_path_keeps_the_runs_values_and_takes_the_allowed_ones(compose_cfg, tmp_path: Path) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "r1", "optim.lr=7e-4", "train.global_batch=32")
    plan = plan_of(
        run_hpctrain(
            f"run.resume={run_dir}",
            "train.max_steps=14",
            "parallel.dp=1",
            "cluster.gpus_per_node=1",
            "train.micro_batch=8",
            "dry_run=true",
            "plan.format=json",
            cwd=tmp_path,
        )
    )
    assert plan["world_size"] == 1 and plan["layout"]["dp"] == 1  # the layout may change: DCP reshards
    assert plan["layout"]["global_batch"] == 32  # the run's own batch (8 x 4 x 1), not the default 16


@pytest.mark.parametrize(
    "overrides, key, saved, new",
    [
        (["model.n_layers=2"], "model.n_layers", "4", "2"),
        (["optim.lr=0.001"], "optim.lr", "0.0007", "0.001"),
        (["train.global_batch=32"], "train.global_batch", "16", "32"),
        (["model=gpt3_125m"], "model.n_layers", "4", "12"),
        (["checkpoint.tiers.0.path=elsewhere"], "checkpoint.tiers.shared.path", "'checkpoints'", "'elsewhere'"),
    ],
)
def test_a_change_a_resume_may_not_make_is_refused_before_anything_is_written(
    compose_cfg, tmp_path: Path, overrides: list[str], key: str, saved: str, new: str
) -> None:
    run_dir = saved_run(compose_cfg, tmp_path, "r1", "optim.lr=7e-4")
    before = files_of(run_dir)
    proc = run_hpctrain(f"run.root={tmp_path}", "run.resume=r1", *overrides, "train.max_steps=2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith(f"  - {key}:"))
    assert f"has {saved} (its config.yaml)" in line and f"this command gives {new}" in line, line
    fix = proc.stderr.split(line, 1)[1].lstrip("\n").splitlines()[0]
    assert "fix:" in fix and ("new run" in fix or "keep" in fix), fix
    assert files_of(run_dir) == before  # config.yaml untouched, no plan, no job
    assert "run directory:" not in proc.stdout


def test_force_resume_lets_a_hyperparameter_change_but_never_the_models_shape(compose_cfg, tmp_path: Path) -> None:
    saved_run(compose_cfg, tmp_path, "r1", "optim.lr=7e-4")
    common = [f"run.root={tmp_path}", "run.resume=r1", "checkpoint.force_resume=true", "dry_run=true"]
    assert run_hpctrain(*common, "optim.lr=1e-3", cwd=tmp_path).returncode == 0
    refused = run_hpctrain(*common, "model.d_model=256", cwd=tmp_path)
    assert refused.returncode == 2 and "model.d_model: the run r1 has 128" in refused.stderr, refused.stderr[-2000:]


def test_a_new_tier_may_be_added_on_a_resume(compose_cfg, tmp_path: Path) -> None:
    saved_run(compose_cfg, tmp_path, "r1")
    tiers = (
        "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 50, keep_last: 3}, "
        "{name: ram, path: ram, interval_steps: 5}]"
    )
    proc = run_hpctrain(f"run.root={tmp_path}", "run.resume=r1", tiers, "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_resumable_keys() -> None:
    from hpctrain.launch.resume import MODEL_SHAPE, RESUMABLE, allowed

    for key in (
        "train.max_steps",
        "cluster.nodes",
        "cluster.env.NCCL_DEBUG",
        "parallel.tp",
        "zero.stage",
        "launcher.max_restarts",
        "health.hang_timeout_s",
        "tracking.mode",
        "run.resume",
        "dry_run",
        "plan.format",
        "checkpoint.tiers.shared.interval_steps",
        "checkpoint.force_resume",
    ):
        assert allowed(key, force=False), key
    for key in (
        "optim.lr",
        "train.global_batch",
        "train.seq_len",
        "train.seed",
        "data.blend",
        "precision.dtype",
        "model.dropout",
        "checkpoint.tiers.shared.path",
        "checkpoint.enabled",
        *MODEL_SHAPE,
    ):
        assert not allowed(key, force=False), key
    assert allowed("optim.lr", force=True) and allowed("data.blend", force=True)
    assert not any(allowed(k, force=True) for k in (*MODEL_SHAPE, "run.name", "run.id"))
    assert all(RESUMABLE.values())  # each entry says why


def test_a_resume_that_changes_nothing_leaves_config_yaml_as_it_is(compose_cfg, tmp_path: Path) -> None:
    """No archived copy for a resume that changed nothing; config.<time>.yaml only when it changed something
    (tested through create_run_dir: a real resume is tests/e2e/test_resume_config.py)."""
    from dataclasses import replace

    run_dir = saved_run(compose_cfg, tmp_path, "r1")
    cfg = compose_cfg(f"run.root={tmp_path}", "run.resume=r1")
    run = replace(resolve_run_dir(cfg.run), config_changed=False)
    before = (run_dir / "config.yaml").read_bytes()
    create_run_dir(cfg, run)
    assert (run_dir / "config.yaml").read_bytes() == before and not list(run_dir.glob("config.*.yaml"))
    cfg.train.max_steps = 20
    create_run_dir(cfg, replace(run, config_changed=True))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"] == 20
    assert len(list(run_dir.glob("config.*.yaml"))) == 1
