"""One live attempt per run: a newer attempt takes the lease, the older one stops at its next step without
writing, and its supervisor resubmits nothing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hpctrain.launch import supervise
from hpctrain.records.jobs import append_job
from hpctrain.records.lease import Lease, LeaseWatch, current_lease, holds, settle_time, superseded, take_lease
from tests.checkpoint import training
from tests.checkpoint.test_checkpoint import config, steps_in, tiers
from tests.checkpoint.training import metrics, train


def test_tokens_go_up_and_only_the_newest_holds(tmp_path: Path) -> None:
    first = take_lease(tmp_path, "100")
    second = take_lease(tmp_path, "101")
    assert (first.token, second.token) == (1, 2) and current_lease(tmp_path).job_id == "101"
    assert holds(tmp_path, second) and not holds(tmp_path, first)


def test_an_attempt_that_displaced_another_job_waits_for_its_watch_before_writing(tmp_path: Path) -> None:
    """The old attempt's watch reads the token within one interval and it writes nothing after that; the new
    one holds its first write two intervals. A restart of the same job, or the first attempt, writes at once."""
    first = take_lease(tmp_path, "100")
    again = take_lease(tmp_path, "100")  # the same job restarted inside its allocation: its workers ended first
    other = take_lease(tmp_path, "101")  # another job: the first may still be training
    assert (first.previous_job, again.previous_job, other.previous_job) == (None, "100", "100")
    assert [settle_time(lease, 1000.0, 1.5) for lease in (first, again, other)] == [1000.0, 1000.0, 1003.0]


def test_an_attempt_that_lost_the_lease_stops_without_writing(compose_cfg, tmp_path: Path, monkeypatch) -> None:
    """A newer attempt takes the lease while step 4 is being prepared, and rank 0's watch reads it before that
    step's control values are taken: step 4 is not applied, and no metrics, checkpoint or failure record
    follow from the old attempt."""
    interval = 0.05

    def take_and_wait(run_dir: Path, job_id: str) -> Lease:
        lease = take_lease(run_dir, job_id)
        time.sleep(40 * interval)  # the watch thread reads within one interval
        return lease

    monkeypatch.setattr(training, "take_lease", take_and_wait)  # inherited by the forked ranks
    cfg = config(
        compose_cfg,
        tmp_path,
        2,
        "train.max_steps=8",
        f"run.lease_check_s={interval}",
        *tiers(tmp_path, ram=2, local=4, shared=8),
    )
    run_dir = tmp_path / "run"
    results = train(2, cfg, run_dir, lease_taken_at=3)
    assert all("newer attempt" in r["stale"] for r in results)
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]
    # the step-2 save commits only if every rank's write was seen finished before step 4; nothing after it
    assert steps_in(tmp_path / "shm" / "test") in ([], [2]) and steps_in(tmp_path / "ssd" / "test") == []
    assert not list((run_dir / "failures").rglob("rank*.json")), "a stale attempt leaves no failure record"
    assert current_lease(run_dir).job_id == "newer-attempt"


def test_the_supervisor_of_a_superseded_job_resubmits_nothing(compose_cfg, tmp_path: Path, capsys) -> None:
    OmegaConf.save(compose_cfg(), tmp_path / "config.yaml")
    for job in ("7", "8"):  # 8: the supervisor's resubmission of 7, which Slurm then requeued too
        append_job(tmp_path, job, "slurm")
    take_lease(tmp_path, "8")
    assert superseded(tmp_path, "7", ["7", "8"]) and not superseded(tmp_path, "8", ["7", "8"])
    assert supervise.main([str(tmp_path), "7", "1"]) == 1
    assert "a later job holds the run (8): not resubmitting" in capsys.readouterr().out
    assert not (tmp_path / "attempts.jsonl").exists() and len((tmp_path / "jobs.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "lease.json").read_text())["token"] == 1


def test_the_watch_reads_the_lease_off_the_step_at_most_once_per_interval(tmp_path: Path, monkeypatch) -> None:
    """The step only reads the latched flag; the file is read by the watch's thread, at most once per
    `run.lease_check_s`, and a takeover is seen within about one interval."""
    mine = take_lease(tmp_path, "1")
    reads: list[str] = []

    def counting(run_dir: Path) -> Lease | None:
        reads.append(threading.current_thread().name)
        return current_lease(run_dir)

    monkeypatch.setattr("hpctrain.records.lease.current_lease", counting)
    interval = 0.1
    watch = LeaseWatch(tmp_path, mine, interval).start()
    try:
        started = time.monotonic()
        polls = 0
        while time.monotonic() - started < 1.0:  # a fast training loop asking at every step
            assert not watch.lost()
            polls += 1
            time.sleep(0.001)
        elapsed = time.monotonic() - started
        assert polls > 100 and 1 <= len(reads) <= elapsed / interval + 1, (polls, len(reads))
        assert set(reads) == {"hpctrain-lease"}, "the lease is read on the watch's thread only"
        take_lease(tmp_path, "2")
        deadline = time.monotonic() + 30 * interval
        while not watch.lost() and time.monotonic() < deadline:
            time.sleep(interval / 10)
        assert watch.lost()
    finally:
        watch.stop()
    with pytest.raises(ValueError, match="lease_check_s"):
        LeaseWatch(tmp_path, mine, 0.0)
