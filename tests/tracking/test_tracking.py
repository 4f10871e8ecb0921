"""Tracking: offline W&B holds what the JSONL holds, under the run id; no credential lands in the run
directory; a local Hydra sweep gives one run (and one W&B run) per point in one W&B group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.tracking.wandb_file import run_info
from tests.conftest import run_hpctrain

FAKE_KEY = "local-0123456789abcdef0123456789abcdef01234567"
SHORT = ["train.max_steps=8", "optim.warmup_steps=2", "tracking=wandb", "tracking.mode=offline"]


def wandb_runs(run_dir: Path) -> list[dict]:
    return [run_info(p) for p in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offline_wandb_matches_the_jsonl_and_holds_no_api_key(tmp_path: Path) -> None:
    proc = run_hpctrain(*SHORT, f"run.root={tmp_path}", "run.id=tracked", cwd=tmp_path, env={"WANDB_API_KEY": FAKE_KEY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "smoke" / "tracked"
    runs = wandb_runs(run_dir)
    assert len(runs) == 1 and runs[0]["run_id"] == "tracked"
    jsonl = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    history = {h["_step"]: h for h in runs[0]["history"] if "loss" in h}
    assert sorted(history) == sorted(jsonl) == list(range(1, 9))
    for step, row in jsonl.items():
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"):
            assert history[step][key] == pytest.approx(row[key], rel=1e-12), (step, key)
    leaked = [str(p) for p in run_dir.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert proc.stdout.count(FAKE_KEY) == 0 and proc.stderr.count(FAKE_KEY) == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_local_sweep_gives_one_run_per_point_in_one_group(tmp_path: Path) -> None:
    proc = run_hpctrain("-m", *SHORT, "optim.lr=1e-3,2e-3", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep: 2 points" in proc.stdout
    run_dirs = sorted((tmp_path / "smoke").iterdir())
    assert len(run_dirs) == 2
    infos = [wandb_runs(d)[0] for d in run_dirs]
    assert len({i["run_id"] for i in infos}) == 2
    assert len({i["group"] for i in infos}) == 1 and infos[0]["group"].startswith("sweep-")
    assert {t for i in infos for t in i["tags"]} == {"optim.lr=0.001", "optim.lr=0.002"}  # the swept values only
    table = json.loads(next((tmp_path / "sweeps").glob("*/sweep.json")).read_text())
    assert sorted(r["run_dir"] for r in table) == [str(d) for d in run_dirs]


def test_a_signal_lead_shorter_than_a_measured_stop_is_reported_once(compose_cfg, tmp_path: Path) -> None:
    """The warning signal must cover the step in flight plus the save a stop makes; the run measures both."""
    import torch

    from hpctrain.parallel.engine import StepStats
    from hpctrain.tracking.tracker import Tracker
    from hpctrain.train.progress import StepReporter

    cfg = compose_cfg("cluster=dev", "cluster.signal_delay_s=30", "tracking.mode=disabled", f"run.root={tmp_path}")
    tracker = Tracker(cfg, tmp_path, "lead", {})
    reporter = StepReporter(cfg, 1024, 4, torch.device("cpu"), 0, stop_tier="shared")
    stats = StepStats(loss=1.0, grad_norm=1.0)
    for step, tier, total in ((1, "ram", 50.0), (2, "shared", 12.0), (3, "shared", 40.0), (4, "shared", 40.0)):
        reporter.step(
            tracker,
            step,
            step * 8,
            stats,
            1e-3,
            2.0,
            [{"event": "save_committed", "tier": tier, "step": step, "bytes": 1, "blocked_s": 0.1, "total_s": total}],
            ({}, []),
        )
    ok = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ok == []  # the stop's tier measured 12 s + a 2 s step: inside 30 s; checked once, at its first save
    reporter = StepReporter(cfg, 1024, 4, torch.device("cpu"), 0, stop_tier="shared")
    for step in (5, 6):
        reporter.step(
            tracker,
            step,
            step * 8,
            stats,
            1e-3,
            2.0,
            [
                {
                    "event": "save_committed",
                    "tier": "shared",
                    "step": step,
                    "bytes": 1,
                    "blocked_s": 0.1,
                    "total_s": 40.0,
                }
            ],
            ({}, []),
        )
    tracker.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["key"] for e in events] == ["cluster.signal_delay_s"] and events[0]["needed_s"] == 42.0
    assert "set cluster.signal_delay_s>=84" in events[0]["message"]


def test_the_ledger_at_an_attempts_start_is_made_off_the_training_thread(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing a long run's rows takes seconds: at an attempt's start rank 0 hands it to a thread (a ledger that
    cannot finish until released is asked for, and the call returns), publishes it at a later step's poll, and
    an attempt's end (made at once) comes after it, in order."""
    import threading

    from hpctrain.tracking import tracker as tracker_module

    release, made = threading.Event(), []

    class Made:
        def __init__(self, n: int) -> None:
            self.n = n

        def line(self) -> str:
            return f"ledger {self.n}"

        def summary(self) -> dict:
            return {"n": self.n}

    def slow_measure(run_dir: Path, accounting_timeout_s: float, cache: object) -> Made:
        if not made:
            release.wait(60)
        made.append(1)
        return Made(len(made))

    monkeypatch.setattr(tracker_module, "measure", slow_measure)
    cfg = compose_cfg("tracking.mode=disabled", f"run.root={tmp_path}")
    tracker = tracker_module.Tracker(cfg, tmp_path, "bg", {})
    tracker.ledger(tmp_path, background=True)  # returns while the ledger waits for `release`
    tracker.poll()
    assert (tmp_path / "events.jsonl").read_text() == ""  # not made yet: nothing published
    release.set()
    tracker.ledger(tmp_path)  # the end's ledger: the start's first
    tracker.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["n"]) for e in events] == [("ledger", 1), ("ledger", 2)]
