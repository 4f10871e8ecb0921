"""What a user sees of a Mixture-of-Experts run: the router's part of the progress line, the `moe/*` metrics in
metrics.jsonl and W&B (the same row), and one warning when an expert stays idle; nothing of it for a dense model."""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpctrain.parallel.moe_stats import IDLE_WARN_STEPS, MoEStepStats
from hpctrain.tracking.tracker import Tracker
from hpctrain.tracking.wandb_file import run_info
from hpctrain.train.progress import StepReporter

ROUTED = MoEStepStats(tokens_per_expert=[[4, 4, 4, 4], [8, 0, 6, 2]], balance_loss=1.02, z_loss=0.5, dropped=3)
BALANCED = MoEStepStats(tokens_per_expert=[[4, 4, 4, 4], [4, 4, 4, 4]], balance_loss=1.0, z_loss=0.5, dropped=0)


def step_stats(moe: MoEStepStats | None) -> Any:
    """The engine's StepStats as the reporter reads it, `moe` included."""
    return SimpleNamespace(loss=2.0, grad_norm=0.5, skipped=False, loss_scale=1.0, control=[], moe=moe)


def report(cfg: Any, tracker: Tracker, steps: list[Any]) -> None:
    reporter = StepReporter(cfg, 1024, 4, torch.device("cpu"), 0)
    for done, stats in enumerate(steps, start=1):
        reporter.step(tracker, done, done * 8, stats, 1e-3, 2.0, [], ({}, []))


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def log_one_routed_step(root: str) -> str:
    """One routed step reported by a run's tracker with offline W&B, in a process of its own as a run's is: W&B's
    in-process state (its service, its settings) outlives a run, and a long pytest process is no run's. Returns
    what the step printed."""
    import contextlib
    import io

    from tests.conftest import _compose

    cfg = _compose("tracking.mode=offline", "model.moe.capacity_factor=1.25", f"run.root={root}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tracker = Tracker(cfg, Path(root), "moe", {})
        report(cfg, tracker, [step_stats(ROUTED)])
        tracker.close()
    return out.getvalue()


def test_the_progress_line_metrics_jsonl_and_wandb_carry_the_routing(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        printed = pool.apply(log_one_routed_step, (str(tmp_path),))
    assert " | moe balance 1.020, imbalance 2.00 (layer 1), dropped 9.38%" in printed
    [row] = rows(tmp_path / "metrics.jsonl")
    expected = {
        "moe/balance_loss": 1.02,
        "moe/z_loss": 0.5,
        "moe/dropped_fraction": 3 / 32,
        "moe/imbalance_max": 2.0,
        "moe/idle_experts": 1,
        "moe/layer0/tokens_min": 4,
        "moe/layer0/tokens_max": 4,
        "moe/layer0/imbalance": 1.0,
        "moe/layer1/tokens_min": 0,
        "moe/layer1/tokens_max": 8,
        "moe/layer1/imbalance": 2.0,
    }
    assert {k: v for k, v in row.items() if k.startswith("moe/")} == expected
    [run] = [run_info(p) for p in tmp_path.glob("wandb/offline-run-*/run-*.wandb")]
    [history] = [h for h in run["history"] if "loss" in h]
    assert {k: history[k] for k in expected} == expected


def test_without_a_capacity_the_line_leaves_dropped_out(
    compose_cfg, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = compose_cfg("tracking.mode=disabled", f"run.root={tmp_path}")
    tracker = Tracker(cfg, tmp_path, "dropless", {})
    report(cfg, tracker, [step_stats(BALANCED)])
    tracker.close()
    line = capsys.readouterr().out
    assert line.endswith(" | moe balance 1.000, imbalance 1.00 (layer 0)\n")


def test_an_idle_expert_is_warned_about_once(compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Expert 1 of layer 1 gets no token for twice the limit: one warning and one event, at the step its idle
    run reaches the limit."""
    cfg = compose_cfg("tracking.mode=disabled", f"run.root={tmp_path}")
    tracker = Tracker(cfg, tmp_path, "idle", {})
    with caplog.at_level(logging.WARNING, logger="hpctrain.train.progress"):
        report(cfg, tracker, [step_stats(ROUTED)] * (2 * IDLE_WARN_STEPS))
    tracker.close()
    events = rows(tmp_path / "events.jsonl")
    assert [(e["event"], e["step"], e["layer"], e["experts"], e["steps"]) for e in events] == [
        ("expert_idle", IDLE_WARN_STEPS, 1, [1], IDLE_WARN_STEPS)
    ]
    warnings = [r.getMessage() for r in caplog.records if "no token" in r.getMessage()]
    assert len(warnings) == 1 and "layer 1: 1" in warnings[0]


def test_a_dense_model_reports_no_routing(compose_cfg, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose_cfg("tracking.mode=disabled", f"run.root={tmp_path}")
    tracker = Tracker(cfg, tmp_path, "dense", {})
    report(cfg, tracker, [step_stats(None)] * (2 * IDLE_WARN_STEPS))
    tracker.close()
    assert (tmp_path / "events.jsonl").read_text() == ""
    assert not any(k.startswith("moe/") for row in rows(tmp_path / "metrics.jsonl") for k in row)
    assert "moe" not in capsys.readouterr().out
