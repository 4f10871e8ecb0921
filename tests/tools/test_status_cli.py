"""`python -m hpctrain.status` as a user runs it, on a run directory of hand-written records: the page, the
JSON, --watch on a finished run, a run id under --root, and an id that is not there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from tests.conftest import run_hpctrain
from tests.goodput.test_ledger import attempt, rows


def write_run(root: Path, compose_cfg: Callable[..., Any]) -> Path:
    """A finished local run: one job, a restart inside it from step 5 (RAM tier), 20 steps."""
    run_dir = root / "smoke" / "r1"
    run_dir.mkdir(parents=True)
    OmegaConf.save(compose_cfg("train.max_steps=20"), run_dir / "config.yaml")
    (run_dir / "jobs.jsonl").write_text(json.dumps({"job_id": "999999", "executor": "local", "submitted": 1000.0})
                                        + "\n")
    events = [attempt("999999", 0, 0, 1002, 1008, 1009.5),
              {"event": "resume", "time": 1024.5, "tier": "ram", "step": 5},
              attempt("999999", 1, 5, 1021, 1025, 1026.1),
              {"event": "attempt_end", "time": 1043, "how": "completed", "save_s": 2.0, "step": 20}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = rows(1, 10, 1008, commits={6: ("ram", 5)}) + rows(6, 20, 1025)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "COMPLETED.json").write_text(json.dumps({"job_id": "999999", "step": 20, "time": 1043}))
    return run_dir


def test_the_page_the_json_and_watch_on_a_finished_run(tmp_path: Path, compose_cfg: Callable[..., Any]) -> None:
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0, page.stderr
    for line in ("step 20/20 (100.0%), 5 redone", "newest checkpoints: ram step 5", "finished the run",
                 "restart in the allocation", "-> 999999.1 resumed at step 5 from the ram tier",
                 "queue wait     unknown (no batch-system accounting: a local run)",
                 "the run is complete: job 999999 trained it to step 20"):
        assert line in page.stdout, page.stdout
    by_id = run_hpctrain("r1", "--json", module="hpctrain.status", cwd=tmp_path, timeout=60)  # under ./outputs
    ledger = json.loads(by_id.stdout)
    assert ledger["run"]["id"] == "r1" and ledger["steps_done"] == 20 and ledger["incidents"][0]["lost_steps"] == 5
    assert ledger["jobs"][0]["end"] == 1043 and abs(ledger["unattributed_node_s"]) < 1e-9
    watched = run_hpctrain(str(run_dir), "--watch", "0.1", module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert watched.returncode == 0 and watched.stdout.count("where the allocated time went") == 1


def test_a_run_that_is_not_there(tmp_path: Path) -> None:
    missing = run_hpctrain("nope", "--root", str(tmp_path), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr and "--root" in missing.stderr
