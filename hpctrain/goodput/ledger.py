"""Where a run's allocated time went, measured from its own records: the goodput ledger.

The model (model.py) predicts goodput from costs; this measures it, for one run across all its jobs. Every
second of every allocation goes to exactly one part, node-weighted (a second of a 512-node job is 512
node-seconds):

- productive: inside the timed steps that count (each step once: its last run), less their wait for data
  and their compilation;
- data_wait: those steps' wait for their batches (hpctrain.data.loader.BatchReader);
- compile: those steps' time in torch.compile (parallel.compile: each attempt's first steps, from the
  node-local cache after a restart in the allocation; recompilations): hpctrain.parallel.compile.CompileClock;
- checkpoint: training stopped for a save (staging, a busy tier waited for, the save at a stop or at the end);
- evaluation: validation;
- step_overhead: the rest of the loop between two steps (logging, health probes, the progress line);
- lost: steps that were redone (their whole time), because a later attempt resumed from an earlier step;
- startup: the scheduler's start of each job (batch script, srun, agents) up to its first worker process,
  and each attempt's own start (imports, process group, lease, pre-flight, engine build, checkpoint load,
  data, tracker);
- recovery: from the last step of an attempt that ended early to the first process of the next attempt
  (detection, teardown, rendezvous, spawn), and the end of a job that stopped or failed (Slurm's teardown,
  the supervisor);
- shutdown: the end of the job that finished the run, after its final save;
- pending: a live job's time since its last step (the step in flight, or a failure not yet recovered);
- spare: the hot spare nodes' time while the others start and train (cluster.spare_nodes): the nodes an
  allocation holds beyond those an attempt trains on (its rank -> host map). A spare that takes a dead
  node's place trains from the next attempt on; around a failure (recovery) every node counts there;
- suspended: time the batch system held the job suspended (`scontrol suspend`: Slurm's `Suspended`), every
  node of it. Its processes were stopped, their clocks ran on: the steps (or saves) it fell in took that much
  longer. Accounting gives only the total, so it is taken from the rows that ran longest past the attempt's
  typical row (a suspension lies inside one row's span), the rest from start-up, recovery, pending, shutdown.

Goodput = productive / allocated. The queue wait between jobs (from the batch system's accounting) is not
allocated time: it is reported beside, and absent (not zero) where there is no accounting (local runs).
A job that started after the run was complete (`run.resume` of a finished run) and trained nothing is no
part of the run's training: it is listed, its node-seconds reported beside (`after_end_node_s`), not counted.

Inputs are plain records (hpctrain.records): jobs.jsonl, attempts.jsonl, events.jsonl ("attempt" with its
start-up marks, "stop", "attempt_end"), metrics.jsonl rows (step_time_s, data_wait_s, compile_s, ckpt_s,
eval_s), the failure records, and the scheduler's `Allocation`s. Pure: the caller reads, this counts.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpctrain.records.failures import attempt_key
from hpctrain.records.history import ATTEMPT_MARKS as MARKS
from hpctrain.records.history import ATTEMPT_PARTS
from hpctrain.scheduler.base import Allocation

LOAD_PARTS = ATTEMPT_PARTS[:-1]  # an attempt's start-up up to its first step

PARTS = (
    "productive",
    "data_wait",
    "compile",
    "checkpoint",
    "evaluation",
    "step_overhead",
    "lost",
    "startup",
    "recovery",
    "shutdown",
    "pending",
    "spare",
    "suspended",
)
# Parts a suspension found in no row is taken from (it fell outside the steps), in proportion to their size.
OUTSIDE_STEPS = ("startup", "recovery", "pending", "shutdown")
LONGEST_ROWS = 16  # per attempt: the rows a suspension is looked for in
RATE_WINDOW = 100  # steps the current step rate is measured over
# Slurm accounts in whole seconds: an event up to this much past a job's recorded end still belongs to it.
SLACK_S = 2.0


@dataclass(slots=True)
class Row:
    """What the ledger needs of one metrics row."""

    step: int
    time: float  # when the row was written: after the step, its save and its evaluation
    step_s: float
    data_wait_s: float = 0.0
    compile_s: float = 0.0  # inside step_s: torch.compile at work (the step's compilation, not its kernels)
    ckpt_s: float = 0.0
    eval_s: float = 0.0
    commits: dict[str, int] | None = None  # tier -> checkpoint step committed by this row

    @classmethod
    def of(cls, m: dict[str, Any]) -> Row:
        commits, blocked = None, 0.0
        for key, value in m.items():  # one pass: a row has a dozen keys, a long run hundreds of thousands of rows
            if key.startswith("ckpt/"):
                if key.endswith("/step"):
                    commits = {**(commits or {}), key.split("/")[1]: int(value)}
                elif key.endswith(("/blocked_s", "/waited_s")):
                    blocked += value
        return cls(
            step=m["step"],
            time=m["time"],
            step_s=m["step_time_s"],
            data_wait_s=m.get("data_wait_s", 0.0),
            compile_s=m.get("compile_s", 0.0),
            # rows written before the loop measured its saves: the saves' own figures
            ckpt_s=m.get("ckpt_s", blocked),
            eval_s=m.get("eval_s", 0.0),
            commits=commits,
        )


@dataclass
class Attempt:
    """One start of the workers (a job's first, a restart inside its allocation), from its "attempt" event."""

    job_id: str
    restart: int
    from_step: int
    marks: dict[str, float]
    tier: str | None = None  # the checkpoint tier it resumed from
    end: dict[str, Any] | None = None  # its "attempt_end" event: how it ended on its own (completed, stopped)
    stop: dict[str, Any] | None = None  # its "stop" event (a signal)
    # filled while the rows are counted
    parts: dict[str, float] = field(default_factory=dict)
    first_row: Row | None = None
    last_row: Row | None = None
    steps: int = 0
    lost_steps: int = 0
    lost_s: float = 0.0
    spans_s: float = 0.0  # its rows' spans, summed (the typical row: `typical_span`)
    longest: list[tuple[float, int, dict[str, float]]] = field(default_factory=list)  # heap: span, step, parts
    floor: float = -1.0  # the shortest span in `longest` once it is full: a shorter row is not kept

    requeue: int = 0  # the job's run it belongs to (a requeued job keeps its id)

    @property
    def key(self) -> str:
        """Its failure records' folder (hpctrain.records.failures.attempt_key)."""
        return attempt_key(self.job_id, self.restart, self.requeue)

    def typical_span(self) -> float:
        """Its rows' mean span, the LONGEST_ROWS longest left out (a suspension, a save at a stop)."""
        rest = self.steps - len(self.longest)
        kept = sum(span for span, _, _ in self.longest)
        return (self.spans_s - kept) / rest if rest > 0 else min((s for s, _, _ in self.longest), default=0.0)


@dataclass
class JobRun:
    """One allocation: a job's run on its nodes (a requeued job has several, under one id)."""

    job_id: str
    run: int  # 0 for a job's first run, 1 after its first requeue...
    state: str
    nodes: int
    node_list: str
    submit: float | None
    eligible: float | None
    start: float  # only allocations that started are runs (`_job_runs`)
    end: float | None  # None: still running (the ledger counts it up to `now`)
    # (start, end, nodes) of each stretch at one node count: one, unless the job shrank after a lost node
    pieces: list[tuple[float, float | None, int]] = field(default_factory=list)
    ended: str = ""  # how it ended, in words
    queue_s: float | None = None  # the wait before it started: after the previous run ended, or its submission
    suspended_node_s: float = 0.0  # the batch system held it suspended (each piece at its nodes)
    counted: bool = True  # False: it started after the run was complete and trained nothing (not the run's)
    wall_s: float = 0.0
    node_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # node-seconds
    attempts: list[str] = field(default_factory=list)  # attempt keys
    steps: tuple[int, int] | None = None  # first and last step trained
    goodput: float | None = None


@dataclass
class Incident:
    """One interruption: the end of an attempt before the run's end, and the way back to training."""

    attempt: str  # the key of the attempt that ended (its failure records' folder)
    job_id: str
    restart: int
    kind: str  # "restart in the allocation", "requeue", "resubmission"
    cause: str
    last_step: int
    last_progress: float  # the end of its last step
    next_job: str | None  # where training went on; None while it has not
    resumed_from: int | None
    tier: str | None
    lost_steps: int
    lost_s: float
    parts: dict[str, float | None]  # seconds: detection, stop save, teardown, queue, restart, load, first step
    load: dict[str, float]  # the next attempt's start-up, part by part
    total_s: float | None  # last progress -> first step of the next attempt


@dataclass
class Ledger:
    now: float
    max_steps: int
    steps_done: int  # the newest step trained
    steps_redone: int
    allocated_node_s: float
    wall_s: float  # allocations only
    parts: dict[str, float]  # node-seconds, summing to allocated_node_s (see `unattributed_node_s`)
    queue_s: float | None  # between jobs; None without accounting
    first_queue_s: float | None  # before the first job
    goodput: float | None
    # productive / (allocated + the queue between jobs, at the nodes of the job waiting): what the run got of
    # the time it was trying to run, the quantity the model (model.py) predicts with the requeue in R
    goodput_with_queue: float | None
    jobs: list[JobRun]
    incidents: list[Incident]
    checkpoints: dict[str, dict[str, float]]  # tier -> {"step", "time"} of its newest commit seen
    rate_steps_per_s: float | None
    eta_s: float | None  # at the current rate
    eta_at_pace_s: float | None  # at the run's pace so far, its interruptions and queue included
    accounting: bool  # Slurm's records were available
    # jobs that started after the run was complete and trained nothing (a resume of a finished run): their
    # node-seconds, not in `allocated_node_s`
    after_end_node_s: float = 0.0

    @property
    def unattributed_node_s(self) -> float:
        return self.allocated_node_s - sum(self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "unattributed_node_s": self.unattributed_node_s}

    def line(self) -> str:
        """The ledger in one log line."""
        if not self.allocated_node_s:
            return "goodput ledger: nothing allocated yet"
        shares = ", ".join(
            f"{name.replace('_', ' ')} {value / self.allocated_node_s:.1%}"
            for name, value in self.parts.items()
            if value > 0 and name != "productive"
        )
        queue = "no accounting: queue unknown" if self.queue_s is None else f"queue wait {_hms(self.queue_s)}"
        jobs = sum(j.counted for j in self.jobs)
        return (
            f"goodput {self.goodput:.1%} of {self.allocated_node_s / 3600:.3g} node-h allocated over "
            f"{jobs} job run(s), {len(self.incidents)} interruption(s); {shares}; {queue}; "
            f"step {self.steps_done}/{self.max_steps}, {self.steps_redone} redone"
        )

    def summary(self) -> dict[str, float]:
        """The figures a tracker keeps beside the loss (W&B summary, the "ledger" event)."""
        out = {
            "goodput": self.goodput,
            "allocated_node_h": self.allocated_node_s / 3600,
            "jobs": sum(j.counted for j in self.jobs),
            "incidents": len(self.incidents),
            "steps_redone": self.steps_redone,
        }
        if self.jobs and self.jobs[-1].goodput is not None:
            out["job_goodput"] = self.jobs[-1].goodput
        if self.queue_s is not None:
            out["queue_h"] = self.queue_s / 3600
            out["goodput_with_queue"] = self.goodput_with_queue
        for name, value in self.parts.items():
            out[f"{name}_share"] = value / self.allocated_node_s if self.allocated_node_s else 0.0
        return {k: v for k, v in out.items() if v is not None}


def build_ledger(
    *,
    events: list[dict[str, Any]],
    rows: Iterable[dict[str, Any] | Row],
    allocations: list[Allocation],
    accounting: bool,
    now: float,
    max_steps: int,
    completed: dict[str, Any] | None = None,
    resubmissions: list[dict[str, Any]] | None = None,
    failures: Callable[[str], list[dict[str, Any]]] = lambda key: [],
    hosts: Callable[[str], list[str]] = lambda key: [],
) -> Ledger:
    """The ledger of a run as of `now`.

    `events`: events.jsonl; `rows`: metrics.jsonl rows (or `Row`s), streamed once; `allocations`: the batch
    system's runs of the run's jobs (`accounting`), or `local_allocations` without; `completed`: COMPLETED.json;
    `resubmissions`: attempts.jsonl (the supervisor's decisions); `failures(key)` and `hosts(key)`: an
    attempt's failure records and its rank -> host map.
    """
    attempts = _attempts(events)
    runs = _job_runs(allocations)
    later_from = _later_from(attempts)
    checkpoints: dict[str, dict[str, float]] = {}
    recent: deque[Row] = deque(maxlen=RATE_WINDOW)
    steps_done = 0
    by_ready = sorted(attempts, key=lambda a: a.marks["ready"])
    current, index, previous = None, -1, None
    for raw in rows:
        row = raw if isinstance(raw, Row) else Row.of(raw)
        while index + 1 < len(by_ready) and by_ready[index + 1].marks["ready"] <= row.time:
            index, previous = index + 1, None
            current = by_ready[index]
        if current is None:
            continue  # a row before any attempt event: an older run's file (nothing to attribute it to)
        start = previous.time if previous is not None else current.marks["ready"]
        _count_row(current, row, start, lost=row.step > later_from[id(current)])
        previous = row
        steps_done = max(steps_done, row.step)
        recent.append(row)
        for tier, step in (row.commits or {}).items():
            checkpoints[tier] = {"step": step, "time": row.time}
    _detach_later_ends(by_ready, runs)
    run_of: dict[int, JobRun] = {}  # by id(attempt): a requeued job's runs restart their count at 0
    for run, after in itertools.zip_longest(runs, runs[1:]):
        inside = [a for a in by_ready if _in_run(a, run, now)]
        seen = [
            float(e["time"])
            for e in events
            if run.start - SLACK_S <= float(e.get("time", 0.0)) and (after is None or float(e["time"]) < after.start)
        ]
        _fill_run(run, inside, completed, now, lambda a: len(set(hosts(a.key))), max(seen, default=run.start))
        run_of.update((id(a), run) for a in inside)
    _set_aside_after_end(runs, by_ready, max_steps)
    incidents = _incidents(by_ready, run_of, resubmissions or [], failures, hosts, max_steps)
    for incident in incidents:  # a run that ended with an interruption: why, in its row of the job table
        run = next((r for r in runs if r.attempts and r.attempts[-1] == incident.attempt), None)
        if run is not None and incident.kind != "restart in the allocation" and run.ended in _WORDS.values():
            run.ended += ": " + incident.cause.removeprefix(f"{run.state}: ")
    counted = [r for r in runs if r.counted]
    parts = {p: sum(r.parts.get(p, 0.0) for r in counted) for p in PARTS}
    allocated = sum(r.node_s for r in counted)
    productive = parts["productive"]
    between = [(r.queue_s, r.nodes) for r in counted[1:] if r.queue_s is not None]  # (seconds, nodes)
    queue = sum(s for s, _ in between) if accounting else None
    waited = sum(s * nodes for s, nodes in between)
    rate = _rate(recent)
    left = max(0, max_steps - steps_done)
    eta = left / rate if rate else None
    span = sum(r.wall_s for r in counted) + (queue or 0.0)
    pace = left * span / steps_done if steps_done else None
    return Ledger(
        now=now,
        max_steps=max_steps,
        steps_done=steps_done,
        steps_redone=sum(a.lost_steps for a in attempts),
        allocated_node_s=allocated,
        wall_s=sum(r.wall_s for r in counted),
        parts=parts,
        queue_s=queue,
        first_queue_s=runs[0].queue_s if runs and accounting else None,
        goodput=productive / allocated if allocated else None,
        goodput_with_queue=productive / (allocated + waited) if accounting and allocated else None,
        jobs=runs,
        incidents=incidents,
        checkpoints=checkpoints,
        rate_steps_per_s=rate,
        eta_s=eta,
        eta_at_pace_s=pace,
        accounting=accounting,
        after_end_node_s=sum(r.node_s for r in runs if not r.counted),
    )


def _attempts(events: list[dict[str, Any]]) -> list[Attempt]:
    """The attempts that trained (each wrote its "attempt" event after its first step), with the tier it
    resumed from (its "resume" event comes first) and how it ended on its own ("stop", "attempt_end"). A
    "resume" starts a new attempt: an end after it and before that attempt's own "attempt" event is the end
    of one that trained no step (a resume of a finished run loads the last step and ends at once), not the
    end of the attempt before it."""
    found: list[Attempt] = []
    resumed: dict[str, Any] | None = None
    for e in events:
        if e["event"] == "resume":
            resumed = e
        elif e["event"] == "attempt" and all(m in e for m in MARKS):
            found.append(
                Attempt(
                    job_id=str(e["job_id"]),
                    restart=int(e["restart"]),
                    from_step=int(e["from_step"]),
                    requeue=int(e.get("requeue", 0)),
                    marks={m: float(e[m]) for m in MARKS},
                    tier=resumed["tier"] if resumed and resumed["step"] == e["from_step"] else None,
                )
            )
            resumed = None
        elif e["event"] in ("stop", "attempt_end") and (resumed is not None or not found):
            continue  # an attempt that trained nothing (its job's end is found from its events' times)
        elif e["event"] == "stop":
            found[-1].stop = e
        elif e["event"] == "attempt_end":
            found[-1].end = e
    return found


def _detach_later_ends(attempts: list[Attempt], runs: list[JobRun]) -> None:
    """An attempt's "stop" or "attempt_end" written after a later job of the run started is that job's (one
    that never trained and wrote no "resume", a fresh start): it leaves the attempt."""
    for a in attempts:
        for name in ("stop", "end"):
            e = getattr(a, name)
            if e is not None and any(
                r.job_id != a.job_id and a.marks["process_started"] < r.start <= float(e["time"]) for r in runs
            ):
                setattr(a, name, None)


def _later_from(attempts: list[Attempt]) -> dict[int, float]:
    """Per attempt: the lowest step a later attempt resumed from (its steps above it were redone or are lost)."""
    ordered = sorted(attempts, key=lambda a: a.marks["process_started"])
    out, lowest = {}, float("inf")
    for a in reversed(ordered):
        out[id(a)] = lowest
        lowest = min(lowest, a.from_step)
    return out


def _count_row(attempt: Attempt, row: Row, start: float, lost: bool) -> None:
    """One step's time since the previous row (or the attempt's start of training) into the attempt's parts."""
    span = max(0.0, row.time - start)
    parts = attempt.parts
    if lost:
        inside = {"lost": span}
        attempt.lost_steps += 1
        attempt.lost_s += span
    else:
        inside = {
            "productive": max(0.0, row.step_s - row.data_wait_s - row.compile_s),
            "data_wait": row.data_wait_s,
            "compile": row.compile_s,
            "checkpoint": row.ckpt_s,
            "evaluation": row.eval_s,
        }
        known = sum(inside.values())
        if known > span > 0:  # a clock step, or a row written before its marks: keep the shares, fit the span
            inside = {k: v * span / known for k, v in inside.items()}
        inside["step_overhead"] = max(0.0, span - known)
    for name, value in inside.items():
        parts[name] = parts.get(name, 0.0) + value
    attempt.spans_s += span
    if span > attempt.floor:  # one of the longest rows: where a suspension may lie
        longest = attempt.longest
        if len(longest) < LONGEST_ROWS:
            heapq.heappush(longest, (span, row.step, inside))
        else:
            heapq.heapreplace(longest, (span, row.step, inside))
        if len(longest) == LONGEST_ROWS:
            attempt.floor = longest[0][0]
    attempt.first_row = attempt.first_row or row
    attempt.last_row = row
    attempt.steps += 1


def _job_runs(allocations: list[Allocation]) -> list[JobRun]:
    """One JobRun per allocation that started, oldest first, with the queue wait before each. A job that lost a
    node and went on smaller (sbatch --no-kill, elastic.min_nodes) is accounted as a RESIZING record and a new
    one from that moment on its fewer nodes: one run, its node count changing (`pieces`)."""
    runs: list[JobRun] = []
    count: dict[str, int] = {}
    for a in sorted(allocations, key=lambda x: (x.start is None, x.start or x.submit or 0)):
        if a.start is None:
            continue  # still pending: no allocation yet
        before = runs[-1] if runs else None
        suspended = a.suspended_s * max(1, a.nodes)
        if before is not None and before.job_id == a.job_id and before.state == "RESIZING":
            before.pieces.append((a.start, a.end, max(1, a.nodes)))
            before.state, before.end = a.state, a.end
            before.suspended_node_s += suspended
            continue
        runs.append(
            JobRun(
                job_id=a.job_id,
                run=count.get(a.job_id, 0),
                state=a.state,
                nodes=max(1, a.nodes),
                node_list=a.node_list,
                submit=a.submit,
                eligible=a.eligible,
                start=a.start,
                end=a.end,
                pieces=[(a.start, a.end, max(1, a.nodes))],
                suspended_node_s=suspended,
            )
        )
        count[a.job_id] = count.get(a.job_id, 0) + 1
    for before, run in zip([None, *runs], runs):
        since = before.end if before is not None and before.end is not None else run.submit
        run.queue_s = None if since is None else max(0.0, run.start - since)
    return runs


def local_allocations(jobs: list[dict[str, Any]], alive: Callable[[str], bool], nodes: int = 1) -> list[Allocation]:
    """A local run's jobs as allocations: each starts when submitted (no queue) and is open while its process
    lives; the end of one that is gone is the last thing it recorded (`build_ledger` finds it: state ENDED)."""
    return [
        Allocation(
            job_id=str(j["job_id"]),
            state="RUNNING" if alive(str(j["job_id"])) else "ENDED",
            submit=j["submitted"],
            eligible=j["submitted"],
            start=j["submitted"],
            end=None,
            nodes=nodes,
        )
        for j in jobs
    ]


def _in_run(attempt: Attempt, run: JobRun, now: float) -> bool:
    end = run.end if run.end is not None else now
    return attempt.job_id == run.job_id and run.start - SLACK_S <= attempt.marks["process_started"] <= end + SLACK_S


def _fill_run(
    run: JobRun,
    attempts: list[Attempt],
    completed: dict[str, Any] | None,
    now: float,
    nodes_of: Callable[[Attempt], int] = lambda a: 0,
    seen: float | None = None,
) -> None:
    """The run's parts: its start-up, its attempts' rows, the gaps between them, and its end. `nodes_of(a)`:
    the nodes attempt `a` trained on (0: unknown, all of the allocation's); `seen`: the newest record of the
    run (an event of an attempt that never trained, too)."""
    run.attempts = [a.key for a in attempts]
    last = attempts[-1] if attempts else None
    if run.state == "ENDED" and run.end is None:  # no accounting: it lasted as long as it recorded things
        run.end = max([run.start, *(_last_seen(a) for a in attempts), *([seen] if seen is not None else [])])
    live = run.end is None
    end = run.end if run.end is not None else now
    run.wall_s = max(0.0, end - run.start)
    pieces = [(a, b if b is not None else end, n) for a, b, n in run.pieces] or [(run.start, end, run.nodes)]
    pieces[-1] = (pieces[-1][0], end, pieces[-1][2])  # a local run's end is found only now

    def held(a: float, b: float) -> float:
        """Node-seconds the job held from a to b."""
        return sum(n * max(0.0, min(b, hi) - max(a, lo)) for lo, hi, n in pieces)

    def nodes_over(a: float, b: float) -> float:
        return held(a, b) / (b - a) if b > a else held(a - 1e-6, a + 1e-6) / 2e-6

    run.node_s = held(run.start, end)
    parts: dict[str, float] = {}

    def add(name: str, node_s: float) -> None:
        parts[name] = parts.get(name, 0.0) + node_s

    t = run.start
    widths: dict[int, tuple[float, float]] = {}  # id(attempt) -> (nodes held, nodes trained) over its steps
    for a in attempts:
        began = max(t, min(a.marks["process_started"], end))
        add("startup" if a is attempts[0] else "recovery", held(t, began))  # the job's start, or a restart
        ready = max(began, min(a.marks["ready"], end))
        trained = nodes_of(a)
        starting = nodes_over(began, ready)
        share = min(1.0, trained / starting) if trained and starting else 1.0  # the rest: hot spares, waiting
        add("startup", held(began, ready) * share)
        add("spare", held(began, ready) * (1.0 - share))
        rows_end = max(began, min(end, a.last_row.time if a.last_row else a.marks["ready"]))
        width = nodes_over(ready, rows_end)  # a job resizes between attempts, not during one's steps
        train = min(width, trained) if trained else width
        widths[id(a)] = (width, train)
        for name, value in a.parts.items():
            add(name, value * train)
        add("spare", sum(a.parts.values()) * (width - train))
        t = rows_end
    if last is None:  # never trained: all of it was getting started (or failing to)
        add("startup", held(t, end))
        t = end
    tail = max(0.0, end - t)
    saved = min(tail, float((last.end or {}).get("save_s", 0.0))) if last is not None else 0.0
    finished = last is not None and _finished(last, run, completed)
    add("checkpoint", held(t, t + saved))
    ended_itself = last is not None and (last.stop is not None or last.end is not None)
    after = "shutdown" if finished else "pending" if live and not ended_itself else "recovery"
    add(after, held(t + saved, end))
    if run.suspended_node_s > 0:
        _take_suspension(run.suspended_node_s, attempts, widths, parts, run.node_s)
    run.parts = parts
    run.goodput = run.parts.get("productive", 0.0) / run.node_s if run.node_s else None
    steps = [(a.first_row.step, a.last_row.step) for a in attempts if a.first_row and a.last_row]
    run.steps = (min(s for s, _ in steps), max(e for _, e in steps)) if steps else None
    run.ended = _how_ended(run, live, finished)


def _take_suspension(
    node_s: float,
    attempts: list[Attempt],
    widths: dict[int, tuple[float, float]],
    parts: dict[str, float],
    allocated: float,
) -> None:
    """Move `node_s` suspended node-seconds from where they were counted into "suspended": first from the rows
    that ran longest past their attempt's typical row (each row's largest part first: a step's own time for a
    suspension inside a step; the hot spares' time over the same seconds), then, for what no row holds, from
    the parts outside the steps."""
    left = min(node_s, allocated)

    def move(name: str, amount: float) -> float:
        amount = max(0.0, min(amount, parts.get(name, 0.0)))
        parts[name] = parts.get(name, 0.0) - amount
        parts["suspended"] = parts.get("suspended", 0.0) + amount
        return amount

    candidates = []
    for a in attempts:
        if a.longest and id(a) in widths:
            typical = a.typical_span()
            candidates += [(span - typical, inside, widths[id(a)]) for span, _, inside in a.longest]
    for excess, inside, (width, train) in sorted(candidates, key=lambda c: -c[0]):
        if left <= 1e-9 or excess <= 0 or width <= 0:
            break
        seconds = min(left / width, excess)
        rest = seconds * train
        for name in sorted(inside, key=lambda n: -inside[n]):  # the part the suspension inflated is the largest
            rest -= move(name, min(rest, inside[name] * train))
            if rest <= 1e-12:
                break
        moved = seconds * train - rest
        moved += move("spare", seconds * (width - train))  # the hot spares were suspended over those seconds too
        left -= moved
    if left > 1e-9:
        outside = sum(max(0.0, parts.get(p, 0.0)) for p in OUTSIDE_STEPS)
        pools = OUTSIDE_STEPS if outside >= left else tuple(p for p in PARTS if p != "suspended")
        pool = sum(max(0.0, parts.get(p, 0.0)) for p in pools)
        share = min(1.0, left / pool) if pool > 0 else 0.0
        for name in pools:
            move(name, max(0.0, parts.get(name, 0.0)) * share)


def _set_aside_after_end(runs: list[JobRun], attempts: list[Attempt], max_steps: int) -> None:
    """Job runs that started after an attempt had completed the run, and trained nothing themselves (a resume
    of a finished run, which loads the last step and ends): no part of the run's training."""
    done_at = min(
        (
            _last_seen(a)
            for a in attempts
            if (a.end or {}).get("how") == "completed" or (a.last_row is not None and a.last_row.step >= max_steps)
        ),
        default=None,
    )
    for run in runs:
        if done_at is not None and not run.attempts and run.start >= done_at and run.end is not None:
            run.counted = False
            run.ended = "nothing to train: the run was complete"


def _last_seen(a: Attempt) -> float:
    return max(
        [
            a.marks["first_step"],
            *(float(e["time"]) for e in (a.stop, a.end) if e),
            *([a.last_row.time] if a.last_row else []),
        ]
    )


def _finished(a: Attempt, run: JobRun, completed: dict[str, Any] | None) -> bool:
    """This attempt trained the run to its last step: it said so, or COMPLETED.json names its job and step (a
    requeued job has several runs under the one id)."""
    if (a.end or {}).get("how") == "completed":
        return True
    return (
        completed is not None
        and completed.get("job_id") == run.job_id
        and a.last_row is not None
        and a.last_row.step >= int(completed["step"])
    )


_WORDS = {
    "COMPLETED": "completed",
    "REQUEUED": "requeued",
    "PREEMPTED": "preempted",
    "TIMEOUT": "time limit",
    "NODE_FAIL": "node failure",
    "FAILED": "failed",
    "CANCELLED": "cancelled",
    "ENDED": "ended",
    "OUT_OF_MEMORY": "out of memory",
    "BOOT_FAIL": "boot failure",
    "DEADLINE": "deadline",
}


def _how_ended(run: JobRun, live: bool, finished: bool) -> str:
    """In words; an interruption's cause is added once the incidents are known (`build_ledger`)."""
    if live:
        return "running"
    if finished:
        return "finished the run"
    return _WORDS.get(run.state, run.state.lower() or "ended")


def _incidents(
    attempts: list[Attempt],
    run_of: dict[int, JobRun],
    resubmissions: list[dict[str, Any]],
    failures: Callable[[str], list[dict[str, Any]]],
    hosts: Callable[[str], list[str]],
    max_steps: int,
) -> list[Incident]:
    """Every attempt that ended before the run's end, and the way back to the next one's first step."""
    out = []
    trained = [a for a in attempts if a.last_row is not None]
    for a, nxt in itertools.zip_longest(trained, trained[1:]):
        run = run_of.get(id(a))
        assert a.last_row is not None  # `trained`
        if a.last_row.step >= max_steps or (run is not None and _finished(a, run, None)):
            continue
        if nxt is None and (run is None or run.end is None and a.stop is None):
            continue  # the newest attempt, still training
        out.append(_incident(a, nxt, run_of, resubmissions, failures, hosts))
    return out


def _incident(
    a: Attempt,
    nxt: Attempt | None,
    run_of: dict[int, JobRun],
    resubmissions: list[dict[str, Any]],
    failures: Callable[[str], list[dict[str, Any]]],
    hosts: Callable[[str], list[str]],
) -> Incident:
    run, next_run = run_of.get(id(a)), run_of.get(id(nxt)) if nxt else None
    last = a.last_row
    assert last is not None  # only attempts that trained have incidents (`_incidents`)
    until = nxt.marks["process_started"] if nxt is not None else float("inf")  # a requeued job reuses its keys
    records = [r for r in failures(a.key) if last.time - SLACK_S <= r["time"] <= until]
    own = [r for r in records if not r.get("peer")]
    noticed = a.stop["time"] if a.stop else (min(r["time"] for r in records) if records else None)
    leaves = nxt is None or next_run is not run
    if not leaves:
        kind = "restart in the allocation"
    elif nxt is not None and nxt.job_id == a.job_id:
        kind = "requeue"
    else:
        kind = "resubmission"
    # No rank failed on its own: the ranks that left no record at all are the ones that died (a lost node),
    # not those that saw their peer go (as the supervisor decides: hpctrain.records.failures.diagnose)
    by_rank, wrote = hosts(a.key), {r["rank"] for r in records}
    silent = [(rank, host) for rank, host in enumerate(by_rank) if rank not in wrote] if records and not own else []
    cause = _cause(a, run, own or records, resubmissions, hosts, nxt, leaves, silent)
    saved = float((a.end or {}).get("save_s", 0.0)) if a.stop else 0.0
    parts: dict[str, float | None] = {"detection": None if noticed is None else max(0.0, noticed - last.time)}
    after = (noticed if noticed is not None else last.time) + saved
    if a.stop:
        parts["stop save"] = saved
    if leaves:
        left = run.end if run is not None and run.end is not None else None
        parts["teardown"] = None if left is None else max(0.0, left - after)
        parts["queue"] = next_run.queue_s if next_run is not None else None
        parts["restart"] = (nxt.marks["process_started"] - next_run.start) if nxt and next_run else None
    else:
        assert nxt is not None  # `leaves` otherwise
        parts["teardown, rendezvous, spawn"] = nxt.marks["process_started"] - after
    load = {}
    if nxt is not None:
        for label, (m0, m1) in zip(LOAD_PARTS, itertools.pairwise(MARKS[:-1])):
            load[label] = nxt.marks[m1] - nxt.marks[m0]
        parts["load"] = nxt.marks["ready"] - nxt.marks["process_started"]
        parts["first step"] = nxt.marks["first_step"] - nxt.marks["ready"]
    lost = [s for s in range(nxt.from_step + 1, last.step + 1)] if nxt else []
    return Incident(
        attempt=a.key,
        job_id=a.job_id,
        restart=a.restart,
        kind=kind,
        cause=cause,
        last_step=last.step,
        last_progress=last.time,
        next_job=nxt.key if nxt else None,
        resumed_from=nxt.from_step if nxt else None,
        tier=nxt.tier if nxt else None,
        lost_steps=len(lost),
        lost_s=a.lost_s if nxt else 0.0,
        parts=parts,
        load=load,
        total_s=nxt.marks["first_step"] - last.time if nxt else None,
    )


def _cause(
    a: Attempt,
    run: JobRun | None,
    records: list[dict[str, Any]],
    resubmissions: list[dict[str, Any]],
    hosts: Callable[[str], list[str]],
    nxt: Attempt | None,
    leaves: bool,
    silent: Sequence[tuple[int, str]] = (),
) -> str:
    """In words: the signal, the root error, or what the batch system saw; and the nodes left out after it.
    `silent`: (rank, host) of the ranks that left no record when every record is a peer's (they died, the
    others only saw them go)."""
    if a.stop:
        why = str(a.stop.get("reason", "a stop signal"))
    elif records:
        r = records[0]
        why = f"{r['type']} at step {r['step']} on {r['host']} (rank {r['rank']}): {r['message']}"
        if silent:
            where = sorted({host for _, host in silent})
            ranks = ",".join(str(rank) for rank, _ in silent)
            why = (
                f"{','.join(where)} (rank {ranks}) stopped without a failure record (killed, or its node died); "
                f"the other ranks saw peer errors, first {why}"
            )
    elif run is not None and run.state not in ("RUNNING", "COMPLETED", ""):
        why = f"{run.state} (no failure record: a node or the whole job was killed)"
    else:
        why = "no failure record (a process was killed)"
    other_job = nxt is None or nxt.job_id != a.job_id
    decision = next((d for d in resubmissions if d.get("job_id") == a.job_id), None) if other_job else None
    gone = sorted(set(hosts(a.key)) - set(hosts(nxt.key))) if nxt is not None and not leaves else []
    if (
        leaves
        and not a.stop
        and records
        and run is not None
        and run.state not in ("RUNNING", "COMPLETED", "PENDING", "ENDED", "")
    ):
        why = f"{run.state}: {why}"  # what the batch system saw, then the root error the ranks recorded
    if decision and decision.get("excluded"):
        why += f"; resubmitted as {decision.get('resubmitted_as')} excluding {','.join(decision['excluded'])}"
    elif decision:
        why += f"; resubmitted as {decision.get('resubmitted_as')}"
    if gone:
        why += f"; went on without {','.join(gone)}"
    return why


def _rate(recent: deque[Row]) -> float | None:
    """Steps per second over the newest rows of the latest attempt (rows of an earlier attempt break the run)."""
    rows = list(recent)
    for i in range(len(rows) - 1, 0, -1):
        if rows[i].step != rows[i - 1].step + 1:
            rows = rows[i:]
            break
    if len(rows) < 2 or rows[-1].time <= rows[0].time:
        return None
    return (rows[-1].step - rows[0].step) / (rows[-1].time - rows[0].time)


def _hms(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
