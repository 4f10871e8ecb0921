"""Where a run's allocated time went, measured from its own records: the goodput ledger.

The model (model.py) predicts goodput from costs; this measures it, for one run across all its jobs. Every
second of every allocation goes to exactly one part, node-weighted (a second of a 512-node job is 512
node-seconds):

- productive: inside the timed steps that count (each step once: its last run), less their wait for data
  and their compilation;
- data_wait: those steps' wait for their batches (hpctrain.data.loader.BatchReader);
- compile: those steps' time in torch.compile (parallel.compile: each attempt's first steps, from the
  node-local cache after a restart in the allocation; recompilations): hpctrain.parallel.compile.CompileClock;
- quorum: with replica groups (recovery=replicas|diloco), those steps' time in torchft's quorum (the lighthouse's
  round trip, waiting for the other groups; DiLoCo: once a round);
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
- replica_out: a replica group's nodes while the group is out of the quorum and another group trains: from the
  end of its last step before a failure to its first step back (detection, its workers' restart and start-up,
  its join and its heal from a peer), or to the job's end where it did not come back. The same seconds of a
  group while no group trains are recovery (or startup), as in any job;
- shutdown: the end of the job that finished the run, after its final save;
- pending: a live job's time since its last step (the step in flight, or a failure not yet recovered);
- spare: the hot spare nodes' time while the others start and train (cluster.spare_nodes): the nodes an
  allocation holds beyond those an attempt trains on (its rank -> host map), at most as many as the job's
  spares. A spare that takes a dead node's place trains from the next attempt on; around a failure
  (recovery) every node counts there;
- lost_node: the other nodes the allocation holds while an attempt starts and trains without them: a node
  that trained in an earlier attempt of the allocation and no more (dead, hung, condemned), held until Slurm
  shrinks the job or the job ends, or one that never joined and is no spare. Part of the cost of the
  interruption that took it out (`Incident.lost_node_s`);
- suspended: time the batch system held the job suspended (`scontrol suspend`: Slurm's `Suspended`), every
  node of it. Its processes were stopped, their clocks ran on: the steps (or saves) it fell in took that much
  longer. Accounting gives only the total, so it is taken from the rows that ran longest past the attempt's
  typical row (a suspension lies inside one row's span), the rest from start-up, recovery, pending, shutdown.

The allocation ends where the batch system's accounting says: a cancelled job's end is the moment of the
`scancel`, and its processes go on for the step in flight and the save at the stop until Slurm kills them
(KillWait). What they did after that end is clipped from the parts (they sum to the allocation, as sacct
reports it) and reported beside, `past_end_node_s`.

Replica groups: each group keeps its own records (group 0 the run directory's, group g `replicas/g<g>/`: events,
metrics, host maps, failure records). The allocation is R slices of a group's nodes, each accounted from its
group's records as above (a group's steps are productive while it trains, whatever the others do), and the
nodes beyond them, the job's hot spares (spare) and the nodes the groups lost (lost_node: trained in a group
before, in none now). A group's steps are not redone after a heal: it goes on from the step it healed to (its
"replica_heal" event), not from its own checkpoint. DiLoCo: the steps of a round that was dropped, and of the
round a group was in when it failed, are lost (their work was thrown away). Every period a group was out is
a `ReplicaIncident` (the steps the others took without it, its samples skipped, its heal, its cost); the
run's interruptions (`Incident`) are those that stopped every group (the one that trained last tells).

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
from dataclasses import asdict, dataclass, field, replace
from functools import partial
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
    "quorum",
    "checkpoint",
    "evaluation",
    "step_overhead",
    "lost",
    "startup",
    "recovery",
    "replica_out",
    "shutdown",
    "pending",
    "spare",
    "lost_node",
    "suspended",
)
# Parts a suspension found in no row is taken from (it fell outside the steps), in proportion to their size.
OUTSIDE_STEPS = ("startup", "recovery", "replica_out", "pending", "shutdown")
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
    # replica groups (recovery=replicas|diloco): the groups in the step's quorum, and the quorum call's seconds
    # inside step_s (DiLoCo: the round's, repeated on each row of the round)
    participants: int | None = None
    quorum_s: float = 0.0

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
            participants=m.get("participants"),
            quorum_s=m.get("quorum_s", 0.0),
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
    until: float | None = None  # its allocation's recorded end: its rows' time after it is not counted
    past_end_s: float = 0.0  # its rows' seconds after `until`
    lost_node_by_host: dict[str, float] = field(default_factory=dict)  # node-seconds of nodes gone before it

    requeue: int = 0  # the job's run it belongs to (a requeued job keeps its id)
    # replica groups: its "replica_heal" at its first quorum (it went on from the peers' step, not from_step)
    heal: dict[str, Any] | None = None
    first_quorum_s: float = 0.0  # its first row's quorum call, booked as quorum (a join, a heal)
    train_nodes: float = 0.0  # the nodes it trained on (`_fill_run`)
    out_before_node_s: float = 0.0  # replica_out booked before its first step back (its group's outage)
    out_after_node_s: float = 0.0  # replica_out after its last step, to its allocation's end
    round_parts: dict[str, float] = field(default_factory=dict)  # DiLoCo: its rows' parts since the last round
    round_steps: int = 0
    thrown_steps: int = 0  # DiLoCo: its steps of the round it failed in (lost: they never reached the others)

    @property
    def key(self) -> str:
        """Its failure records' folder (hpctrain.records.failures.attempt_key)."""
        return attempt_key(self.job_id, self.restart, self.requeue)

    @property
    def resumed(self) -> int:
        """The step it went on from: the peers' when it healed at its first quorum, else its checkpoint's."""
        return int(self.heal["step"]) if self.heal is not None else self.from_step

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
    pieces: list[tuple[float, float | None, float]] = field(default_factory=list)
    ended: str = ""  # how it ended, in words
    queue_s: float | None = None  # the wait before it started: after the previous run ended, or its submission
    suspended_node_s: float = 0.0  # the batch system held it suspended (each piece at its nodes)
    counted: bool = True  # False: it started after the run was complete and trained nothing (not the run's)
    wall_s: float = 0.0
    node_s: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # node-seconds
    # node-seconds its processes worked after its recorded end (a step in flight, the save at a scancel)
    past_end_node_s: float = 0.0
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
    # node-seconds the allocation held the nodes it took out of training while the others went on (until Slurm
    # shrank the job, or its end): the "lost_node" part it caused
    lost_node_s: float = 0.0
    group: int | None = None  # replica groups: the group whose attempt ended (the last to train in its job)


@dataclass(frozen=True)
class ReplicaSetup:
    """A run's replica groups (recovery=replicas|diloco, docs/replicas.md), from its config."""

    groups: int
    nodes: int  # per group
    group_batch: int  # sequences a group trains per step (train.global_batch / groups)
    sync_every: int = 1  # steps per quorum: 1, or DiLoCo's round (recovery.sync_every)


@dataclass
class GroupRecords:
    """One replica group's records (group g > 0: `replicas/g<g>/` of the run directory), as `build_ledger` takes
    group 0's."""

    events: list[dict[str, Any]]
    rows: Iterable[dict[str, Any] | Row]
    failures: Callable[[str], list[dict[str, Any]]] = lambda key: []
    hosts: Callable[[str], list[str]] = lambda key: []


@dataclass
class ReplicaIncident:
    """One period a replica group was out of the quorum: from the end of its last step to its first step back
    (or the end of its job, or now), and what it cost."""

    group: int
    attempt: str  # the attempt that ended (its failure records' folder, in the group's folder)
    # "restart in the allocation", "requeue", "resubmission" (how it came back); "out" (not back yet), "out to
    # the job's end" (it never came back in that job)
    kind: str
    cause: str
    last_step: int  # its last step before it went out
    out_from: float  # the end of that step
    out_until: float | None  # the start of its first step back (its join and heal included); None: not back
    out_s: float  # out_from to out_until (or to its job's end, or now)
    next_attempt: str | None
    rejoined_at: int | None  # its first step back in the quorum
    steps_without: tuple[int, int] | None  # the first and last step the other groups took without it
    steps_without_n: int
    fewest: int | None  # the fewest groups in those steps' quorums
    samples_skipped: int  # its share of those steps' samples, and of its own steps thrown away (lost)
    heal_s: float | None  # its state's transfer from a peer; None: it did not heal (not back, or from disk)
    healed_from: int | None  # the step it was at when it healed
    lost_steps: int  # its own steps thrown away (a DiLoCo round in flight; steps redone after a resume from disk)
    node_s: float  # the cost: its nodes' replica_out over the outage, and its lost steps
    lost_node_s: float = 0.0  # the nodes it lost that the allocation still held (their lost_node time)


@dataclass
class ReplicaTotals:
    """A replica run's quorum figures (the metrics' participants, the groups' heal and drop events)."""

    groups: int
    nodes_per_group: int
    sync_every: int
    steps: int  # steps trained (the newest)
    steps_short: int  # steps taken with fewer than every group
    fewest: int | None  # the fewest groups in a step's quorum
    samples_skipped: int  # samples of the missing groups, and of the rounds dropped (DiLoCo), never trained on
    heals: int
    heal_s: float
    rounds_dropped: int
    quorum_node_s: float
    replica_out_node_s: float


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
    # what the run's processes did after their allocations' recorded ends (not in `allocated_node_s`)
    past_end_node_s: float = 0.0
    replicas: ReplicaTotals | None = None  # replica groups only
    replica_incidents: list[ReplicaIncident] = field(default_factory=list)

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
        line = (
            f"goodput {self.goodput:.1%} of {self.allocated_node_s / 3600:.3g} node-h allocated over "
            f"{jobs} job run(s), {len(self.incidents)} interruption(s); {shares}; {queue}; "
            f"step {self.steps_done}/{self.max_steps}, {self.steps_redone} redone"
        )
        if self.replicas is not None:
            r = self.replicas
            line += (
                f"; {r.groups} replica groups: {len(self.replica_incidents)} outage(s), {r.steps_short} step(s) "
                f"with fewer groups, {r.samples_skipped} samples skipped"
            )
        return line

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
        if self.replicas is not None:
            r = self.replicas
            out |= {
                "replica_groups": r.groups,
                "replica_incidents": len(self.replica_incidents),
                "replica_out_node_s": r.replica_out_node_s,
                "replica_steps_short": r.steps_short,
                "replica_fewest": r.fewest,
                "samples_skipped": r.samples_skipped,
                "heals": r.heals,
                "heal_s": r.heal_s,
                "quorum_node_s": r.quorum_node_s,
                "rounds_dropped": r.rounds_dropped,
            }
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
    spares: int | None = None,
    replicas: ReplicaSetup | None = None,
    groups: Sequence[GroupRecords] = (),
) -> Ledger:
    """The ledger of a run as of `now`.

    `events`: events.jsonl; `rows`: metrics.jsonl rows (or `Row`s), streamed once; `allocations`: the batch
    system's runs of the run's jobs (`accounting`), or `local_allocations` without; `completed`: COMPLETED.json;
    `resubmissions`: attempts.jsonl (the supervisor's decisions); `failures(key)` and `hosts(key)`: an
    attempt's failure records and its rank -> host map; `spares`: the job's hot spares (cluster.spare_nodes;
    None: unknown, every idle node that never trained in its allocation counts as one). With replica groups
    (`replicas`), all of these are group 0's and `groups` holds the records of groups 1 to R - 1.
    """
    runs = _job_runs(allocations)
    records = [GroupRecords(events, rows, failures, hosts), *(groups if replicas is not None else ())]
    every, r = (replicas.sync_every, replicas.groups) if replicas is not None else (1, 1)
    counted = [_count_group(g, group, runs, now, r, every) for g, group in enumerate(records)]
    everyone = sorted((a for c in counted for a in c.attempts), key=lambda a: a.marks["ready"])
    run_of: dict[int, JobRun] = {}  # by id(attempt): a requeued job's runs restart their count at 0
    lost_by_host: dict[int, dict[str, float]] = {}  # by id(run): replica groups' lost nodes' held seconds
    for run, after in itertools.zip_longest(runs, runs[1:]):
        inside = [[a for a in c.attempts if _in_run(a, run, now)] for c in counted]
        seen = [
            float(e["time"])
            for r in records
            for e in r.events
            if run.start - SLACK_S <= float(e.get("time", 0.0)) and (after is None or float(e["time"]) < after.start)
        ]
        newest = max(seen, default=run.start)
        if replicas is None:
            _fill_run(run, inside[0], completed, now, lambda a: hosts(a.key), newest, spares)
        else:
            lost_by_host[id(run)] = _fill_replica_run(run, inside, records, completed, now, newest, spares, replicas)
        run_of.update((id(a), run) for a in itertools.chain(*inside))
    _set_aside_after_end(runs, everyone, max_steps)
    incidents: list[Incident]
    replica_incidents: list[ReplicaIncident] = []
    if replicas is None:
        pairs = _incidents(counted[0].attempts, run_of, resubmissions or [], failures, hosts, max_steps)
        incidents = [i for _, _, i in pairs]
    else:
        incidents, replica_incidents = _replica_incidents(
            counted, records, run_of, resubmissions or [], max_steps, now, replicas, lost_by_host
        )
    for incident in incidents:  # a run that ended with an interruption: why, in its row of the job table
        run = next((r for r in runs if r.attempts and r.attempts[-1] == incident.attempt), None)
        if run is not None and incident.kind != "restart in the allocation" and run.ended in _WORDS.values():
            run.ended += ": " + incident.cause.removeprefix(f"{run.state}: ")
    counted_runs = [r for r in runs if r.counted]
    parts = {p: sum(r.parts.get(p, 0.0) for r in counted_runs) for p in PARTS}
    allocated = sum(r.node_s for r in counted_runs)
    productive = parts["productive"]
    between = [(r.queue_s, r.nodes) for r in counted_runs[1:] if r.queue_s is not None]  # (seconds, nodes)
    queue = sum(s for s, _ in between) if accounting else None
    waited = sum(s * nodes for s, nodes in between)
    steps_done = max(c.steps_done for c in counted)
    newest_group = max(counted, key=lambda c: c.recent[-1].time if c.recent else float("-inf"))
    rate = _rate(newest_group.recent)
    left = max(0, max_steps - steps_done)
    eta = left / rate if rate else None
    span = sum(r.wall_s for r in counted_runs) + (queue or 0.0)
    pace = left * span / steps_done if steps_done else None
    checkpoints: dict[str, dict[str, float]] = {}
    for c in counted:  # the newest any group committed, tier by tier
        for tier, commit in c.checkpoints.items():
            if commit["step"] > checkpoints.get(tier, {"step": -1.0})["step"]:
                checkpoints[tier] = commit
    return Ledger(
        now=now,
        max_steps=max_steps,
        steps_done=steps_done,
        steps_redone=max(sum(a.lost_steps for a in c.attempts) for c in counted),
        allocated_node_s=allocated,
        wall_s=sum(r.wall_s for r in counted_runs),
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
        past_end_node_s=sum(r.past_end_node_s for r in counted_runs),
        replicas=None if replicas is None else _replica_totals(counted, replicas, parts, replica_incidents),
        replica_incidents=replica_incidents,
    )


@dataclass
class _Group:
    """One group's attempts with its rows counted (a run without replica groups is one group)."""

    number: int
    attempts: list[Attempt]  # by their start of training
    steps_done: int = 0
    recent: deque[Row] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    checkpoints: dict[str, dict[str, float]] = field(default_factory=dict)
    short: list[Row] = field(default_factory=list)  # its rows of steps taken with fewer than every group
    dropped: list[tuple[int, int]] = field(default_factory=list)  # DiLoCo rounds dropped: (first step, last step)
    heals: list[dict[str, Any]] = field(default_factory=list)  # its "replica_heal" events


def _count_group(number: int, records: GroupRecords, runs: list[JobRun], now: float, groups: int, every: int) -> _Group:
    """A group's attempts (each with the heal it began with) and its rows counted into them, streamed once.
    `groups`: the replica groups (1 without); `every`: the steps per quorum (DiLoCo's round)."""
    attempts = _attempts(records.events)
    _detach_later_ends(attempts, runs)
    for a in attempts:  # rows past the end of their allocation as accounted are not in it
        a.until = next((r.end for r in runs if _in_run(a, r, now)), None)
    by_start = sorted(attempts, key=lambda a: a.marks["process_started"])
    group = _Group(number, sorted(attempts, key=lambda a: a.marks["ready"]))
    for e in records.events:
        if e["event"] == "replica_heal":  # an attempt's first quorum healed it: it went on from the peers' step
            group.heals.append(e)
            began = [a for a in by_start if a.marks["process_started"] <= float(e["time"])]
            if began and began[-1].heal is None and int(e.get("from_step", -1)) == began[-1].from_step:
                began[-1].heal = e
        elif e["event"] == "diloco_round_dropped":
            last = int(e["step"])
            group.dropped.append((((last - 1) // every) * every + 1, last))
    dropped = {step for first, last in group.dropped for step in range(first, last + 1)}
    later_from = _later_from(attempts)
    current, index, previous = None, -1, None
    for raw in records.rows:
        row = raw if isinstance(raw, Row) else Row.of(raw)
        while index + 1 < len(group.attempts) and group.attempts[index + 1].marks["ready"] <= row.time:
            index, previous = index + 1, None
            current = group.attempts[index]
        if current is None:
            continue  # a row before any attempt event: an older run's file (nothing to attribute it to)
        start = previous.time if previous is not None else current.marks["ready"]
        quorum = every == 1 or (row.step - 1) % every == 0  # DiLoCo: the round's first step called it
        lost = row.step > later_from[id(current)] or row.step in dropped
        inside = _count_row(current, row, start, lost=lost, quorum=quorum)
        if previous is None:
            current.first_quorum_s = inside.get("quorum", 0.0)
        if every > 1 and not lost:  # the round in flight: thrown away if the attempt fails inside it
            if row.step % every == 0:
                current.round_parts, current.round_steps = {}, 0
            else:
                for name, value in inside.items():
                    current.round_parts[name] = current.round_parts.get(name, 0.0) + value
                current.round_steps += 1
        previous = row
        group.steps_done = max(group.steps_done, row.step)
        group.recent.append(row)
        if row.participants is not None and row.participants < groups:
            group.short.append(row)
        for tier, step in (row.commits or {}).items():
            group.checkpoints[tier] = {"step": step, "time": row.time}
    for a, nxt in itertools.zip_longest(group.attempts, group.attempts[1:]):
        failed = a.end is None and a.stop is None and (nxt is not None or a.until is not None)
        if failed and a.round_steps:  # DiLoCo: it failed inside a round, whose work never reached the others
            moved = sum(a.round_parts.values())
            for name, value in a.round_parts.items():
                a.parts[name] -= value
            a.parts["lost"] = a.parts.get("lost", 0.0) + moved
            a.lost_steps += a.round_steps
            a.lost_s += moved
            a.thrown_steps = a.round_steps
    return group


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
    """Per attempt: the lowest step a later attempt went on from (its steps above it were redone or are lost)."""
    ordered = sorted(attempts, key=lambda a: a.marks["process_started"])
    out, lowest = {}, float("inf")
    for a in reversed(ordered):
        out[id(a)] = lowest
        lowest = min(lowest, a.resumed)
    return out


def _count_row(attempt: Attempt, row: Row, start: float, lost: bool, quorum: bool = True) -> dict[str, float]:
    """One step's time since the previous row (or the attempt's start of training) into the attempt's parts;
    what of it lies after the attempt's allocation ended (as accounted) into `past_end_s` instead. `quorum`:
    the row's quorum_s is this step's own (not a DiLoCo round's, repeated). Returns the row's parts."""
    whole = max(0.0, row.time - start)
    past = min(whole, row.time - attempt.until) if attempt.until is not None and row.time > attempt.until else 0.0
    attempt.past_end_s += past
    span = whole - past
    parts = attempt.parts
    if lost:
        inside = {"lost": span}
        attempt.lost_steps += 1
        attempt.lost_s += span
    else:
        joined = row.quorum_s if quorum else 0.0
        inside = {
            "productive": max(0.0, row.step_s - row.data_wait_s - row.compile_s - joined),
            "data_wait": row.data_wait_s,
            "compile": row.compile_s,
            "checkpoint": row.ckpt_s,
            "evaluation": row.eval_s,
        }
        if joined:
            inside["quorum"] = joined
        if past:  # the row's time after the end: each part in proportion
            inside = {k: v * span / whole for k, v in inside.items()}
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
    return inside


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
    hosts_of: Callable[[Attempt], list[str]] = lambda a: [],
    seen: float | None = None,
    spares: int | None = None,
    others: Callable[[float, float], list[tuple[float, float]]] | None = None,
) -> None:
    """The run's parts: its start-up, its attempts' rows, the gaps between them, and its end. `hosts_of(a)`:
    the hosts attempt `a` trained on, by rank (none: unknown, all of the allocation's nodes); `seen`: the
    newest record of the run (an event of an attempt that never trained, too); `spares`: the job's hot spares
    (None: unknown). `others(a, b)`: a replica group's run (its slice of the job), the stretches of [a, b]
    in which another group trained: what the group spent outside its steps then is replica_out."""
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

    def idle(name: str, a: float, b: float, share: float = 1.0, outage: bool = True) -> float:
        """`held(a, b) * share` into `name`; in a replica group's outage, what of it another group trained
        through into replica_out (returned)."""
        covered = others is not None and outage and b > a
        out = sum(held(lo, hi) for lo, hi in others(a, b)) * share if others is not None and covered else 0.0
        add("replica_out", out)
        add(name, held(a, b) * share - out)
        return out

    t = run.start
    # id(attempt) -> (nodes held, nodes trained, idle spares) over its steps
    widths: dict[int, tuple[float, float, float]] = {}
    trained_before: set[str] = set()  # hosts that trained in an earlier attempt of this allocation
    for a in attempts:
        began = max(t, min(a.marks["process_started"], end))
        first = a is attempts[0]  # the job's start (every group's start-up, not an outage), or a restart
        out = idle("startup" if first else "recovery", t, began, outage=not first)
        ready = max(began, min(a.marks["ready"], end))
        hosts = set(hosts_of(a))
        trained = len(hosts)
        gone = len(trained_before - hosts) if trained else 0
        trained_before |= hosts
        starting = nodes_over(began, ready)
        share = min(1.0, trained / starting) if trained and starting else 1.0  # the rest: spares, lost nodes
        out += idle("startup", began, ready, share, outage=not first)
        unused = starting * (1.0 - share)
        spare_share = _idle_spares(unused, gone, spares) / unused if unused > 0 else 0.0
        waiting = held(began, ready) * (1.0 - share)
        add("spare", waiting * spare_share)
        lost_node = waiting * (1.0 - spare_share)
        rows_end = max(began, min(end, a.last_row.time if a.last_row else a.marks["ready"]))
        width = nodes_over(ready, rows_end)  # a job resizes between attempts, not during one's steps
        train = min(width, trained) if trained else width
        spare_width = _idle_spares(width - train, gone, spares)
        widths[id(a)] = (width, train, spare_width)
        for name, value in a.parts.items():
            add(name, value * train)
        if others is not None and a.first_quorum_s and not first:  # its join (and heal) while others trained
            joined = sum(hi - lo for lo, hi in others(ready, ready + a.first_quorum_s))
            moved = min(joined, a.parts.get("quorum", 0.0)) * train
            add("quorum", -moved)
            add("replica_out", moved)
            out += moved
        a.out_before_node_s, a.train_nodes = out, train
        span = sum(a.parts.values())
        add("spare", span * spare_width)
        lost_node += span * (width - train - spare_width)
        add("lost_node", lost_node)
        gone_hosts = sorted(trained_before - hosts) if trained else []
        a.lost_node_by_host = {h: lost_node / len(gone_hosts) for h in gone_hosts}
        run.past_end_node_s += a.past_end_s * train
        t = rows_end
    if last is None:  # never trained: all of it was getting started (or failing to)
        add("startup", held(t, end))
        t = end
    tail = max(0.0, end - t)
    save_s = float((last.end or {}).get("save_s", 0.0)) if last is not None else 0.0
    saved = min(tail, save_s)
    run.past_end_node_s += (save_s - saved) * pieces[-1][2]  # the save at a scancel, past the recorded end
    finished = last is not None and _finished(last, run, completed)
    add("checkpoint", held(t, t + saved))
    ended_itself = last is not None and (last.stop is not None or last.end is not None)
    after = "shutdown" if finished else "pending" if live and not ended_itself else "recovery"
    out = idle(after, t + saved, end, outage=not (finished or ended_itself))  # a group left behind
    if last is not None:
        last.out_after_node_s = out
    if run.suspended_node_s > 0:
        _take_suspension(run.suspended_node_s, attempts, widths, parts, run.node_s)
    run.parts = parts
    run.goodput = run.parts.get("productive", 0.0) / run.node_s if run.node_s else None
    steps = [(a.first_row.step, a.last_row.step) for a in attempts if a.first_row and a.last_row]
    run.steps = (min(s for s, _ in steps), max(e for _, e in steps)) if steps else None
    run.ended = _how_ended(run, live, finished)


def _fill_replica_run(
    run: JobRun,
    inside: list[list[Attempt]],
    records: list[GroupRecords],
    completed: dict[str, Any] | None,
    now: float,
    seen: float,
    spares: int | None,
    setup: ReplicaSetup,
) -> dict[str, float]:
    """A job of replica groups: each group's slice of its nodes (`setup.nodes`) accounted from the group's own
    attempts (`_fill_run`), what of a group's time outside its steps another group trained through as
    replica_out; the nodes beyond the groups' are the job's hot spares, or nodes the groups lost (lost_node,
    returned by host: what each node the groups trained on before and on none now was held since)."""
    everyone = [a for group in inside for a in group]
    if run.state == "ENDED" and run.end is None:  # no accounting: it lasted as long as it recorded things
        run.end = max([run.start, seen, *(_last_seen(a) for a in everyone)])
    live = run.end is None
    end = run.end if run.end is not None else now
    pieces = [(a, b if b is not None else end, n) for a, b, n in run.pieces] or [(run.start, end, run.nodes)]
    pieces[-1] = (pieces[-1][0], end, pieces[-1][2])
    trainers = setup.groups * setup.nodes

    def group_nodes(n: float) -> float:  # a job with fewer nodes than its groups' (shrunk): each its share
        return setup.nodes * min(1.0, n / trainers)

    hosts = {id(a): set(records[g].hosts(a.key)) for g, group in enumerate(inside) for a in group}
    spans = [[s for a in group if (s := _training_span(a, end)) is not None] for group in inside]
    slices = []
    for g, attempts in enumerate(inside):
        others = _union([s for h, group in enumerate(spans) if h != g for s in group])
        part = replace(
            run,
            pieces=[(lo, hi, group_nodes(n)) for lo, hi, n in pieces],
            suspended_node_s=run.suspended_node_s * group_nodes(run.nodes) / run.nodes,
            parts={},
            past_end_node_s=0.0,
        )
        _fill_run(
            part,
            attempts,
            completed,
            now,
            lambda a: sorted(hosts[id(a)]),
            seen,
            0,  # a group's nodes train, or are lost to it (the job's spares are outside the groups' slices)
            partial(_clip, others),
        )
        slices.append(part)
    parts: dict[str, float] = {}
    for part in slices:
        for name, value in part.parts.items():
            parts[name] = parts.get(name, 0.0) + value
    lost_by_host: dict[str, float] = {}
    starts = sorted({min(max(a.marks["process_started"], run.start), end) for a in everyone})
    points = sorted({run.start, end, *(lo for lo, _, _ in pieces if lo < end), *starts})
    beyond = 0.0
    for lo, hi in itertools.pairwise(points):
        extra = sum(max(0.0, n - trainers) * max(0.0, min(hi, b) - max(lo, a)) for a, b, n in pieces)
        if extra <= 0:
            continue
        beyond += extra
        current: set[str] = set()
        before: set[str] = set()
        for group in inside:
            begun = [a for a in group if a.marks["process_started"] <= lo]
            before.update(*(hosts[id(a)] for a in begun))
            if begun:
                current |= hosts[id(max(begun, key=lambda a: a.marks["process_started"]))]
        gone = sorted(before - current)
        lost = min(extra, len(gone) * (hi - lo))
        spare = extra - lost if spares is None else min(extra - lost, spares * (hi - lo))
        parts["spare"] = parts.get("spare", 0.0) + spare
        parts["lost_node"] = parts.get("lost_node", 0.0) + extra - spare
        for host in gone:
            lost_by_host[host] = lost_by_host.get(host, 0.0) + lost / len(gone)
    if run.suspended_node_s > 0 and beyond > 0:  # the spares and lost nodes were suspended too, in proportion
        share = min(1.0, run.suspended_node_s / sum(n * (b - a) for a, b, n in pieces)) if end > run.start else 0.0
        for name in ("spare", "lost_node"):
            moved = parts.get(name, 0.0) * share
            parts[name] = parts.get(name, 0.0) - moved
            parts["suspended"] = parts.get("suspended", 0.0) + moved
    run.attempts = [
        _qualified(g, a.key)
        for g, a in sorted(
            ((g, a) for g, group in enumerate(inside) for a in group),
            key=lambda ga: ga[1].last_row.time if ga[1].last_row else ga[1].marks["ready"],
        )
    ]
    run.wall_s = max(0.0, end - run.start)
    run.node_s = sum(n * max(0.0, b - a) for a, b, n in pieces)
    run.parts = parts
    run.past_end_node_s = sum(part.past_end_node_s for part in slices)
    run.goodput = parts.get("productive", 0.0) / run.node_s if run.node_s else None
    steps = [part.steps for part in slices if part.steps is not None]
    run.steps = (min(s for s, _ in steps), max(e for _, e in steps)) if steps else None
    run.ended = _how_ended(run, live, any(part.ended == "finished the run" for part in slices))
    return lost_by_host


def _qualified(group: int, key: str) -> str:
    """An attempt's name in the run: its key, under its group's folder for groups past the first."""
    return key if group == 0 else f"g{group}/{key}"


def _training_span(a: Attempt, end: float) -> tuple[float, float] | None:
    """When an attempt trained in its group's quorum: from its first quorum's end to its last step's."""
    if a.last_row is None:
        return None
    start = a.marks["ready"] + a.first_quorum_s
    stop = min(a.last_row.time, end)
    return (start, stop) if stop > start else None


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping stretches merged, in order."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _clip(spans: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of merged `spans` inside [a, b]."""
    return [(max(lo, a), min(hi, b)) for lo, hi in spans if hi > a and lo < b]


def _replica_incidents(
    counted: list[_Group],
    records: list[GroupRecords],
    run_of: dict[int, JobRun],
    resubmissions: list[dict[str, Any]],
    max_steps: int,
    now: float,
    setup: ReplicaSetup,
    lost_by_host: dict[int, dict[str, float]],
) -> tuple[list[Incident], list[ReplicaIncident]]:
    """The run's interruptions (each job's end that stopped every group: told by the group that trained last
    in it) and every period a replica group was out of the quorum."""

    def end_of(a: Attempt) -> float:
        run = run_of.get(id(a))
        return run.end if run is not None and run.end is not None else now

    spans = [[s for a in c.attempts if (s := _training_span(a, end_of(a))) is not None] for c in counted]
    last_in_run: dict[int, Attempt] = {}  # by id(run): the attempt that trained last in it
    for c in counted:
        for a in c.attempts:
            run = run_of.get(id(a))
            if run is not None and a.last_row is not None:
                best = last_in_run.get(id(run))
                if best is None or best.last_row is None or a.last_row.time > best.last_row.time:
                    last_in_run[id(run)] = a
    incidents: list[Incident] = []
    outages: list[ReplicaIncident] = []
    for c in counted:
        g = c.number
        others = _union([s for h, group in enumerate(spans) if h != g for s in group])
        short = sorted((r for other in counted if other is not c for r in other.short), key=lambda r: r.time)
        ahead = max((other.steps_done for other in counted if other is not c), default=0)

        def left_behind(a: Attempt, ahead: int = ahead) -> bool:
            """The others went on past it (more than a DiLoCo round apart): it is out."""
            return a.last_row is not None and ahead > a.last_row.step + setup.sync_every

        pairs = _incidents(
            c.attempts,
            run_of,
            resubmissions,
            records[g].failures,
            records[g].hosts,
            max_steps,
            out=left_behind,
        )
        for a, nxt, incident in pairs:
            run = run_of.get(id(a))
            assert a.last_row is not None  # `_incidents`
            incident.group, incident.attempt = g, _qualified(g, a.key)
            if incident.kind != "restart in the allocation" and run is not None and run.end is not None:
                if last_in_run.get(id(run)) is a:  # every group had stopped: the job's interruption
                    incidents.append(incident)
            until = nxt.marks["ready"] + nxt.first_quorum_s if nxt is not None else None
            gap_end = until if until is not None else end_of(a)
            alone = _clip(others, a.last_row.time, gap_end)
            if incident.kind != "restart in the allocation" and not alone:
                continue  # nobody trained while it was out: the job's interruption only
            outages.append(_outage(g, a, nxt, incident, short, until, gap_end, setup, records[g], run_of, lost_by_host))
    incidents.sort(key=lambda i: i.last_progress)
    outages.sort(key=lambda o: o.out_from)
    return incidents, outages


def _outage(
    group: int,
    a: Attempt,
    nxt: Attempt | None,
    incident: Incident,
    short: list[Row],
    until: float | None,
    gap_end: float,
    setup: ReplicaSetup,
    records: GroupRecords,
    run_of: dict[int, JobRun],
    lost_by_host: dict[int, dict[str, float]],
) -> ReplicaIncident:
    """One replica group's period out of the quorum, after attempt `a` (to `nxt`'s first step back)."""
    last = a.last_row
    assert last is not None
    heal = nxt.heal if nxt is not None else None
    window = [r for r in short if last.time < r.time <= gap_end and r.step > last.step]
    if heal is not None:  # it went on from the peers' step: the others took every step since its last without it
        without = list(range(last.step + 1, int(heal["step"]) + 1))
    else:
        without = sorted({r.step for r in window})
    run = run_of.get(id(a))
    same_run = nxt is not None and run is not None and run_of.get(id(nxt)) is run
    gone = set(records.hosts(a.key)) - set(records.hosts(nxt.key)) if nxt is not None and same_run else set()
    held = lost_by_host.get(id(run), {}) if run is not None else {}
    if nxt is not None:
        kind = incident.kind
    else:
        kind = "out" if run is None or run.end is None else "out to the job's end"
    return ReplicaIncident(
        group=group,
        attempt=a.key,
        kind=kind,
        cause=incident.cause,
        last_step=last.step,
        out_from=last.time,
        out_until=until,
        out_s=max(0.0, gap_end - last.time),
        next_attempt=nxt.key if nxt is not None else None,
        rejoined_at=nxt.first_row.step if nxt is not None and nxt.first_row is not None else None,
        steps_without=(without[0], without[-1]) if without else None,
        steps_without_n=len(without),
        fewest=min((r.participants for r in window if r.participants is not None), default=None),
        samples_skipped=(len(without) + a.thrown_steps) * setup.group_batch,
        heal_s=float(heal["heal_s"]) if heal is not None else None,
        healed_from=int(heal["from_step"]) if heal is not None else None,
        lost_steps=a.lost_steps,
        node_s=a.out_after_node_s + (nxt.out_before_node_s if nxt is not None else 0.0) + a.lost_s * a.train_nodes,
        lost_node_s=sum(held.get(h, 0.0) for h in gone),
    )


def _replica_totals(
    counted: list[_Group], setup: ReplicaSetup, parts: dict[str, float], outages: list[ReplicaIncident]
) -> ReplicaTotals:
    """The quorum's figures over the run: the steps short of a group (each step's last run), the samples never
    trained on (the missing groups' of those steps; every group's of a dropped DiLoCo round), the heals."""
    fewest: dict[int, int] = {}
    for c in counted:
        for r in c.short:
            assert r.participants is not None  # `_count_group`
            fewest[r.step] = min(fewest.get(r.step, setup.groups), r.participants)
    dropped = {span for c in counted for span in c.dropped}
    in_dropped = {step for first, last in dropped for step in range(first, last + 1)}
    skipped = sum((setup.groups - p) for step, p in fewest.items() if step not in in_dropped)
    skipped += sum((last - first + 1) * setup.groups for first, last in dropped)
    heals = [e for c in counted for e in c.heals]
    return ReplicaTotals(
        groups=setup.groups,
        nodes_per_group=setup.nodes,
        sync_every=setup.sync_every,
        steps=max(c.steps_done for c in counted),
        steps_short=len(fewest),
        fewest=min(fewest.values(), default=None),
        samples_skipped=skipped * setup.group_batch,
        heals=len(heals),
        heal_s=sum(float(e.get("heal_s", 0.0)) for e in heals),
        rounds_dropped=len(dropped),
        quorum_node_s=parts.get("quorum", 0.0),
        replica_out_node_s=parts.get("replica_out", 0.0),
    )


def _idle_spares(idle: float, gone: int, spares: int | None) -> float:
    """Of `idle` nodes (held, not training), the hot spares: not the `gone` ones that trained in an earlier
    attempt of the allocation (lost to training), and no more than the job has (`spares`, None: unknown)."""
    spare = max(0.0, idle - gone)
    return spare if spares is None else min(spare, float(spares))


def _take_suspension(
    node_s: float,
    attempts: list[Attempt],
    widths: dict[int, tuple[float, float, float]],
    parts: dict[str, float],
    allocated: float,
) -> None:
    """Move `node_s` suspended node-seconds from where they were counted into "suspended": first from the rows
    that ran longest past their attempt's typical row (each row's largest part first: a step's own time for a
    suspension inside a step; the idle nodes' time, spares and lost nodes, over the same seconds), then, for
    what no row holds, from the parts outside the steps."""
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
    for excess, inside, (width, train, spare) in sorted(candidates, key=lambda c: -c[0]):
        if left <= 1e-9 or excess <= 0 or width <= 0:
            break
        seconds = min(left / width, excess)
        rest = seconds * train
        for name in sorted(inside, key=lambda n: -inside[n]):  # the part the suspension inflated is the largest
            rest -= move(name, min(rest, inside[name] * train))
            if rest <= 1e-12:
                break
        moved = seconds * train - rest
        moved += move("spare", seconds * spare)  # the idle nodes were suspended over those seconds too
        moved += move("lost_node", seconds * (width - train - spare))
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
    out: Callable[[Attempt], bool] = lambda a: False,
) -> list[tuple[Attempt, Attempt | None, Incident]]:
    """Every attempt that ended before the run's end, and the way back to the next one's first step: (the
    attempt, the next, the incident). `out(a)`: the newest attempt of a live job stopped training (a replica
    group left behind by the others), an incident already."""
    pairs: list[tuple[Attempt, Attempt | None, Incident]] = []
    trained = [a for a in attempts if a.last_row is not None]
    for a, nxt in itertools.zip_longest(trained, trained[1:]):
        run = run_of.get(id(a))
        assert a.last_row is not None  # `trained`
        if a.last_row.step >= max_steps or (run is not None and _finished(a, run, None)):
            continue
        if nxt is None and (run is None or run.end is None and a.stop is None) and not out(a):
            continue  # the newest attempt, still training
        pairs.append((a, nxt, _incident(a, nxt, run_of, resubmissions, failures, hosts)))
    _cost_lost_nodes(pairs, attempts, run_of, hosts)
    return pairs


def _cost_lost_nodes(
    pairs: list[tuple[Attempt, Attempt | None, Incident]],
    attempts: list[Attempt],
    run_of: dict[int, JobRun],
    hosts: Callable[[str], list[str]],
) -> None:
    """Each incident's `lost_node_s`: the "lost_node" time, in the later attempts of the same allocation, of
    the nodes it took out of training (a node that went twice is charged to the later time it went)."""
    went = [
        (nxt, set(hosts(a.key)) - set(hosts(nxt.key)), incident)
        for a, nxt, incident in pairs
        if nxt is not None and run_of.get(id(a)) is not None and run_of.get(id(nxt)) is run_of.get(id(a))
    ]
    for b in attempts:
        for host, node_s in b.lost_node_by_host.items():
            charged = [
                incident
                for nxt, gone, incident in went
                if host in gone
                and run_of.get(id(nxt)) is run_of.get(id(b))
                and nxt.marks["process_started"] <= b.marks["process_started"]
            ]
            if charged:
                charged[-1].lost_node_s += node_s


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
    elif leaves and run is not None and run.state not in ("RUNNING", "COMPLETED", ""):
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
