"""The goodput ledger on hand-built run records whose every second is known: each part, each incident's
breakdown, the queue, and the parts tiling the allocations exactly."""

from __future__ import annotations

from typing import Any

import pytest

from hpctrain.goodput.ledger import MARKS, build_ledger, local_allocations
from hpctrain.scheduler.base import Allocation
from hpctrain.scheduler.slurm import parse_sacct


def attempt(job: str, restart: int, from_step: int, started: float, ready: float, first_step: float) -> dict[str, Any]:
    """An "attempt" event whose start-up marks are spread evenly from `started` to `ready`."""
    between = MARKS[1:-2]
    marks = {m: started + (ready - started) * (i + 1) / (len(between) + 1) for i, m in enumerate(between)}
    return {
        "event": "attempt",
        "time": first_step,
        "job_id": job,
        "restart": restart,
        "from_step": from_step,
        "process_started": started,
        **marks,
        "ready": ready,
        "first_step": first_step,
        "step": from_step + 1,
    }


def rows(
    first: int,
    last: int,
    t0: float,
    step_s: float = 0.8,
    data_wait_s: float = 0.05,
    saves: dict[int, float] | None = None,
    commits: dict[int, tuple[str, int]] | None = None,
) -> list[dict[str, Any]]:
    """One row a second: step `first` written at t0 + 1 ... ; `saves` step -> blocked seconds."""
    out = []
    for i, step in enumerate(range(first, last + 1), 1):
        row = {
            "step": step,
            "time": t0 + i,
            "step_time_s": step_s,
            "data_wait_s": data_wait_s,
            "ckpt_s": (saves or {}).get(step, 0.0),
        }
        if step in (commits or {}):
            tier, saved = commits[step]
            row[f"ckpt/{tier}/step"] = saved
        out.append(row)
    return out


def nonzero(parts: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in parts.items() if abs(v) > 1e-9}


def test_a_restart_inside_the_allocation_every_second_in_its_place() -> None:
    """2 nodes, 45 s: the job starts, trains 10 steps, rank 1 fails, the workers restart from step 5 (the RAM
    tier) and train steps 6-20, then a 2 s final save and 3 s of exit."""
    events = [
        attempt("7", 0, 0, 1002, 1008, 1009.5),
        {"event": "resume", "time": 1024.5, "tier": "ram", "step": 5},
        attempt("7", 1, 5, 1021, 1025, 1026.1),
        {"event": "attempt_end", "time": 1043, "how": "completed", "save_s": 2.0, "step": 20},
    ]
    metrics = rows(1, 10, 1008, saves={5: 0.1}, commits={6: ("ram", 5)}) + rows(6, 20, 1025, saves={10: 0.1, 20: 0.1})
    failed = [
        {"rank": 1, "host": "n2", "type": "RuntimeError", "message": "boom", "step": 11, "peer": False, "time": 1019.5},
        {
            "rank": 0,
            "host": "n1",
            "type": "RuntimeError",
            "message": "Connection closed by peer",
            "step": 11,
            "peer": True,
            "time": 1019.7,
        },
    ]
    alloc = Allocation("7", "COMPLETED", submit=990, eligible=990, start=1000, end=1045, nodes=2, node_list="n[1-2]")
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=[alloc],
        accounting=True,
        now=2000,
        max_steps=20,
        completed={"job_id": "7", "step": 20},
        failures=lambda key: failed if key == "7" else [],
        hosts=lambda key: ["n1", "n1", "n2", "n2"],
    )
    seconds = {k: v / 2 for k, v in ledger.parts.items() if v}  # 2 nodes
    assert seconds == pytest.approx(
        {
            "productive": 20 * 0.75,  # steps 1-5 of the first attempt, 6-20 of the second, less their data wait
            "data_wait": 20 * 0.05,
            "checkpoint": 0.1 + 0.2 + 2.0,  # step 5, steps 10 and 20 of the second attempt, the final save
            "step_overhead": 5 * 0.2 - 0.1 + 15 * 0.2 - 0.2,
            "lost": 5.0,  # steps 6-10 of the first attempt, redone
            "startup": 2 + 6 + 4,  # Slurm to the first process, then each attempt's own start
            "recovery": 1021 - 1018,  # the last step of the first attempt to the second's first process
            "shutdown": 3.0,
        }
    )
    assert ledger.allocated_node_s == 90 and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert ledger.goodput == pytest.approx(15 / 45) and ledger.jobs[0].goodput == pytest.approx(15 / 45)
    assert ledger.steps_done == 20 and ledger.steps_redone == 5 and ledger.queue_s == 0
    assert ledger.first_queue_s == 10 and ledger.jobs[0].ended == "finished the run"
    assert ledger.checkpoints == {"ram": {"step": 5, "time": 1014}}
    assert ledger.eta_s == 0 and ledger.rate_steps_per_s == pytest.approx(1.0)
    (incident,) = ledger.incidents
    assert incident.kind == "restart in the allocation" and incident.last_step == 10 and incident.lost_steps == 5
    assert incident.resumed_from == 5 and incident.tier == "ram" and incident.next_job == "7.1"
    assert incident.cause.startswith("RuntimeError at step 11 on n2 (rank 1): boom")
    assert incident.parts == pytest.approx(
        {"detection": 1.5, "teardown, rendezvous, spawn": 1.5, "load": 4.0, "first step": 1.1}
    )
    assert sum(incident.load.values()) == pytest.approx(4.0) and incident.total_s == pytest.approx(8.1)
    assert incident.lost_s == pytest.approx(5.0)


def test_a_usr2_requeue_its_stop_save_queue_and_second_run() -> None:
    """One node; the job is requeued at step 10 (USR2: a 3 s save, then Slurm ends it) and runs again under the
    same id after 15 s in the queue (held, then waiting)."""
    reason = "time limit, preemption or a user's signal (SIGUSR2)"
    events = [
        attempt("8", 0, 0, 1001, 1005, 1006.5),
        {"event": "stop", "time": 1015.2, "reason": reason, "step": 10},
        {"event": "attempt_end", "time": 1018.2, "how": "stopped", "reason": reason, "save_s": 3.0, "step": 10},
        {"event": "resume", "time": 1049.9, "tier": "shared", "step": 10},
        attempt("8", 0, 10, 1047, 1050, 1051.4),
        {"event": "attempt_end", "time": 1071, "how": "completed", "save_s": 1.0, "step": 30},
    ]
    metrics = rows(1, 10, 1005, step_s=1.0, data_wait_s=0.0) + rows(11, 30, 1050, step_s=1.0, data_wait_s=0.0)
    allocs = parse_sacct("8|REQUEUED|900|900|1000|1030|1|n1|0:0|None\n8|COMPLETED|1031|1041|1045|1080|1|n3|0:0|None\n")
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=allocs,
        accounting=True,
        now=2000,
        max_steps=30,
        completed={"job_id": "8", "step": 30},
    )
    first, second = ledger.jobs
    assert (first.job_id, first.run, second.job_id, second.run) == ("8", 0, "8", 1)
    assert nonzero(first.parts) == pytest.approx({"startup": 5, "productive": 10, "checkpoint": 3, "recovery": 12})
    assert nonzero(second.parts) == pytest.approx({"startup": 5, "productive": 20, "checkpoint": 1, "shutdown": 9})
    assert first.ended == f"requeued: {reason}" and second.ended == "finished the run"
    assert (first.queue_s, second.queue_s, ledger.queue_s, ledger.first_queue_s) == (100, 15, 15, 100)
    assert ledger.goodput == pytest.approx(30 / 65) and first.goodput == pytest.approx(10 / 30)
    (incident,) = ledger.incidents
    assert incident.kind == "requeue" and incident.cause == reason and incident.lost_steps == 0
    assert incident.parts == pytest.approx(
        {"detection": 0.2, "stop save": 3.0, "teardown": 11.8, "queue": 15, "restart": 2, "load": 3, "first step": 1.4}
    )
    assert incident.tier == "shared" and incident.total_s == pytest.approx(36.4)


def test_a_crash_resubmitted_without_the_node_at_fault() -> None:
    events = [attempt("9", 0, 0, 1001, 1003, 1004.5), attempt("10", 0, 4, 1042, 1044, 1045.5)]
    metrics = rows(1, 6, 1003, step_s=1.0, data_wait_s=0.0) + rows(5, 10, 1044, step_s=1.0, data_wait_s=0.0)
    allocs = [
        Allocation("9", "FAILED", 995, 995, 1000, 1012, 2, "n[1-2]"),
        Allocation("10", "COMPLETED", 1011, 1011, 1040, 1051, 2, "n[3-4]"),
    ]
    decision = {"job_id": "9", "excluded": ["n2"], "resubmitted_as": "10", "action": "resubmit"}
    record = {"rank": 3, "host": "n2", "type": "OSError", "message": "disk", "step": 7, "peer": False, "time": 1009.4}
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=allocs,
        accounting=True,
        now=2000,
        max_steps=10,
        completed={"job_id": "10", "step": 10},
        resubmissions=[decision],
        failures=lambda key: [record] if key == "9" else [],
    )
    (incident,) = ledger.incidents
    assert incident.kind == "resubmission" and incident.next_job == "10" and incident.lost_steps == 2
    assert incident.cause == "FAILED: OSError at step 7 on n2 (rank 3): disk; resubmitted as 10 excluding n2"
    assert incident.parts == pytest.approx(
        {"detection": 0.4, "teardown": 2.6, "queue": 28, "restart": 2, "load": 2, "first step": 1.5}
    )
    assert ledger.jobs[0].ended == "failed: " + incident.cause.removeprefix("FAILED: ")
    assert ledger.parts["lost"] == pytest.approx(2 * 2)
    assert ledger.parts["recovery"] == pytest.approx(2 * 3)  # step 6 at 1009 to the job's end at 1012
    assert ledger.allocated_node_s == 2 * (12 + 11) and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)


def test_a_job_that_shrank_after_a_lost_node_counts_each_stretch_at_its_nodes() -> None:
    """sacct's records of a job that went on with one of its two nodes (RESIZING, then the rest of the job, as
    the dev cluster printed them for elastic.min_nodes=1): one job run, 2 nodes until the resize, 1 after."""
    events = [
        attempt("268", 0, 0, 1002, 1005, 1006.5),
        attempt("268", 1, 20, 1032, 1035, 1036.5),
        {"event": "attempt_end", "time": 1056, "how": "completed", "save_s": 1.0, "step": 40},
    ]
    metrics = rows(1, 20, 1005, step_s=1.0, data_wait_s=0.0) + rows(21, 40, 1035, step_s=1.0, data_wait_s=0.0)
    allocs = parse_sacct(
        "268|RESIZING|990|990|1000|1030|2|n[1-2]|0:0|None\n268|COMPLETED|1030|1030|1030|1060|1|n1|0:0|None\n"
    )
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=allocs,
        accounting=True,
        now=2000,
        max_steps=40,
        completed={"job_id": "268", "step": 40},
        hosts=lambda key: ["n1", "n2"] if key == "268" else ["n1"],
    )
    (job,) = ledger.jobs
    assert job.pieces == [(1000, 1030, 2), (1030, 1060, 1)] and job.node_s == 2 * 30 + 30
    assert nonzero(job.parts) == pytest.approx(
        {"startup": 2 * 2 + 3 * 2 + 3, "productive": 20 * 2 + 20, "recovery": 5 * 2 + 2, "checkpoint": 1, "shutdown": 4}
    )
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9) and job.ended == "finished the run"
    assert ledger.incidents[0].cause.endswith("went on without n2")


def test_a_local_run_has_no_queue_and_ends_with_its_records() -> None:
    jobs = [{"job_id": "4242", "submitted": 1000.0}]
    events = [
        attempt("4242", 0, 0, 1001, 1002, 1003.2),
        {"event": "attempt_end", "time": 1013.5, "how": "completed", "save_s": 0.5, "step": 10},
    ]
    ledger = build_ledger(
        events=events,
        rows=rows(1, 10, 1002),
        allocations=local_allocations(jobs, lambda j: False),
        accounting=False,
        now=5000,
        max_steps=10,
    )
    assert ledger.queue_s is None and ledger.first_queue_s is None and not ledger.accounting
    (job,) = ledger.jobs
    assert job.end == 1013.5 and job.wall_s == 13.5 and job.ended == "finished the run"
    assert ledger.parts["shutdown"] == pytest.approx(1.0) and ledger.parts["checkpoint"] == pytest.approx(0.5)
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)


def test_a_live_run_counts_its_step_in_flight_as_pending_and_has_an_eta() -> None:
    jobs = [{"job_id": "4243", "submitted": 1000.0}]
    events = [attempt("4243", 0, 0, 1001, 1002, 1003.2)]
    ledger = build_ledger(
        events=events,
        rows=rows(1, 10, 1002),
        allocations=local_allocations(jobs, lambda j: True),
        accounting=False,
        now=1012.5,
        max_steps=100,
    )
    assert ledger.parts["pending"] == pytest.approx(0.5) and ledger.jobs[0].ended == "running"
    assert ledger.incidents == [] and ledger.rate_steps_per_s == pytest.approx(1.0)
    assert ledger.eta_s == pytest.approx(90) and ledger.eta_at_pace_s == pytest.approx(90 * 12.5 / 10)
    assert ledger.summary()["goodput"] == pytest.approx(10 * 0.75 / 12.5)


def test_compilation_inside_the_first_steps_is_its_own_part_not_productive() -> None:
    """parallel.compile: the first step of each attempt compiled (cold 6 s; after a restart in the allocation,
    from the node-local cache, 0.5 s); the row's step_time_s holds it, compile_s says how much."""
    jobs = [{"job_id": "4244", "submitted": 1000.0}]
    events = [
        attempt("4244", 0, 0, 1001, 1002, 1009.0),
        attempt("4244", 1, 3, 1014, 1015, 1016.5),
        {"event": "attempt_end", "time": 1020, "how": "completed", "save_s": 0.0, "step": 6},
    ]
    metrics = [
        {**row, "step_time_s": 6.8, "compile_s": 6.0} if row["step"] == 1 else row for row in rows(1, 3, 1002 + 6)
    ]
    metrics += [
        {**row, "step_time_s": 1.3, "compile_s": 0.5} if row["step"] == 4 else row for row in rows(4, 6, 1015 + 0.5)
    ]
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=local_allocations(jobs, lambda j: False),
        accounting=False,
        now=5000,
        max_steps=6,
    )
    assert ledger.parts["compile"] == pytest.approx(6.5)
    assert ledger.parts["productive"] == pytest.approx(6 * 0.75)  # the compilation is out of it
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert ledger.summary()["compile_share"] == pytest.approx(6.5 / 20)
    assert "compile 32.5%" in ledger.line()


def test_sacct_lines_as_the_dev_cluster_prints_them() -> None:
    """Real `sacct -X -D -P -n` output (SLURM_TIME_FORMAT=%s) of a job requeued once, the second run still
    running; a pending job; a cancelled one."""
    text = (
        "223|REQUEUED|1796138455|1796138455|1796138456|1796138458|2|n[1-2]|0:0|None\n"
        "223|RUNNING|1796138459|1796138470|1796138470|Unknown|2|n[1-2]|0:0|BeginTime\n"
        "224|PENDING|1796138579|1796138579|Unknown|Unknown|1|None assigned|0:0|Resources\n"
        "225|CANCELLED by 0|1796138600|1796138600|1796138601|1796138630|2|n[3-4]|0:15|None\n"
    )
    runs = parse_sacct(text)
    assert [(r.job_id, r.state, r.start, r.end) for r in runs] == [
        ("223", "REQUEUED", 1796138456, 1796138458),
        ("223", "RUNNING", 1796138470, None),
        ("225", "CANCELLED", 1796138601, 1796138630),
        ("224", "PENDING", None, None),
    ]
    assert runs[1].eligible == 1796138470 and runs[0].node_list == "n[1-2]" and runs[3].node_list == ""


def test_a_task_parses_each_metrics_row_once(tmp_path) -> None:
    """RowCache: the rows of a file read in pieces, a line still being written left for the next read."""
    import json

    from hpctrain.goodput.measure import RowCache

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in rows(1, 5, 1000)]
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    cache = RowCache()
    assert [r.step for r in cache.read(tmp_path)] == [1, 2, 3]
    path.write_text("\n".join(lines) + "\n")
    assert [r.step for r in cache.read(tmp_path)] == [1, 2, 3, 4, 5]
    assert cache.read(tmp_path)[-1].ckpt_s == 0.0 and cache.offset == path.stat().st_size


def test_a_suspended_step_is_not_productive() -> None:
    """Issue 29: `scontrol suspend` for 30 s during step 11 of 20 (2 nodes): the step's own timer and its row's
    span both hold the 30 s (the processes were stopped, their clocks ran on). sacct gives the total only
    (`Suspended`, as the dev cluster prints it); the ledger finds it in the row that ran 30 s past the others."""
    events = [
        attempt("500", 0, 0, 1002, 1005, 1006),
        {"event": "attempt_end", "time": 1057, "how": "completed", "save_s": 1.0, "step": 20},
    ]
    metrics = rows(1, 10, 1005) + [{**rows(11, 11, 1015)[0], "time": 1046, "step_time_s": 30.8}] + rows(12, 20, 1046)
    allocs = parse_sacct("500|COMPLETED|990|990|1000|1060|2|n[1-2]|0:0|None|00:00:30\n")
    assert allocs[0].suspended_s == 30
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=allocs,
        accounting=True,
        now=2000,
        max_steps=20,
        completed={"job_id": "500", "step": 20},
    )
    seconds = {k: v / 2 for k, v in nonzero(ledger.parts).items()}
    assert seconds == pytest.approx(
        {
            "productive": 20 * 0.75,
            "data_wait": 20 * 0.05,
            "step_overhead": 20 * 0.2,
            "suspended": 30,
            "startup": 5,
            "checkpoint": 1,
            "shutdown": 4,
        }
    )
    assert ledger.goodput == pytest.approx(15 / 60) and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    # without the suspension in the accounting (a local run, or Slurm's older field list): as before
    plain = build_ledger(
        events=events,
        rows=metrics,
        allocations=parse_sacct("500|COMPLETED|990|990|1000|1060|2|n[1-2]|0:0|None\n"),
        accounting=True,
        now=2000,
        max_steps=20,
    )
    assert plain.parts["suspended"] == 0 and plain.goodput == pytest.approx(45 / 60)


def test_a_suspension_outside_the_steps_comes_out_of_the_start_up() -> None:
    """Suspended for 10 s while loading (no row is longer than its neighbours): taken from the start-up."""
    events = [
        attempt("501", 0, 0, 1002, 1015, 1016),
        {"event": "attempt_end", "time": 1026, "how": "completed", "save_s": 0.0, "step": 10},
    ]
    allocs = parse_sacct("501|COMPLETED|990|990|1000|1027|1|n1|0:0|None|00:00:10\n")
    ledger = build_ledger(
        events=events, rows=rows(1, 10, 1015), allocations=allocs, accounting=True, now=2000, max_steps=10
    )
    assert ledger.parts["suspended"] == pytest.approx(10) and ledger.parts["productive"] == pytest.approx(7.5)
    # from the parts outside the steps, by their size: start-up 15 s, shutdown 2 s
    assert ledger.parts["startup"] == pytest.approx(15 - 10 * 15 / 17)
    assert ledger.parts["shutdown"] == pytest.approx(2 - 10 * 2 / 17)
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)


def test_an_idle_hot_spare_is_not_productive_and_a_spare_that_took_over_is() -> None:
    """cluster.spare_nodes=1: 3 nodes, 2 train (the attempt's rank -> host map). n1 dies after step 20; the
    spare n3 takes its slot and the job goes on with n2 and n3 (sacct: RESIZING, then 2 nodes). The spare's
    waiting is its own part, "spare"; after it took over it trains like the others."""
    events = [
        attempt("300", 0, 0, 1002, 1005, 1006),
        attempt("300", 1, 20, 1032, 1035, 1036),
        {"event": "attempt_end", "time": 1056, "how": "completed", "save_s": 1.0, "step": 40},
    ]
    metrics = rows(1, 20, 1005, step_s=1.0, data_wait_s=0.0) + rows(21, 40, 1035, step_s=1.0, data_wait_s=0.0)
    allocs = parse_sacct(
        "300|RESIZING|990|990|1000|1030|3|n[1-3]|0:0|None\n300|COMPLETED|1030|1030|1030|1060|2|n[2-3]|0:0|None\n"
    )
    hosts = {"300": ["n1", "n1", "n2", "n2"], "300.1": ["n3", "n3", "n2", "n2"]}
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=allocs,
        accounting=True,
        now=2000,
        max_steps=40,
        completed={"job_id": "300", "step": 40},
        hosts=lambda key: hosts.get(key, []),
    )
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 3 * 2 + 2 * 3 + 2 * 3,  # Slurm's start (every node), then each attempt's on its 2 nodes
            "spare": 1 * 3 + 1 * 20,  # n3 while the first attempt started and trained
            "productive": 2 * 20 + 2 * 20,
            "recovery": 3 * 5 + 2 * 2,
            "checkpoint": 2 * 1,
            "shutdown": 2 * 4,
        }
    )
    assert ledger.allocated_node_s == 150 and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert ledger.goodput == pytest.approx(80 / 150)


def test_the_cause_names_the_node_that_died_not_a_survivor_that_saw_it_go() -> None:
    """elastic.min_nodes without a spare: n3 loses power and leaves no record; n1's and n2's ranks fail on
    their lost peer (peer records, n2's first). The incident's cause is n3."""
    events = [
        attempt("400", 0, 0, 1002, 1005, 1006),
        attempt("400", 1, 10, 1025, 1028, 1029),
        {"event": "attempt_end", "time": 1040, "how": "completed", "save_s": 0.5, "step": 20},
    ]
    metrics = rows(1, 12, 1005, step_s=1.0, data_wait_s=0.0) + rows(11, 20, 1028, step_s=1.0, data_wait_s=0.0)
    peer = {"type": "RuntimeError", "message": "Connection closed by peer", "step": 13, "peer": True}
    records = [
        {**peer, "rank": 2, "host": "n2", "time": 1020.1},
        {**peer, "rank": 3, "host": "n2", "time": 1020.2},
        {**peer, "rank": 0, "host": "n1", "time": 1020.3},
        {**peer, "rank": 1, "host": "n1", "time": 1020.4},
    ]
    hosts = {"400": ["n1", "n1", "n2", "n2", "n3", "n3"], "400.1": ["n1", "n1", "n2", "n2"]}
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=parse_sacct("400|COMPLETED|990|990|1000|1042|3|n[1-3]|0:0|None\n"),
        accounting=True,
        now=2000,
        max_steps=20,
        completed={"job_id": "400", "step": 20},
        failures=lambda key: records if key == "400" else [],
        hosts=lambda key: hosts.get(key, []),
    )
    (incident,) = ledger.incidents
    assert incident.cause.startswith("n3 (rank 4,5) stopped without a failure record"), incident.cause
    assert "on n2 (rank 2): Connection closed by peer" in incident.cause  # what the survivors saw, after it
    assert incident.cause.endswith("went on without n3")


def resumed_finished_run(resume_events: bool = True) -> list[dict[str, Any]]:
    """A run of 20 steps on one node, finished by job 600; then (`resume_events`) `run.resume` of it as job 601,
    which loads step 20 and ends without a step: the events as a real run wrote them."""
    events = [
        attempt("600", 0, 0, 1002, 1005, 1006),
        {"event": "ledger", "time": 1006.5, "step": 2},
        {"event": "attempt_end", "time": 1026, "how": "completed", "save_s": 0.5, "step": 20},
        {"event": "ledger", "time": 1026.4, "step": 20},
    ]
    if resume_events:
        events += [
            {"event": "resume", "time": 1113, "tier": "shared", "step": 20, "load_s": 0.4},
            {"event": "attempt_end", "time": 1113.1, "how": "completed", "save_s": 0.003, "step": 20},
            {"event": "ledger", "time": 1113.2, "step": 0},
        ]
    return events


@pytest.mark.parametrize("accounting", [False, True], ids=["local", "slurm"])
def test_a_resume_of_a_finished_run_is_no_part_of_its_training(accounting: bool) -> None:
    """Issue 29: after `run.resume` of a finished run the status showed 47.6% instead of 87.2% and credited
    the resume with the run's end: the resume's "attempt_end" (it trained no step, so wrote no "attempt")
    was taken for the end of the last attempt that trained, and its job counted as the run's."""
    if accounting:
        allocs = parse_sacct(
            "600|COMPLETED|995|995|1000|1027|1|n1|0:0|None\n601|COMPLETED|1099|1099|1100|1114|1|n1|0:0|None\n"
        )
        alone = parse_sacct("600|COMPLETED|995|995|1000|1027|1|n1|0:0|None\n")
    else:
        jobs = [{"job_id": "600", "submitted": 1000.0}, {"job_id": "601", "submitted": 1100.0}]
        allocs, alone = local_allocations(jobs, lambda j: False), local_allocations(jobs[:1], lambda j: False)
    common = dict(rows=rows(1, 20, 1005), accounting=accounting, now=5000, max_steps=20)
    before = build_ledger(
        events=resumed_finished_run(False), allocations=alone, completed={"job_id": "600", "step": 20}, **common
    )
    after = build_ledger(
        events=resumed_finished_run(), allocations=allocs, completed={"job_id": "601", "step": 20}, **common
    )  # the resume rewrote COMPLETED.json
    assert after.goodput == pytest.approx(before.goodput) and after.parts == pytest.approx(before.parts)
    assert after.allocated_node_s == pytest.approx(before.allocated_node_s)
    first, resume = after.jobs
    assert first.end == before.jobs[0].end and first.ended == "finished the run" and first.steps == (1, 20)
    assert not resume.counted and resume.ended == "nothing to train: the run was complete"
    assert after.after_end_node_s == pytest.approx(14 if accounting else 13.2)
    assert after.incidents == [] and after.summary()["jobs"] == 1


def lost_node_run(spare_nodes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[str]]]:
    """Three nodes train (n1-n3) and `spare_nodes` more wait (n4); at step 12 the node of slot 0 dies (no
    record: its peers' are peer errors), the workers restart from step 10: on n4 in its place with a spare,
    on the two left without one (elastic.min_nodes). Slurm shrinks the job at no point: it ends at 1042."""
    events = [
        attempt("400", 0, 0, 1002, 1005, 1006),
        attempt("400", 1, 10, 1025, 1028, 1029),
        {"event": "attempt_end", "time": 1040, "how": "completed", "save_s": 0.5, "step": 20},
    ]
    metrics = rows(1, 12, 1005, step_s=1.0, data_wait_s=0.0) + rows(11, 20, 1028, step_s=1.0, data_wait_s=0.0)
    after = ["n4", "n2", "n3"] if spare_nodes else ["n2", "n3"]
    return events, metrics, {"400": ["n1", "n2", "n3"], "400.1": after}


@pytest.mark.parametrize("spares", [0, None], ids=["config", "unknown"])
def test_a_dead_nodes_time_until_the_job_ends_is_lost_node_time_not_spare(spares: int | None) -> None:
    """D3 (issue 48): a job without a spare goes on with two of three nodes; Slurm keeps the dead one in the
    allocation. Its time while the others start and train again is "lost_node", charged to the interruption
    that took it out, never "spare" (there is none): told by the config's spare count, and without it, by the
    host maps (n1 trained before)."""
    events, metrics, hosts = lost_node_run(0)
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=parse_sacct("400|COMPLETED|990|990|1000|1042|3|n[1-3]|0:0|None\n"),
        accounting=True,
        now=2000,
        max_steps=20,
        completed={"job_id": "400", "step": 20},
        hosts=lambda key: hosts.get(key, []),
        spares=spares,
    )
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 3 * 2 + 3 * 3 + 2 * 3,  # Slurm's start, then each attempt's on the nodes it trains on
            "productive": 3 * 10 + 2 * 10,
            "lost": 3 * 2,  # steps 11 and 12, redone
            "recovery": 3 * 8,
            "lost_node": 1 * 3 + 1 * 10,  # n1 while the second attempt started and trained
            "checkpoint": 3 * 0.5,
            "shutdown": 3 * 3.5,
        }
    )
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9) and ledger.allocated_node_s == 126
    (incident,) = ledger.incidents
    assert incident.lost_node_s == pytest.approx(13) and incident.cause.endswith("went on without n1")
    assert "lost node 10.3%" in ledger.line() and "spare" not in ledger.line()


def test_a_waiting_spare_is_spare_and_the_dead_node_it_replaced_is_lost_node() -> None:
    """cluster.spare_nodes=1 and Slurm keeps the dead node in the allocation: n4 waits as the spare while the
    first attempt trains, then takes n1's place; n1's time from then on is the incident's lost node."""
    events, metrics, hosts = lost_node_run(1)
    ledger = build_ledger(
        events=events,
        rows=metrics,
        allocations=parse_sacct("400|COMPLETED|990|990|1000|1042|4|n[1-4]|0:0|None\n"),
        accounting=True,
        now=2000,
        max_steps=20,
        completed={"job_id": "400", "step": 20},
        hosts=lambda key: hosts.get(key, []),
        spares=1,
    )
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 4 * 2 + 3 * 3 + 3 * 3,
            "spare": 1 * 3 + 1 * 12,  # n4 while the first attempt started and trained
            "productive": 3 * 10 + 3 * 10,
            "lost": 3 * 2,
            "recovery": 4 * 8,
            "lost_node": 1 * 3 + 1 * 10,  # n1 while the second attempt started and trained
            "checkpoint": 4 * 0.5,
            "shutdown": 4 * 3.5,
        }
    )
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9) and ledger.allocated_node_s == 168
    assert ledger.incidents[0].lost_node_s == pytest.approx(13)


def test_after_a_scancel_the_parts_sum_to_the_allocation_and_the_rest_is_reported_beside() -> None:
    """D4 (issue 48): `scancel` ends the job in Slurm's records at once (here at 1022.5, half way through step
    18); the tasks, sent SIGTERM, finish steps 18-20 and save for 3 s after it. The parts are the allocation as
    accounted: the rows' time past the end is clipped (step 18 by half, every part of it in proportion), the
    save left out, and both reported beside as past_end_node_s."""
    from hpctrain.status.view import render

    reason = "terminated (SIGTERM)"
    events = [
        attempt("9", 0, 0, 1002, 1005, 1006),
        {"event": "stop", "time": 1025.1, "reason": reason, "step": 20},
        {"event": "attempt_end", "time": 1028.1, "how": "stopped", "reason": reason, "save_s": 3.0, "step": 20},
    ]
    cancelled = Allocation("9", "CANCELLED", 990, 990, 1000, 1022.5, 2, "n[1-2]")
    ledger = build_ledger(
        events=events,
        rows=rows(1, 20, 1005, step_s=0.8, data_wait_s=0.2),
        allocations=[cancelled],
        accounting=True,
        now=5000,
        max_steps=100,
        hosts=lambda key: ["n1", "n2"],
    )
    assert ledger.allocated_node_s == 45 and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 2 * 5,
            "productive": 2 * 0.6 * 17.5,
            "data_wait": 2 * 0.2 * 17.5,
            "step_overhead": 2 * 0.2 * 17.5,
        }
    )
    assert ledger.past_end_node_s == pytest.approx(2 * 2.5 + 2 * 3.0)  # steps 18 (half), 19, 20; the save
    (incident,) = ledger.incidents
    assert incident.cause == reason and ledger.jobs[0].ended == f"cancelled: {reason}"
    page = render(ledger, {"id": "r", "path": "/r", "executor": "slurm"})
    (beside,) = [line.split() for line in page.splitlines() if line.strip().startswith("past the end")]
    assert beside[3] == "11.00" and "unattributed" not in page, page
