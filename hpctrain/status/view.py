"""The ledger as a terminal page: progress, checkpoints, the jobs, where the time went, the replica groups'
quorum and outages, each interruption."""

from __future__ import annotations

import datetime
from typing import Any

from hpctrain.goodput.ledger import PARTS, Ledger, ReplicaIncident

# What each part holds, for the reader of the table (hpctrain/goodput/ledger.py has the exact rules).
PART_NOTES = {
    "productive": "inside the steps that count",
    "data_wait": "those steps waiting for batches",
    "compile": "those steps in torch.compile",
    "quorum": "those steps in torchft's quorum (replica groups)",
    "checkpoint": "training stopped for saves",
    "evaluation": "validation",
    "step_overhead": "the loop between steps (logging, probes)",
    "lost": "steps later redone (or thrown away: a DiLoCo round dropped)",
    "startup": "job start, imports, process group, pre-flight, load",
    "recovery": "failure to the next attempt's processes",
    "replica_out": "a replica group out of the quorum while another trained",
    "shutdown": "after the final save",
    "pending": "since the last step of a live job",
    "spare": "hot spare nodes waiting while the others start and train",
    "lost_node": "nodes lost to training (dead, hung) still held while the others train",
    "suspended": "the job held suspended by the batch system",
}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def clock(t: float | None, now: float) -> str:
    """Local wall-clock time; with the date when it is not today's."""
    if t is None:
        return "-"
    at = datetime.datetime.fromtimestamp(t)
    same_day = at.date() == datetime.datetime.fromtimestamp(now).date()
    return at.strftime("%H:%M:%S" if same_day else "%m-%d %H:%M:%S")


def render(ledger: Ledger, run: dict[str, Any]) -> str:
    """`run`: {"id", "path", "name", "executor"}."""
    lines = [f"run {run['id']}  ({run['executor']}, {run['path']})"]
    lines += _progress(ledger)
    lines += ["", "jobs"] + _jobs(ledger)
    unit, per = ("node-hours", 3600.0) if ledger.allocated_node_s >= 3600 else ("node-seconds", 1.0)
    lines += ["", f"where the allocated time went ({unit})"] + _parts(ledger, per)
    if ledger.replicas is not None:
        lines += [""] + _replicas(ledger)
    if ledger.incidents:
        lines += ["", "interruptions (seconds)"] + _incidents(ledger)
    return "\n".join(lines)


def _progress(ledger: Ledger) -> list[str]:
    done, total = ledger.steps_done, ledger.max_steps
    line = f"step {done}/{total} ({done / total:.1%})" if total else f"step {done}"
    line += f", {ledger.steps_redone} " + ("lost (redone, or a DiLoCo round dropped)" if ledger.replicas else "redone")
    if ledger.rate_steps_per_s:
        line += f"; {ledger.rate_steps_per_s:.3g} steps/s now"
    if done < total:
        line += (
            f"; ETA {duration(ledger.eta_s)} at this rate, {duration(ledger.eta_at_pace_s)} at the run's pace "
            "so far (its interruptions included)"
        )
    out = [line]
    if ledger.checkpoints:  # the newest first
        out.append(
            "newest checkpoints: "
            + ", ".join(
                f"{tier} step {c['step']:.0f} ({duration(ledger.now - c['time'])} ago)"
                for tier, c in sorted(ledger.checkpoints.items(), key=lambda tc: (-tc[1]["step"], tc[0]))
            )
        )
    else:
        out.append("newest checkpoints: none committed yet")
    return out


def _jobs(ledger: Ledger) -> list[str]:
    header = (
        f"  {'job':<12}{'nodes':>6}  {'node list':<14}{'submitted':>15}{'queued':>10}{'start':>15}{'end':>15}"
        f"{'wall':>10}{'steps':>13}{'goodput':>9}  ended"
    )
    out = [header]
    for j in ledger.jobs:
        name = j.job_id + (f" ({j.run})" if j.run else "")
        steps = f"{j.steps[0]}-{j.steps[1]}" if j.steps else "-"
        goodput = "-" if j.goodput is None or not j.counted else f"{j.goodput:.1%}"
        queued = "-" if j.queue_s is None or not ledger.accounting else duration(j.queue_s)
        nodes = ">".join(str(n) for _, _, n in j.pieces) if len(j.pieces) > 1 else str(j.nodes)  # shrank
        out.append(
            f"  {name:<12}{nodes:>6}  {j.node_list or '-':<14}{clock(j.submit, ledger.now):>15}{queued:>10}"
            f"{clock(j.start, ledger.now):>15}{clock(j.end, ledger.now):>15}{duration(j.wall_s):>10}"
            f"{steps:>13}{goodput:>9}  {j.ended}"
        )
    if not ledger.jobs:
        out.append("  (no job has started yet)")
    return out


def _parts(ledger: Ledger, per: float) -> list[str]:
    total = ledger.allocated_node_s
    out = []
    for name in PARTS:
        value = ledger.parts.get(name, 0.0)
        if value or name in ("productive", "lost", "recovery", "checkpoint", "startup"):
            share = value / total if total else 0.0
            out.append(f"  {name.replace('_', ' '):<15}{value / per:>10.2f}{share:>8.1%}  {PART_NOTES[name]}")
    counted = [j for j in ledger.jobs if j.counted]
    out.append(
        f"  {'allocated':<15}{total / per:>10.2f}{1 if total else 0:>8.1%}  "
        f"{len(counted)} job run(s), {duration(ledger.wall_s)} of wall time"
    )
    if ledger.past_end_node_s > 0.001 * max(total, 1.0):  # not a clock's rounding
        out.append(
            f"  {'past the end':<15}{ledger.past_end_node_s / per:>10.2f}{'':>8}  "
            "worked after a job's recorded end (the save at a scancel): not counted"
        )
    if len(counted) < len(ledger.jobs):
        out.append(
            f"  {'after the end':<15}{ledger.after_end_node_s / per:>10.2f}{'':>8}  "
            f"{len(ledger.jobs) - len(counted)} job run(s) that resumed the complete run: not counted"
        )
    if abs(ledger.unattributed_node_s) > 0.001 * max(total, 1.0):
        out.append(
            f"  {'unattributed':<15}{ledger.unattributed_node_s / per:>10.2f}"
            f"{ledger.unattributed_node_s / total:>8.1%}  (the parts do not tile the allocations)"
        )
    if ledger.queue_s is None:
        out.append("  queue wait     unknown (no batch-system accounting: a local run)")
    else:
        out.append(
            f"  queue wait     {duration(ledger.queue_s)} between jobs, {duration(ledger.first_queue_s)} "
            "before the first (not allocated)"
        )
    goodput = "-" if ledger.goodput is None else f"{ledger.goodput:.1%}"
    out.append(f"  goodput        {goodput} (productive / allocated)")
    if ledger.goodput_with_queue is not None and ledger.queue_s:
        out.append(f"                 {ledger.goodput_with_queue:.1%} counting the queue between jobs as lost too")
    return out


def _incidents(ledger: Ledger) -> list[str]:
    names = [
        "detection",
        "stop save",
        "teardown",
        "teardown, rendezvous, spawn",
        "queue",
        "restart",
        "load",
        "first step",
    ]
    shown = [n for n in names if any(i.parts.get(n) is not None for i in ledger.incidents)]
    out = [
        f"  {'#':<3}{'attempt':<10}{'kind':<27}{'step':>6}{'lost':>6}"
        + "".join(f"{n:>{max(len(n), 6) + 2}}" for n in shown)
        + f"{'total':>9}  cause"
    ]
    for n, i in enumerate(ledger.incidents, 1):
        attempt = i.attempt
        cells = "".join(f"{_seconds(i.parts.get(p)):>{max(len(p), 6) + 2}}" for p in shown)
        out.append(
            f"  {n:<3}{attempt:<10}{i.kind:<27}{i.last_step:>6}{i.lost_steps:>6}{cells}"
            f"{_seconds(i.total_s):>9}  {i.cause}"
        )
        if i.next_job:
            resumed = f"step {i.resumed_from}" + (f" from the {i.tier} tier" if i.tier else "")
            load = ", ".join(f"{k} {v:.2f}" for k, v in i.load.items() if v >= 0.005)
            out.append(f"  {'':<3}{'':<10}-> {i.next_job} resumed at {resumed}; load: {load}")
        if i.lost_node_s > 0:
            out.append(f"  {'':<3}{'':<10}   the nodes it took out, still held: {i.lost_node_s:.2f} node-seconds")
    return out


def _replicas(ledger: Ledger) -> list[str]:
    """The quorum over the run, then each period a group was out of it, in a line that names the group."""
    r = ledger.replicas
    assert r is not None  # `render`
    every = "every step" if r.sync_every == 1 else f"every {r.sync_every} steps (DiLoCo)"
    fewest = f" (the fewest {r.fewest} of {r.groups})" if r.fewest is not None else ""
    out = [
        f"replica groups: {r.groups} x {r.nodes_per_group} node(s), a quorum {every}",
        f"  {r.steps - r.steps_short} of {r.steps} steps with every group, {r.steps_short} with fewer{fewest}; "
        f"{r.samples_skipped} samples skipped (never trained on)",
        f"  {r.heals} heal(s) from a peer ({r.heal_s:.2f} s); quorum {r.quorum_node_s:.2f} node-s; "
        f"out of the quorum {r.replica_out_node_s:.2f} node-s"
        + (f"; {r.rounds_dropped} DiLoCo round(s) dropped" if r.sync_every > 1 else ""),
    ]
    for o in ledger.replica_incidents:
        out.append("  " + outage_line(o, r.groups))
        back = f" -> {o.next_attempt}" if o.next_attempt else ""
        back += f", back at step {o.rejoined_at}" if o.rejoined_at is not None else ""
        held = f"; its lost nodes still held: {o.lost_node_s:.2f} node-s" if o.lost_node_s > 0 else ""
        out.append(f"    {o.kind}, {o.attempt}{back}: {o.cause}{held}")
    return out


def outage_line(o: ReplicaIncident, groups: int) -> str:
    """E.g. "replica group 1 out 12.3 s (steps 13-41 with 1 of 2 groups, 232 samples skipped), healed from a peer
    in 0.02 s, cost 24.6 node-s"."""
    if o.steps_without is not None:
        first, last = o.steps_without
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        fewest = f"{o.fewest} of {groups}" if o.fewest is not None else f"fewer than {groups}"
        said = [f"{steps} with {fewest} groups"]
    else:
        said = ["no step taken without it"]
    if o.lost_steps:
        said.append(f"{o.lost_steps} of its own steps lost")
    said.append(f"{o.samples_skipped} samples skipped")
    if o.heal_s is not None:
        back = f"healed from a peer in {o.heal_s:.2f} s"
    elif o.out_until is not None:
        back = "back without a heal (from its checkpoint)"
    else:
        back = "not back (still out)" if o.kind == "out" else "not back before its job ended"
    return f"replica group {o.group} out {duration(o.out_s)} ({', '.join(said)}), {back}, cost {o.node_s:.1f} node-s"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
