"""The supervisor's decisions on real failure records: resubmit excluding the failed host, or stop."""

from __future__ import annotations

import json
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
