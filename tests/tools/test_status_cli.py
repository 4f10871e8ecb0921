"""`python -m hpctrain.status` as a user runs it, on a run directory of hand-written records: the page, the
JSON, --watch on a finished run, a run id under --root, and an id that is not there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.conftest import run_hpctrain
from tests.goodput.test_ledger import attempt, rows


def write_run(root: Path, compose_cfg: Callable[..., Any]) -> Path:
    """A finished local run: one job, a restart inside it from step 5 (RAM tier), 20 steps."""
    run_dir = root / "smoke" / "r1"
    run_dir.mkdir(parents=True)
    OmegaConf.save(compose_cfg("train.max_steps=20"), run_dir / "config.yaml")
    (run_dir / "jobs.jsonl").write_text(
        json.dumps({"job_id": "999999", "executor": "local", "submitted": 1000.0}) + "\n"
    )
    events = [
        attempt("999999", 0, 0, 1002, 1008, 1009.5),
        {"event": "resume", "time": 1024.5, "tier": "ram", "step": 5},
        attempt("999999", 1, 5, 1021, 1025, 1026.1),
        {"event": "attempt_end", "time": 1043, "how": "completed", "save_s": 2.0, "step": 20},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = rows(1, 10, 1008, commits={6: ("ram", 5)}) + rows(6, 20, 1025)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "COMPLETED.json").write_text(json.dumps({"job_id": "999999", "step": 20, "time": 1043}))
    return run_dir


def test_the_page_the_json_and_watch_on_a_finished_run(tmp_path: Path, compose_cfg: Callable[..., Any]) -> None:
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0, page.stderr
    for line in (
        "step 20/20 (100.0%), 5 redone",
        "newest checkpoints: ram step 5",
        "finished the run",
        "restart in the allocation",
        "-> 999999.1 resumed at step 5 from the ram tier",
        "queue wait     unknown (no batch-system accounting: a local run)",
        "the run is complete: job 999999 trained it to step 20",
    ):
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


def commit(run_dir: Path, step: int, tier_dir: str = "checkpoints") -> None:
    """A committed checkpoint as hpctrain.checkpoint.storage leaves it: `step_<N>/` with its manifest (the
    status page reads the manifest's step, not the shards)."""
    directory = run_dir / tier_dir / f"step_{step:08d}"
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps({"step": step, "run_id": run_dir.name, "tier": "shared"}))


def test_the_newest_checkpoint_is_the_newest_committed_not_the_last_one_a_row_reported(
    tmp_path: Path, compose_cfg: Callable[..., Any]
) -> None:
    """Issue 29: the page named step 200 when 400 was committed: the metrics rows report a save's commit at a
    later step, and the final save (after the last row) is reported by none. The shared tier is read on disk:
    its newest committed step, whatever the order of names, beside a save that never committed."""
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    shared = [c for c in compose_cfg().checkpoint.tiers if c.name == "shared"][0]
    assert shared.path == "checkpoints"  # the default tier: inside the run directory
    for step in (5, 20, 15):
        commit(run_dir, step)
    (run_dir / "checkpoints" / "step_00000030.partial").mkdir()  # a save killed half way: not committed
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[11]["ckpt/shared/step"] = 5  # what a row reported (the RAM tier's row stays as it is)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0, page.stderr
    line = next(x for x in page.stdout.splitlines() if x.startswith("newest checkpoints: "))
    assert line.startswith("newest checkpoints: shared step 20 (") and "ram step 5 (" in line, line
    ledger = json.loads(run_hpctrain(str(run_dir), "--json", module="hpctrain.status", cwd=tmp_path, timeout=60).stdout)
    assert ledger["checkpoints"]["shared"]["step"] == 20 and ledger["checkpoints"]["ram"]["step"] == 5


def test_a_resume_of_the_finished_run_leaves_its_goodput_and_its_finisher(
    tmp_path: Path, compose_cfg: Callable[..., Any]
) -> None:
    """Issue 29: after `run.resume` of a finished run the page showed a lower goodput and credited the resume
    (which loaded step 20 and trained nothing) with the run's end. The records as a real resume leaves them:
    a second job, its "resume" and "attempt_end" events (no "attempt": no step), COMPLETED.json rewritten."""
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    before = json.loads(run_hpctrain(str(run_dir), "--json", module="hpctrain.status", cwd=tmp_path, timeout=60).stdout)
    with open(run_dir / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": "999998", "executor": "local", "submitted": 1100.0, "resumed": True}) + "\n")
    with open(run_dir / "events.jsonl", "a") as f:
        for e in (
            {"event": "resume", "time": 1112.0, "tier": "shared", "step": 20, "load_s": 0.4},
            {"event": "attempt_end", "time": 1112.1, "how": "completed", "save_s": 0.003, "step": 20},
            {"event": "ledger", "time": 1112.2, "step": 0},
        ):
            f.write(json.dumps(e) + "\n")
    (run_dir / "COMPLETED.json").write_text(json.dumps({"job_id": "999998", "step": 20, "time": 1112.1}))
    after = json.loads(run_hpctrain(str(run_dir), "--json", module="hpctrain.status", cwd=tmp_path, timeout=60).stdout)
    assert after["goodput"] == before["goodput"] and after["allocated_node_s"] == before["allocated_node_s"]
    assert after["jobs"][0]["end"] == 1043 and after["jobs"][0]["ended"] == "finished the run"
    assert not after["jobs"][1]["counted"] and after["after_end_node_s"] == pytest.approx(12.2)
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60).stdout
    assert "the run is complete: job 999999 trained it to step 20 (999998 resumed it after its end" in page, page
    assert "nothing to train: the run was complete" in page and f"goodput        {before['goodput']:.1%}" in page


def test_help_says_all_it_starts_to_say(tmp_path: Path) -> None:
    """Issue 29: `--help` was the docstring's first line, cut mid-sentence ("... ETA, and")."""
    shown = run_hpctrain("--help", module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert (
        "ETA, and its goodput ledger (where every node-hour of its allocations went, across requeues and "
        "resubmissions)." in text
    ), shown.stdout
    assert "RUN is a run directory, or a run id under `--root`" in text


# Issue 46: damaged records. Each case damages one file of a finished run; the page still comes, says how many
# lines of which file it could not read, and no traceback reaches the console.
GARBAGE = {
    "binary junk": b"\x00\x01\xff\xfe" * 64 + b"\n" + bytes(range(256)) + b"\n",
    "invalid UTF-8": b'{"event": "stop", "time": 1, "reason": "\xff\xfe"}\n',
    "not an object": b'[1, 2, 3]\n42\n"text"\nnull\n',
    "object of wrong types": b'{"event": "attempt", "time": "soon"}\n{"step": "x", "time": 1, "step_time_s": 1}\n',
}


@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl", "jobs.jsonl"])
@pytest.mark.parametrize("kind", list(GARBAGE))
def test_junk_lines_are_skipped_and_counted(
    tmp_path: Path, compose_cfg: Callable[..., Any], name: str, kind: str
) -> None:
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    good = (run_dir / name).read_bytes()
    (run_dir / name).write_bytes(good + GARBAGE[kind])
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0 and "Traceback" not in page.stdout + page.stderr, page.stdout + page.stderr
    assert "step 20/20 (100.0%)" in page.stdout and "records not read" in page.stdout, page.stdout
    lines = [x for x in GARBAGE[kind].split(b"\n") if x.strip()]
    counted = f"{name}: {len(lines)} unreadable line{'s' if len(lines) > 1 else ''} skipped"
    assert counted in page.stdout, page.stdout


def test_a_cut_last_line_and_an_interleaved_bad_line(tmp_path: Path, compose_cfg: Callable[..., Any]) -> None:
    """A node that died mid-write: the events' last line is cut; a bad line between good ones costs only itself."""
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    lines = (run_dir / "events.jsonl").read_text().splitlines(keepends=True)
    damaged = lines[:1] + ['{"event": "resu\x00\n'] + lines[1:] + ['{"event": "stop", "time": 10']
    (run_dir / "events.jsonl").write_text("".join(damaged))
    (run_dir / "COMPLETED.json").write_bytes(b"\xff\xfe garbage")
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0 and "Traceback" not in page.stdout + page.stderr, page.stdout + page.stderr
    assert "-> 999999.1 resumed at step 5 from the ram tier" in page.stdout  # every good event was read
    assert "events.jsonl: 1 unreadable line skipped" in page.stdout
    assert "its last line is incomplete" in page.stdout
    assert "COMPLETED.json: not read (the file is not UTF-8 text" in page.stdout, page.stdout
    ledger = json.loads(run_hpctrain(str(run_dir), "--json", module="hpctrain.status", cwd=tmp_path, timeout=60).stdout)
    assert any(n.startswith("events.jsonl: 1 unreadable line") for n in ledger["unread"]), ledger["unread"]


def test_a_huge_record_file_is_read_by_its_tail(
    tmp_path: Path, compose_cfg: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (the limits made small): a metrics file past its limit is read from its tail, a line longer
    than any record is skipped without being held, and the page says so."""
    from hpctrain.status import records
    from hpctrain.status.__main__ import main

    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(records, "LINE_BYTES", 4096)
    monkeypatch.setattr(records, "CHUNK", 1024)
    monkeypatch.setattr(records, "TAIL_BYTES", {**records.TAIL_BYTES, "metrics.jsonl": len(metrics) + 50_000})
    (run_dir / "metrics.jsonl").write_bytes(b"x" * 200_000 + b"\n" + b"7" * 30_000 + b"\n" + metrics)
    page = _in_process(main, [str(run_dir)])
    assert "step 20/20 (100.0%)" in page, page
    size, read = records._size(len(metrics) + 230_002), records._size(len(metrics) + 50_000)
    assert f"metrics.jsonl: {size}: only its last {read} read; 1 unreadable line skipped" in page, page


def test_a_config_that_is_not_one(tmp_path: Path, compose_cfg: Callable[..., Any]) -> None:
    run_dir = write_run(tmp_path / "outputs", compose_cfg)
    (run_dir / "config.yaml").write_bytes(b"\x00\x00binary")
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0 and "Traceback" not in page.stdout + page.stderr, page.stdout + page.stderr
    assert "config.yaml: not read (the file is not a text file" in page.stdout, page.stdout
    (run_dir / "config.yaml").write_text("- a\n- list\n")
    page = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=tmp_path, timeout=60)
    assert page.returncode == 0 and "Traceback" not in page.stdout + page.stderr, page.stdout + page.stderr
    assert "config.yaml: not read (not a run config" in page.stdout, page.stdout


def _in_process(main: Callable[[list[str]], int], argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()
