"""D2 (issue 48): every new set of workers records under an attempt number of its own. torch's elastic agent does
not count a change of members (a hot spare taking a hung node's place) as a restart, so the new workers come up
with the number of those they replace; the ranks' one agreement at start-up raises it past every attempt of the
job's run on record. Real gloo ranks, the loop's own agreement and host-map writer, then the ledger and the
status page on those records."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpctrain.distributed.environment import DistEnv
from hpctrain.records.failures import read_hosts, record_failure
from hpctrain.records.jobs import append_job, write_completed
from hpctrain.status.records import RunRecords
from hpctrain.status.view import render
from hpctrain.train.loop import _record_hosts, agree_on_restart
from tests.distributed_harness import run_distributed
from tests.goodput.test_ledger import attempt, rows

JOB = "77"


def start_workers(rank: int, world_size: int, run_dir: str, hosts: list[str], restarts: list[int]) -> tuple[int, str]:
    """One start of the workers as the training loop makes it: the agents' restart counts (`restarts`, by rank)
    agreed on, then the attempt's rank -> host map written under the agreed key."""
    env = DistEnv(rank, 0, world_size, 1, rank, world_size, "127.0.0.1", 0, hosts[rank], JOB, restarts[rank])
    env = agree_on_restart(env, Path(run_dir))
    _record_hosts(Path(run_dir), env)
    return env.restart, env.attempt


def test_a_start_whose_number_was_used_takes_the_next_free_one(tmp_path: Path) -> None:
    """Two starts in a row with restart 0 everywhere (a spare replaced a hung node): the second is attempt 1,
    and both host maps stay. Then a start where the spare holds rank 0 at restart 0 and the others' agents
    count 1: above both numbers used, 2. A requeued run of the job numbers its own attempts from 0."""
    here = socket.gethostname()
    first = run_distributed(start_workers, 2, str(tmp_path), [here, "n2"], [0, 0])
    second = run_distributed(start_workers, 2, str(tmp_path), [here, "n3"], [0, 0])
    third = run_distributed(start_workers, 2, str(tmp_path), ["n4", here], [0, 1])
    assert first == [(0, JOB)] * 2 and second == [(1, f"{JOB}.1")] * 2 and third == [(2, f"{JOB}.2")] * 2
    assert read_hosts(tmp_path, JOB) == [here, "n2"] and read_hosts(tmp_path, f"{JOB}.1") == [here, "n3"]
    assert read_hosts(tmp_path, f"{JOB}.2") == ["n4", here]
    alone = DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", 0, here, JOB, restart=0, requeue=1)
    assert agree_on_restart(alone, tmp_path).attempt == f"{JOB}r1"  # a new run of the job: nothing used yet
    (tmp_path / "failures" / f"{JOB}r1").mkdir()
    assert agree_on_restart(alone, tmp_path).attempt == f"{JOB}r1.1"  # one process: the same rule, no collective


def test_the_ledger_and_the_page_blame_the_hung_node_not_the_spare_that_replaced_it(
    tmp_path: Path, compose_cfg: Callable[..., Any]
) -> None:
    """Rank 1's node n2 hangs at step 13 (its processes stopped: no record); rank 0, waiting on it, writes a
    peer record; the spare n3 takes rank 1's slot and the workers restart with restart 0 (a change of members).
    Both attempts' records as the loop writes them: the interruption names n2, and the run went on without it.
    Before the fix the second attempt's host map replaced the first's and the page blamed n3, the spare."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(compose_cfg("train.max_steps=20"), run_dir / "config.yaml")
    here = socket.gethostname()
    assert run_distributed(start_workers, 2, str(run_dir), [here, "n2"], [0, 0])[0] == (0, JOB)
    record_failure(run_dir, JOB, 0, 13, TimeoutError("Timed out waiting for rank 1 in an all-reduce"), peer=True)
    assert run_distributed(start_workers, 2, str(run_dir), [here, "n3"], [0, 0])[0] == (1, f"{JOB}.1")
    started = json.loads((run_dir / "failures" / JOB / "rank0.json").read_text())["time"]
    append_job(run_dir, JOB, "local", submitted=started - 25)  # the timeline around the record's time
    events = [
        attempt(JOB, 0, 0, started - 20, started - 17, started - 16),
        {"event": "resume", "time": started + 9, "tier": "ram", "step": 10},
        attempt(JOB, 1, 10, started + 5, started + 10, started + 11),
        {"event": "attempt_end", "time": started + 21, "how": "completed", "save_s": 0.5, "step": 20},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    metrics = rows(1, 12, started - 17, step_s=1.0) + rows(11, 20, started + 10, step_s=1.0)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    write_completed(run_dir, JOB, 20)
    records = RunRecords(run_dir)
    settings = records.settings()
    ledger = records.measure(settings, now=started + 100)
    (incident,) = ledger.incidents
    assert (incident.attempt, incident.next_job, incident.kind) == (JOB, f"{JOB}.1", "restart in the allocation")
    assert incident.cause.startswith("n2 (rank 1) stopped without a failure record"), incident.cause
    assert incident.cause.endswith("went on without n2"), incident.cause
    page = render(ledger, {"id": run_dir.name, "path": str(run_dir), "executor": settings["executor"]})
    assert "n2 (rank 1) stopped without a failure record" in page and "n3" not in page, page
