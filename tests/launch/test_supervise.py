"""The supervisor's decisions on real failure records: resubmit excluding the failed host, or stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpctrain.launch.supervise import decide
from hpctrain.records.failures import is_peer_failure, read_failures, record_failure
from hpctrain.records.paths import ATTEMPTS


def fail(run_dir: Path, job: str, rank: int, step: int, exc: BaseException) -> None:
    record_failure(run_dir, job, rank, step, exc)


def test_success_is_done(tmp_path: Path) -> None:
    assert decide(tmp_path, "1", 0, 3) == {"action": "done"}


def test_peer_failures_are_told_apart() -> None:
    assert is_peer_failure(RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:1234"))
    assert not is_peer_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_the_failing_host_is_excluded(tmp_path: Path) -> None:
    fail(tmp_path, "7", 3, 12, RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    fail(tmp_path, "7", 0, 12, RuntimeError("Connection closed by peer"))
    records = read_failures(tmp_path, "7")
    assert len(records) == 2
    d = decide(tmp_path, "7", 1, 3)
    assert d["action"] == "resubmit" and d["signature"]["type"] == "RuntimeError" and d["signature"]["step"] == 12
    assert d["excluded"] == d["blamed"] == [records[0]["host"]]


def test_the_same_error_at_the_same_step_twice_stops(tmp_path: Path) -> None:
    fail(tmp_path, "7", 1, 30, ValueError("bad shape"))
    first = decide(tmp_path, "7", 1, 5)
    (tmp_path / ATTEMPTS).write_text(json.dumps({"job_id": "7", **first}) + "\n")
    fail(tmp_path, "8", 1, 30, ValueError("bad shape"))
    second = decide(tmp_path, "8", 1, 5)
    assert second["action"] == "stop" and "deterministic" in second["why"] and "step 30" in second["why"]


def test_a_different_step_is_retried_but_restarts_are_bounded(tmp_path: Path) -> None:
    lines = []
    for job, step in (("1", 10), ("2", 20), ("3", 30)):
        fail(tmp_path, job, 0, step, OSError("disk full"))
        d = decide(tmp_path, job, 1, 3)
        assert d["action"] == "resubmit"
        lines.append(json.dumps({"job_id": job, **d}))
        (tmp_path / ATTEMPTS).write_text("\n".join(lines) + "\n")
    fail(tmp_path, "4", 0, 40, OSError("disk full"))
    d = decide(tmp_path, "4", 1, 3)
    assert d["action"] == "stop" and "launcher.max_restarts=3" in d["why"]


def test_ranks_that_left_no_record_point_at_their_node(tmp_path: Path) -> None:
    from hpctrain.records.failures import record_hosts

    record_hosts(tmp_path, "9", ["n1", "n1", "n2", "n2"])
    fail(tmp_path, "9", 0, 20, RuntimeError("[gloo] Connection closed by peer"))
    fail(tmp_path, "9", 1, 20, RuntimeError("[gloo] Connection closed by peer"))
    d = decide(tmp_path, "9", 1, 3)
    assert d["action"] == "resubmit" and d["blamed"] == ["n2"]  # ranks 2 and 3 died with their node


def test_a_job_killed_whole_blames_no_node(tmp_path: Path) -> None:
    from hpctrain.records.failures import record_hosts

    record_hosts(tmp_path, "9", ["n1", "n1", "n2", "n2"])
    d = decide(tmp_path, "9", 137, 3)
    assert d["action"] == "resubmit" and d["blamed"] == [] and d["excluded"] == []


def test_a_resubmission_that_can_never_start_is_refused() -> None:
    from hpctrain.launch.supervise import cannot_fit

    nodes = ["n1", "n2", "n3", "n4"]
    assert cannot_fit(nodes, ["n2"], 3, "debug") is None
    why = cannot_fit(nodes, ["n1", "n2"], 3, "debug")
    assert why and "debug has 4 node(s)" in why and "only 2 remain" in why and "needs 3 (cluster.nodes)" in why
    assert cannot_fit(nodes, ["n9"], 4, None) is None  # a node outside the partition takes nothing from it


def test_restarts_inside_the_allocation_keep_their_own_records(tmp_path: Path) -> None:
    """Each restart of the workers in a job writes under `<job>.<n>`; the supervisor decides from the last."""
    from hpctrain.records.failures import attempt_key, last_attempt

    assert [attempt_key("9", n) for n in (0, 1, 12)] == ["9", "9.1", "9.12"]
    assert last_attempt(tmp_path, "9") == "9"
    fail(tmp_path, "9", 0, 5, OSError("disk full"))
    fail(tmp_path, "9.1", 1, 8, OSError("disk full"))
    fail(tmp_path, "9.12", 1, 11, ValueError("bad shape"))
    fail(tmp_path, "99", 1, 3, ValueError("another job"))
    assert last_attempt(tmp_path, "9") == "9.12"
    d = decide(tmp_path, "9", 1, 3)
    assert d["signature"]["step"] == 11 and d["signature"]["type"] == "ValueError"


def test_a_restart_loop_the_workers_stopped_is_not_resubmitted(tmp_path: Path, capsys) -> None:
    """The workers wrote FAILED.json for this job (the same failure twice in the allocation): no resubmission,
    not even a call to the scheduler (the local executor could not resubmit anyway)."""
    from omegaconf import OmegaConf

    from hpctrain.config.schema import Config
    from hpctrain.launch.supervise import main
    from hpctrain.records.jobs import append_job, write_report

    OmegaConf.save(OmegaConf.structured(Config), tmp_path / "config.yaml")
    append_job(tmp_path, "5", "slurm")
    write_report(tmp_path, {"job_id": "5", "action": "stop", "why": "deterministic failure: the same error"})
    assert main([str(tmp_path), "5", "1"]) == 1
    assert "stopped inside the allocation: deterministic failure" in capsys.readouterr().out
    assert not (tmp_path / ATTEMPTS).exists()


def test_records_of_a_requeued_jobs_earlier_run_do_not_count(tmp_path: Path) -> None:
    """A requeued job runs again under its id and numbers its restarts from 0 again: its second run keeps its
    records under `9r1` (`9r1.2` for its second restart), and the records its first run left under `9.1` are
    not the second run's failure, which left none (killed whole)."""
    from hpctrain.records.failures import attempt_key, last_attempt

    assert [attempt_key("9", 0, 1), attempt_key("9", 2, 1), attempt_key("9", 2)] == ["9r1", "9r1.2", "9.2"]
    fail(tmp_path, "9.1", 1, 8, OSError("disk full"))
    started = time.time() + 1
    assert last_attempt(tmp_path, "9") == "9.1" and last_attempt(tmp_path, "9", since=started) == "9"
    assert last_attempt(tmp_path, "9r1") == "9r1"
    for since, requeue in ((started, 0), (0.0, 1)):
        d = decide(tmp_path, "9", 137, 3, since=since, requeue=requeue)
        assert d["action"] == "resubmit" and d["signature"] is None and d["excluded"] == []
    fail(tmp_path, "9r1.1", 3, 40, ValueError("bad batch"))
    assert decide(tmp_path, "9", 1, 3, requeue=1)["signature"]["step"] == 40
