"""The goodput ledger of replica groups (recovery=replicas|diloco): every group's nodes productive while it trains,
a group's outage (from its last step to its first step back in the quorum) booked as replica_out, the nodes
beyond the groups' as spares or lost nodes, and each outage named with its steps, samples, heal and cost. First on
hand-built records whose every second is known, then on the records real replica groups wrote (torchft)."""

from __future__ import annotations

import io
import json
import signal
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from hpctrain.goodput.ledger import GroupRecords, Ledger, ReplicaSetup, build_ledger
from hpctrain.records.jobs import append_job
from hpctrain.scheduler.base import Allocation
from hpctrain.scheduler.slurm import parse_sacct
from hpctrain.status.__main__ import main as status_main
from hpctrain.status.records import RunRecords
from hpctrain.status.view import outage_line, render
from tests.conftest import _compose
from tests.goodput.test_ledger import attempt, nonzero, rows

GROUP_BATCH = 8


def replica_rows(
    first: int, last: int, t0: float, alone: range = range(0), quorum_s: float = 0.1, step_s: float = 1.0
) -> list[dict[str, Any]]:
    """`rows` of a replica group: step `first` written at t0 + 1..., each with its quorum (inside the step) and
    the groups in it: 1 of 2 for the steps in `alone`."""
    out = rows(first, last, t0, step_s=step_s, data_wait_s=0.0)
    for row in out:
        row.update(participants=1 if row["step"] in alone else 2, quorum_s=quorum_s, quorum_id=1, step_retries=0)
    return out


def healed_run() -> dict[str, Any]:
    """2 groups of 2 nodes (n1-n2, n3-n4) and a hot spare (n5), 50 s. Both train from step 1; after step 10 n3
    dies (no record); group 0 takes steps 11-20 alone; group 1's agents restart it on n5 and n4, it joins the
    quorum of step 21 and heals from group 0 (its first step: 1.1 s of quorum, the heal in it), and both train
    to step 40, save 1 s and exit."""
    end = {"event": "attempt_end", "time": 1046, "how": "completed", "save_s": 1.0, "step": 40}
    first = replica_rows(21, 40, 1025)
    first[0].update(step_time_s=2.0, quorum_s=1.1)  # from its ready at 1024: waiting to join, and the heal
    return {
        "events": [attempt("500", 0, 0, 1002, 1005, 1006), end],
        "rows": replica_rows(1, 40, 1005, alone=range(11, 21)),
        "hosts": {"500": ["n1", "n1", "n2", "n2"]},
        "g1_events": [
            attempt("500", 0, 0, 1002, 1005, 1006),
            attempt("500", 1, 0, 1020, 1024, 1026),
            {"event": "replica_heal", "time": 1025.1, "step": 20, "from_step": 0, "heal_s": 0.3, "group": 1},
            end,
        ],
        "g1_rows": replica_rows(1, 10, 1005) + first,
        "g1_hosts": {"500": ["n3", "n3", "n4", "n4"], "500.1": ["n5", "n5", "n4", "n4"]},
    }


def ledger_of(run: dict[str, Any], allocations: list[Allocation], now: float = 5000, **setup: Any) -> Ledger:
    return build_ledger(
        events=run["events"],
        rows=run["rows"],
        allocations=allocations,
        accounting=True,
        now=now,
        max_steps=run.get("max_steps", 40),
        completed={"job_id": "500", "step": 40},
        hosts=lambda key: run["hosts"].get(key, []),
        spares=run.get("spares", 1),
        replicas=ReplicaSetup(groups=2, nodes=2, group_batch=GROUP_BATCH, **setup),
        groups=[
            GroupRecords(run["g1_events"], run["g1_rows"], hosts=lambda key: run["g1_hosts"].get(key, [])),
        ],
    )


def test_a_group_out_and_healed_from_its_peer_every_second_in_its_place() -> None:
    """Each group's 2 nodes are its own: group 0's train all along; group 1's are out of the quorum from its last
    step (1015) to its first step back (1025.1: its restart, start-up and join), and n5 waits as the spare until
    it takes n3's slot, then n3 is the lost node the job still holds."""
    ledger = ledger_of(healed_run(), parse_sacct("500|COMPLETED|990|990|1000|1050|5|n[1-5]|0:0|None\n"))
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 2 * 5 + 2 * 5,  # Slurm's start and each group's own
            "productive": 2 * 0.9 * 40 + 2 * 0.9 * 30,  # group 0's 40 steps, group 1's 1-10 and 21-40
            "quorum": 2 * 0.1 * 40 + 2 * 0.1 * 29,  # each step's quorum but group 1's first back (its join)
            "replica_out": 2 * (1025.1 - 1015),  # group 1: recovery, start-up, its join and heal
            "checkpoint": 4 * 1.0,
            "shutdown": 4 * 4.0,
            "spare": 1 * 20,  # n5 until it took n3's slot
            "lost_node": 1 * 30,  # n3 from then on
        }
    )
    assert ledger.allocated_node_s == 250 and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert ledger.incidents == [] and ledger.jobs[0].ended == "finished the run" and ledger.steps_redone == 0
    (out,) = ledger.replica_incidents
    assert (out.group, out.attempt, out.next_attempt, out.kind) == (1, "500", "500.1", "restart in the allocation")
    assert (out.last_step, out.out_from, out.rejoined_at) == (10, 1015, 21)
    assert out.out_until == pytest.approx(1025.1) and out.out_s == pytest.approx(10.1)
    assert (out.steps_without, out.steps_without_n, out.fewest) == ((11, 20), 10, 1)
    assert out.samples_skipped == 10 * GROUP_BATCH and out.lost_steps == 0
    assert (out.heal_s, out.healed_from) == (0.3, 0)
    assert out.node_s == pytest.approx(ledger.parts["replica_out"]) and out.lost_node_s == pytest.approx(30)
    assert out.cause == "no failure record (a process was killed); went on without n3"
    totals = ledger.replicas
    assert totals is not None and (totals.steps, totals.steps_short, totals.fewest) == (40, 10, 1)
    assert totals.samples_skipped == 10 * GROUP_BATCH and (totals.heals, totals.heal_s) == (1, 0.3)
    summary = ledger.summary()
    assert summary["replica_out_node_s"] == pytest.approx(20.2) and summary["replica_incidents"] == 1
    assert summary["samples_skipped"] == 80 and summary["quorum_share"] == pytest.approx(13.8 / 250)
    line = "replica group 1 out 10.1s (steps 11-20 with 1 of 2 groups, 80 samples skipped), healed from a peer in "
    assert outage_line(out, 2) == line + "0.30 s, cost 20.2 node-s"
    page = render(ledger, {"id": "r", "path": "/r", "executor": "slurm"})
    assert line in page and "30 of 40 steps with every group, 10 with fewer (the fewest 1 of 2)" in page, page
    assert "restart in the allocation, 500 -> 500.1, back at step 21: no failure record" in page
    assert "2 replica groups: 1 outage(s), 10 step(s) with fewer groups, 80 samples skipped" in ledger.line()


def lone_group_run(alone_from: int) -> dict[str, Any]:
    """2 groups of 2 nodes, no spare: group 1's node dies after step 10 and it never comes back."""
    run = healed_run()
    run.update(
        rows=replica_rows(1, 40, 1005, alone=range(alone_from, 41)),
        g1_events=run["g1_events"][:1],
        g1_rows=run["g1_rows"][:10],
        spares=0,
    )
    return run


def test_a_group_that_does_not_come_back_is_out_while_the_others_train_then_recovery() -> None:
    """Without a spare, group 1 stays out: its nodes are replica_out while group 0 trains (to 1045), then
    recovery like any job's nodes after a failure; not the run's interruption (group 0 finished it)."""
    ledger = ledger_of(lone_group_run(11), parse_sacct("500|COMPLETED|990|990|1000|1050|4|n[1-4]|0:0|None\n"))
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 2 * 5 + 2 * 5,
            "productive": 2 * 0.9 * 40 + 2 * 0.9 * 10,
            "quorum": 2 * 0.1 * 40 + 2 * 0.1 * 10,
            "replica_out": 2 * (1045 - 1015),
            "recovery": 2 * (1050 - 1045),
            "checkpoint": 2 * 1.0,
            "shutdown": 2 * 4.0,
        }
    )
    assert ledger.allocated_node_s == 200 and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)
    assert ledger.incidents == [] and ledger.jobs[0].ended == "finished the run"
    (out,) = ledger.replica_incidents
    assert (out.kind, out.out_until, out.rejoined_at, out.heal_s, out.next_attempt) == (
        "out to the job's end",
        None,
        None,
        None,
        None,
    )
    assert (out.steps_without, out.samples_skipped) == ((11, 40), 30 * GROUP_BATCH) and out.out_s == 35
    assert out.node_s == pytest.approx(60) and "not back before its job ended" in outage_line(out, 2)


def test_a_live_run_shows_the_group_out_now() -> None:
    """The job still runs (step 25 of group 0 at 1030); group 1 stopped at step 10: out since then, its nodes'
    time while group 0 trains is replica_out, not the pending step in flight."""
    run = lone_group_run(11)
    run.update(events=run["events"][:1], rows=run["rows"][:25], max_steps=100)
    running = Allocation("500", "RUNNING", 990, 990, 1000, None, 4, "n[1-4]")
    ledger = ledger_of(run, [running], now=1030)
    (out,) = ledger.replica_incidents
    assert out.kind == "out" and out.out_s == 15 and out.steps_without == (11, 25)
    assert out.node_s == pytest.approx(2 * 15) and ledger.parts["replica_out"] == pytest.approx(2 * 15)
    assert "not back (still out)" in outage_line(out, 2) and ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)


def test_diloco_a_dropped_round_and_the_round_a_group_died_in_are_lost() -> None:
    """recovery=diloco, a round of 5 steps, 2 groups of 1 node, 40 s. Group 1 dies after step 12: the round
    11-15 is dropped (group 0's steps 11-15 lost, its event), group 1's steps 11-12 never reached the others
    (lost); group 0 takes the round 16-20 alone; group 1 heals at step 20 (its first step: 4.1 s of quorum) and
    both train to 30. The rows repeat their round's quorum: it counts once a round."""
    end = {"event": "attempt_end", "time": 1036, "how": "completed", "save_s": 0.5, "step": 30}
    back = replica_rows(21, 30, 1025)
    back[0].update(step_time_s=5.0, quorum_s=4.1)
    run = {
        "events": [
            attempt("500", 0, 0, 1002, 1005, 1006),
            {"event": "diloco_round_dropped", "time": 1020, "step": 15, "group": 0, "every": 5},
            end,
        ],
        "rows": replica_rows(1, 30, 1005, alone=range(16, 21)),
        "hosts": {"500": ["n1"]},
        "g1_events": [
            attempt("500", 0, 0, 1002, 1005, 1006),
            attempt("500", 1, 0, 1018, 1021, 1026),
            {"event": "replica_heal", "time": 1025.5, "step": 20, "from_step": 0, "heal_s": 0.2, "group": 1},
            end,
        ],
        "g1_rows": replica_rows(1, 12, 1005) + back,
        "g1_hosts": {"500": ["n2"], "500.1": ["n2"]},
        "max_steps": 30,
        "spares": 0,
    }
    alloc = parse_sacct("500|COMPLETED|990|990|1000|1040|2|n[1-2]|0:0|None\n")
    ledger = build_ledger(
        events=run["events"],
        rows=run["rows"],
        allocations=alloc,
        accounting=True,
        now=5000,
        max_steps=30,
        completed={"job_id": "500", "step": 30},
        hosts=lambda key: run["hosts"].get(key, []),
        spares=0,
        replicas=ReplicaSetup(groups=2, nodes=1, group_batch=GROUP_BATCH, sync_every=5),
        groups=[GroupRecords(run["g1_events"], run["g1_rows"], hosts=lambda key: run["g1_hosts"].get(key, []))],
    )
    assert nonzero(ledger.parts) == pytest.approx(
        {
            "startup": 5 + 5,
            # group 0: 25 steps kept less the quorum of 5 rounds; group 1: 1-10, its first back, 22-30
            "productive": (25 - 0.5) + (10 - 0.2) + 0.9 + (9 - 0.1),
            "quorum": 0.5 + 0.2 + 0.1,
            "lost": 5 + 2,  # group 0's round 11-15 (dropped), group 1's 11-12 (it died in that round)
            "replica_out": 1025.1 - 1017,
            "checkpoint": 0.5 + 0.5,
            "shutdown": 4.5 + 4.5,
        }
    )
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9) and ledger.steps_redone == 5
    (out,) = ledger.replica_incidents
    assert (out.last_step, out.steps_without, out.lost_steps, out.fewest) == (12, (13, 20), 2, 1)
    assert out.samples_skipped == (8 + 2) * GROUP_BATCH and out.node_s == pytest.approx(8.1 + 2)
    totals = ledger.replicas
    assert totals is not None and (totals.rounds_dropped, totals.steps_short, totals.sync_every) == (1, 5, 5)
    # the missing group's samples of 16-20, and both groups' of the dropped round 11-15
    assert totals.samples_skipped == (5 * 1 + 5 * 2) * GROUP_BATCH


def write_group(folder: Path, events: list[dict[str, Any]], metrics: list[dict[str, Any]], hosts: dict) -> None:
    """A group's records as the run's writers leave them: events, metrics, a host map per attempt."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    for key, names in hosts.items():
        (folder / "failures" / key).mkdir(parents=True)
        (folder / "failures" / key / "hosts.json").write_text(json.dumps(names))


def test_the_status_page_reads_every_groups_folder_and_says_what_it_could_not(tmp_path: Path) -> None:
    """`python -m hpctrain.status` on a run directory of replica groups (recovery=replicas in its config): group
    1's records come from replicas/g1/, and a damaged line there is named with its folder."""
    cfg = _compose(
        "+experiment=smoke",
        "recovery=replicas",
        "cluster.nodes=4",
        "cluster.spare_nodes=1",
        f"train.global_batch={2 * GROUP_BATCH}",
        "train.max_steps=40",
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    run = healed_run()
    write_group(run_dir, run["events"], run["rows"], run["hosts"])
    write_group(run_dir / "replicas" / "g1", run["g1_events"], run["g1_rows"], run["g1_hosts"])
    with open(run_dir / "replicas" / "g1" / "metrics.jsonl", "a") as f:
        f.write('{"step": "junk"}\n')
    (run_dir / "jobs.jsonl").write_text(json.dumps({"job_id": "500", "executor": "local", "submitted": 1000}) + "\n")
    page = io.StringIO()
    with redirect_stdout(page):
        assert status_main([str(run_dir)]) == 0
    text = page.getvalue()
    assert "replica group 1 out 10.1s (steps 11-20 with 1 of 2 groups, 80 samples skipped)" in text, text
    assert "replicas/g1/metrics.jsonl: 1 unreadable line skipped" in text, text
    records = RunRecords(run_dir)
    ledger = records.measure(records.settings())
    assert ledger.allocated_node_s == pytest.approx(5 * (1046 - 1000))  # a local job: its 4 + 1 nodes
    assert ledger.unattributed_node_s == pytest.approx(0, abs=1e-9)


@pytest.mark.slow  # two replica groups of real processes, each the real training task, for a minute
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "mode", [["recovery=replicas"], ["recovery=diloco", "recovery.sync_every=5"]], ids=lambda m: m[0]
)
def test_the_records_real_groups_wrote_name_the_outage_and_its_cost(tmp_path: Path, mode: list[str]) -> None:
    """Two replica groups (tests/replicas: the real task function, torchft, a real lighthouse); group 1 is
    SIGKILLed at step 12 or later and started again, heals from group 0 and both finish. The ledger of what they
    wrote: one outage of group 1, its steps and samples as group 0's metrics and group 1's heal say, its cost
    the allocation's replica_out, every node-second in one part."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    from tests.replicas.test_replica_groups import Groups, _wait

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    groups = Groups(tmp_path, server.address(), *mode)
    append_job(groups.run_dir, "4242", "local")  # as the launcher does (the harness stands in for the job)
    try:
        groups.start(0)
        groups.start(1)
        _wait("group 1 at step 12", lambda: any(m["step"] >= 12 for m in groups.metrics(1)), 200)
        groups.procs[1].send_signal(signal.SIGKILL)
        groups.procs[1].wait()
        killed_at = max(m["step"] for m in groups.metrics(1))
        _wait("group 0 alone", lambda: sum(m["participants"] == 1 for m in groups.metrics(0)) >= 5, 120)
        groups.start(1, restart=1)
        assert groups.procs[0].wait(timeout=300) == 0, groups.log(0)
        assert groups.procs[1].wait(timeout=60) == 0, groups.log(1, 1)
    finally:
        groups.stop()
        server.shutdown()
    time.sleep(0.1)
    records = RunRecords(groups.run_dir)
    settings = records.settings()
    ledger = records.measure(settings)
    assert records.notes.lines() == [] and ledger.unattributed_node_s == pytest.approx(0, abs=1e-6)
    assert ledger.incidents == [] and ledger.jobs[0].ended == "finished the run"
    (heal,) = [e for e in groups.events(1) if e["event"] == "replica_heal"]
    (out,) = ledger.replica_incidents
    every = settings["replicas"]["sync_every"]
    thrown = killed_at % every  # DiLoCo: its steps of the round it died in
    assert (out.group, out.attempt, out.next_attempt, out.last_step) == (1, "4242", "4242.1", killed_at)
    assert out.steps_without == (killed_at + 1, heal["step"]) and out.rejoined_at == heal["step"] + 1
    assert out.heal_s == heal["heal_s"] and out.lost_steps == thrown
    batch = settings["replicas"]["group_batch"]
    assert out.samples_skipped == (heal["step"] - killed_at + thrown) * batch
    # group 0 says so too: the steps it took alone after the kill are in the outage
    alone = {m["step"] for m in groups.metrics(0) if m["participants"] == 1 and m["step"] > killed_at}
    assert alone and alone <= set(range(killed_at + 1, heal["step"] + 1)), (alone, out)
    assert out.fewest == 1 and ledger.replicas is not None and ledger.replicas.heals == 1
    # its cost is its node's time out of the quorum while group 0 trained (and, DiLoCo, its thrown steps)
    assert out.node_s >= ledger.parts["replica_out"] == pytest.approx(out.out_s) and out.out_s > 1
    page = io.StringIO()
    with redirect_stdout(page):
        assert status_main([str(groups.run_dir)]) == 0
    assert f"replica group 1 out {out.out_s:.1f}s (steps {killed_at + 1}-{heal['step']} with 1 of 2 groups" in (
        page.getvalue()
    ), page.getvalue()
