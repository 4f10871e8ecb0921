"""A real resume through `python -m hpctrain` (issue 29): it trains on with the run's own config, only the keys the
command line may change changed, and a refused change leaves the run exactly as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpctrain.train.lr_schedule import lr_at
from tests.conftest import run_hpctrain


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resume_trains_on_with_the_runs_own_hyperparameters(tmp_path: Path) -> None:
    """A run with optim.lr=7e-4, resumed with only run.resume=DIR train.max_steps=6, trains on at the run's lr
    (not the default 2e-3); config.yaml gets the new length and keeps the older one beside it. A second resume
    that changes nothing leaves config.yaml alone; one that changes the model is refused with nothing written."""
    first = run_hpctrain(
        f"run.root={tmp_path}",
        "run.id=lr",
        "optim.lr=7e-4",
        "optim.warmup_steps=2",
        "train.max_steps=4",
        "train.log_every=1",
        "checkpoint.tiers.0.interval_steps=2",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    run_dir = tmp_path / "smoke" / "lr"
    second = run_hpctrain(f"run.resume={run_dir}", "train.max_steps=6", cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resuming at step 4" in second.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optim"]["lr"] == 7e-4 and config["train"]["max_steps"] == 6
    assert config["train"]["log_every"] == 1 and config["optim"]["warmup_steps"] == 2  # the run's, not defaults
    archived = list(run_dir.glob("config.*.yaml"))
    assert len(archived) == 1 and yaml.safe_load(archived[0].read_text())["train"]["max_steps"] == 4
    optim = type("Optim", (), {k: config["optim"][k] for k in ("lr", "warmup_steps", "decay", "min_lr_ratio")})
    metrics = {m["step"]: m["lr"] for m in _metrics(run_dir)}
    assert sorted(metrics) == list(range(1, 7))
    for step in (5, 6):  # the schedule of lr 7e-4 over 6 steps
        assert metrics[step] == pytest.approx(lr_at(step - 1, optim, 6), rel=1e-6), (step, metrics)

    unchanged = _files(run_dir)["config.yaml"]
    third = run_hpctrain(f"run.resume={run_dir}", "dry_run=true", cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    before = _files(run_dir)
    assert before["config.yaml"] == unchanged and len(list(run_dir.glob("config.*.yaml"))) == 1
    refused = run_hpctrain(f"run.resume={run_dir}", "model.n_layers=2", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "model.n_layers: the run lr has 4 (its config.yaml), this command gives 2" in refused.stderr
    assert _files(run_dir) == before
    assert not (run_dir / "FAILED.json").exists() and (run_dir / "COMPLETED.json").exists()
    assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 2  # the refused resume submitted nothing
