"""One agent per node: torch.distributed.elastic restarts the node's workers inside the allocation.

With `launcher.in_allocation` (the default) each Slurm task is one node's agent, not a training rank: it runs
torch.distributed.elastic's `LocalElasticAgent` (what torchrun is built on) with the c10d rendezvous, and
the agent forks one worker per GPU (hpctrain/train/worker.py) from itself, the training stack imported
once. When a worker raises, dies (SIGKILL, the OOM killer) or is ended by the hang watchdog, every agent
stops its workers, the agents meet again in the rendezvous, and new workers start on the same nodes with the
same job id: no sbatch, no queue.
The workers resume from the newest checkpoint, the node-local RAM tier first.
With replica groups (recovery=replicas|diloco: `groups` > 1) the job's slots are `groups` groups of
`nodes / groups` nodes, each group its own rendezvous (run id `<job>-replica<g>`: torch names a folder after
it, so no slash): a failure restarts only its group's workers, while torchft (in the workers) carries the other
groups' steps on without it; the agent hosting the rendezvous store also hosts torchft's lighthouse (and keeps
both until every group is over), and the lighthouse moves with the store.

Traps this module avoids (measured on this machine, shared/facts/in-allocation-restart.md):
- the agent's TCP store is shared with the workers and reused across restarts, so a restarted gloo group
  reads the previous attempt's keys and hangs: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a
  fresh store on worker rank 0;
- min_nodes < max_nodes makes every rendezvous wait `last_call_timeout` (30 s): the node count is fixed
  and the last call is 1 s, or 3 s when the job may shrink (elastic.min_nodes);
- the rendezvous store must not die with one node: it starts in node 0's agent and, when its host stops
  answering, moves to the next live node (a new store, a new port; the agents there start a new launch that
  numbers its restarts after the old one's). Under `--no-kill` Slurm keeps a job whose batch host died
  (measured on the dev cluster), so node 0, rank 0's node, is survived like any other; the batch script
  died with it, so the agent then hosting the store ends the job when the run is done;
- a new interpreter per worker would import torch again on every restart (2.5-4 s of each): the workers are
  forked from the agent, which never initialises CUDA or runs a torch op, so forking it is safe. torch's own
  LaunchConfig asks torch.cuda.is_available(), which would initialise CUDA and poison every forked worker:
  the agent asks through NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1), and tests/gpu_rules.py fails a CPU run
  whose agent initialises CUDA before it forks;
- a spare agent waiting in the rendezvous makes the running agents restart every second: spares wait outside
  it until a node is gone (hpctrain/distributed/spares.py);
- a node that loses power (or hangs) fails nothing (its peers block in collectives), and one that dies with no
  spare left leaves its peers in the rendezvous for the whole join timeout (600 s, nothing logged): in every
  job of more than one node the training agents watch each other's beats (spares.PeerWatch) and, with no spare
  waiting and no shrinking allowed, end the job in seconds: a failure record naming every node the job lost
  (the supervisor leaves them out), then `scontrol requeue` (not the supervisor line after srun: srun returns
  only once Slurm declares the dead node down, even when its step is cancelled, measured); a replica group in
  that case leaves the run to the others instead (exit 0);
- when Slurm ends the job (scancel, a requeue) every agent gets SIGTERM and stops its workers, some sooner than
  others: a peer's beats that stop then are no lost node, so the agents note the signal (a hook on torch's
  termination handler) and their watch stands down;
- the watch's verdict must reach the main thread, which torch's agent holds (in its monitor loop or its
  rendezvous): a SIGUSR1 to the main thread raises `LeaveRun` there, a BaseException, so that torch takes it for
  none of its own failures (it stops the workers and closes the rendezvous on the way out);
- torchft's lighthouse runs in a process of its own (hpctrain.distributed.lighthouse): workers forked from an
  agent whose process ran it crashed or hung in torchft's clients;
- torchft's lighthouse binds 0.0.0.0, not [::]: every address the workers get is IPv4 (`node_addresses`), and
  [::] fails where a node has IPv6 disabled;
- torch's rendezvous paces itself with a fixed 1 s (a sleep between reads, a 1 s state cache): both follow
  the job's size instead (`rendezvous_poll_s`);
- submitit's USR2 handler would requeue from the agent: the agent ignores USR2, and the workers (which
  Slurm signals too, as every process of the step) save and requeue as without agents.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpctrain.distributed import roles, spares
from hpctrain.distributed.environment import node_addresses, port_for_job
from hpctrain.distributed.lighthouse import LighthouseProcess
from hpctrain.records.failures import attempt_key, last_restart, record_failure
from hpctrain.records.jobs import read_completed
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = (
    0.1  # how often the agent polls its workers (and the rendezvous, cached): part of detecting a crash
)
LAST_CALL_S = 1  # a fixed node count never needs the rendezvous' last call
# A job that may shrink closes a round once min_nodes are in and no one came for this long: long enough for
# every agent's start-up skew (one who misses the first round is admitted by one more restart), short
# enough to add little to each restart.
SHRINK_LAST_CALL_S = 3
KEEP_ALIVE_S = 1  # a dead agent is noticed after KEEP_ALIVE_S x KEEP_ALIVE_MISSES
KEEP_ALIVE_MISSES = 3
# torch's rendezvous polls its state every 1 s while it waits for the others: each restart waits up to that
# much longer than the last agent's arrival, twice (the round, then the workers' process group). Polled at
# 2 ms a node instead (50 ms on a small job, torch's 1 s from 500 nodes on): about 500 reads a second reach
# the store at any job size.
RENDEZVOUS_POLL_S_PER_NODE = 0.002
RENDEZVOUS_POLL_MIN_S = 0.05
NEXT_HOST_WAIT_S = 10  # how long an agent waits for the next node in line to open the moved store
NO_NUMA_QUERY = object()  # see NodeAgent.launch_config
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch.cuda.is_available/device_count without initialising CUDA


@dataclass(frozen=True)
class Lighthouse:
    """torchft's lighthouse, the replica groups' quorum (cfg.recovery): a step commits with at least
    `min_replicas` groups; a group that stopped beating for `heartbeat_timeout_ms` is left out; a quorum waits
    `join_timeout_ms` for the groups of the last one."""

    min_replicas: int = 1
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 1000


@dataclass(frozen=True)
class NodeAgent:
    """What one node's agent needs: its place among the nodes and the run's limits."""

    job_id: str
    node: int  # this agent's node in the job: 0 .. nodes + spares - 1
    nodes: int  # the nodes that train (cluster.nodes); the others are hot spares (which: roles.py)
    workers: int  # per node: one per GPU (processes on CPU)
    hosts: tuple[str, ...]  # every node's address, by node index
    max_restarts: int
    join_timeout_s: int
    min_nodes: int = 0  # elastic.min_nodes: go on with this many after losing nodes (0: all `nodes`)
    spares: int = 0  # hot spare nodes after the `nodes` that train (cluster.spare_nodes)
    store_node: int = 0  # the node whose agent hosts the rendezvous store
    generation: int = 0  # how often the store moved (each move: a new store on a new port)
    groups: int = 1  # replica groups (recovery=replicas|diloco): slots g*k .. g*k+k-1 are group g, k = nodes/groups
    lighthouse: Lighthouse = Lighthouse()  # the groups' quorum, hosted with the store (groups > 1)
    names: tuple[str, ...] = ()  # every node's name in the scheduler, by node index (records name nodes so)

    @property
    def store_host(self) -> str:
        return self.hosts[self.store_node]

    @property
    def port(self) -> int:
        # Not port_for_job itself: the same job's workers (without agents) rendezvous there.
        return port_for_job(self.job_id + "/rendezvous" + (f"/{self.generation}" if self.generation else ""))

    @property
    def endpoint(self) -> str:
        return f"{self.store_host}:{self.port}"

    @property
    def spare(self) -> bool:
        return self.node >= self.nodes

    @property
    def group_nodes(self) -> int:
        """The nodes of one replica group (all `nodes` without groups)."""
        return self.nodes // self.groups

    def group_of(self, slot: int) -> int:
        return slot // self.group_nodes

    @property
    def watched(self) -> bool:
        """Whether the agents take slots and watch each other's beats: a job with spares or of several nodes."""
        return bool(self.spares) or self.nodes > 1

    @property
    def lighthouse_port(self) -> int:
        return port_for_job(self.job_id + "/lighthouse" + (f"/{self.generation}" if self.generation else ""))

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.store_host}:{self.lighthouse_port}"

    def name_of(self, node: int) -> str:
        return self.names[node] if self.names else self.hosts[node]

    def launch_config(self, max_restarts: int, slot: int | None = None) -> Any:
        """torch's launch settings for this node in `slot` (its own node index without spares): with replica
        groups, its group's own rendezvous of a fixed `group_nodes`."""
        from torch.distributed.launcher.api import LaunchConfig

        size = self.group_nodes
        low = size if self.groups > 1 else self.min_nodes or self.nodes
        group = self.group_of(self.node if slot is None else slot)
        config = LaunchConfig(
            min_nodes=low,
            max_nodes=size,
            nproc_per_node=self.workers,
            run_id=self.job_id if self.groups == 1 else f"{self.job_id}-replica{group}",
            role="hpctrain",
            rdzv_backend="c10d",
            rdzv_endpoint=self.endpoint,
            rdzv_configs={
                "is_host": self.node == self.store_node,
                "join_timeout": self.join_timeout_s,
                "last_call_timeout": LAST_CALL_S if low == size else SHRINK_LAST_CALL_S,
                "keep_alive_interval": KEEP_ALIVE_S,
                "keep_alive_max_attempt": KEEP_ALIVE_MISSES,
                "read_timeout": int(spares.READ_TIMEOUT_S),
            },
            max_restarts=max_restarts,
            monitor_interval=MONITOR_INTERVAL_S,
            start_method="fork",
            numa_options=NO_NUMA_QUERY,  # type: ignore[arg-type]
        )
        # Given no NUMA options, torch would ask torch.cuda.is_available() here (to pick default options, which
        # are None outside Meta anyway): CUDA initialised in the agent, every forked worker poisoned. NVML's
        # count (the agent's PYTORCH_NVML_BASED_CUDA_CHECK) falls back to cudaGetDeviceCount where NVML fails
        # (MIG UUIDs in CUDA_VISIBLE_DEVICES, no libnvidia-ml), so the question is not asked at all.
        config.numa_options = None
        return config


def agent_from_submitit(
    nodes: int,
    workers: int,
    max_restarts: int,
    join_timeout_s: int,
    min_nodes: int = 0,
    groups: int = 1,
    lighthouse: Lighthouse = Lighthouse(),
) -> NodeAgent:
    """This node's agent, from submitit's view of the job (one task per node; `nodes` of them train, in
    `groups` replica groups)."""
    import submitit

    je = submitit.JobEnvironment()
    return NodeAgent(
        job_id=str(je.job_id),
        node=je.node,
        nodes=nodes,
        workers=workers,
        hosts=node_addresses(je),
        max_restarts=max_restarts,
        join_timeout_s=join_timeout_s,
        min_nodes=min_nodes,
        spares=je.num_nodes - nodes,
        groups=groups,
        lighthouse=lighthouse,
        names=tuple(je.hostnames),
    )


def run_agent(agent: NodeAgent, task: Any, worker: Callable[[Any], Any]) -> dict[int, Any]:
    """Run this node's workers until they finish, restarting all of them on any failure (every node alike).

    `worker(task)` is what each forked worker runs (hpctrain.train.worker.run_worker: the caller imports it, torch
    and the training stack with it, once, before the fork; this module stays below the training loop). `task`
    (config, run directory, layout) goes to every worker. Returns the workers' results by local rank ({} when
    this node's replica group left the run); raises torch's ChildFailedError once `max_restarts` restarts are
    spent, and NodesLost when nodes of the job went silent with no spare left and no shrinking allowed (the job
    is requeued). When the rendezvous store's host dies, the store moves to the next live node and the agents
    go on there.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # First: torch's LaunchConfig asks torch.cuda.is_available() (for NUMA binding defaults), which initialises
    # CUDA in the agent through cudaGetDeviceCount; every worker forked after that dies at its first CUDA call
    # ("Cannot re-initialize CUDA in forked subprocess"). Asked through NVML instead, nothing initialises CUDA.
    os.environ[NVML_CUDA_CHECK] = "1"
    _log_to_stderr(agent.node)
    _plain_torch_log_format()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["HPCTRAIN_JOB_ID"] = agent.job_id
    signal.signal(signal.SIGUSR2, _leave_to_workers)
    signal.signal(LEAVE_SIGNAL, _leave_now)
    _poll_rendezvous_every(rendezvous_poll_s(len(agent.hosts)))
    _note_termination()
    _bound_rendezvous_store_calls(spares.READ_TIMEOUT_S + spares.CALL_MARGIN_S)
    slot: int | None = None if agent.spare else agent.node
    gone: set[int] = set()  # nodes lost with the store's earlier hosts (a failure record names them)
    while True:
        # torch's store reuses the server; the lighthouse moves with it, and serves before the store does (the
        # workers it reaches cannot start before the store: they find it up)
        server = (_host_lighthouse(agent), _host_store(agent)) if agent.node == agent.store_node else None
        base = last_restart(Path(task.run_dir), _run_key(agent.job_id)) + 1 if agent.generation else 0
        os.environ["HPCTRAIN_RESTART_BASE"] = str(base)
        try:
            results, slot = _launch(agent, task, worker, slot, agent.max_restarts - base, gone)
        except LeaveRun as leave:
            if leave.left:
                log.warning("node %d: %s", agent.node, leave)
                if server is not None:  # the other groups' store and lighthouse: this process must live on
                    _host_until_end(agent)
                return {}
            raise NodesLost(str(leave)) from None
        except ChildFailedError:
            if agent.generation and server is not None:
                _end_job_after_run()
            raise
        except Exception as error:
            if _run_completed(task, agent.job_id):  # the store closed with the run's end: nothing to move
                return {}
            if server is not None or _still_answers(agent):
                raise
            log.warning(
                "node %d: the rendezvous store on node %d stopped answering (%s): moving it",
                agent.node,
                agent.store_node,
                type(error).__name__,
            )
            moved = next_store(agent)
            gone.update(
                (agent.store_node + step) % len(agent.hosts) for step in range(moved.generation - agent.generation)
            )
            agent = moved
            log.warning(
                "node %d: the rendezvous store is now on node %d (%s)", agent.node, agent.store_node, agent.endpoint
            )
            continue
        if agent.generation and server is not None:  # node 0, the batch host, is gone: no one else ends the job
            _end_job_after_run()
        return results


def _launch(
    agent: NodeAgent,
    task: Any,
    worker: Callable[[Any], Any],
    slot: int | None,
    max_restarts: int,
    gone: Collection[int],
) -> tuple[dict[int, Any], int | None]:
    """One launch of torch's agent against the current store: (the workers' results, the slot this node held).
    `gone`: nodes the job lost with the store's earlier hosts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # What the agent holds now (torch, the training stack: 300k objects) is never garbage: out of the
    # collector's sight, a worker's full collections stop scanning it (0.19 s each, several in a resume) and
    # stop touching, hence copying, the pages it shares with the agent (the gc module's advice for forking).
    gc.freeze()
    if max_restarts < 0:
        raise RuntimeError(f"node {agent.node}: the restarts of launcher.max_restarts={agent.max_restarts} are spent")
    if not agent.watched:  # one node, no spare: no one to watch
        log.info(
            "node %d: agent for %d worker(s), rendezvous %s, up to %d restarts in the allocation",
            agent.node,
            agent.workers,
            agent.endpoint,
            max_restarts,
        )
        return elastic_launch(agent.launch_config(max_restarts), worker)(task), slot
    store = spares.connect(agent.store_host, agent.port, agent.join_timeout_s)
    if agent.spares and not agent.generation:  # the job's first launch: the nodes holding this run's RAM
        slot = roles.slot_by_holdings(store, agent, task)  # checkpoints train, not the first by index (D6)
    if gone:
        spares.add_lost(store, agent.job_id, gone)
    if slot is not None and not spares.hold(store, agent.job_id, slot, agent.node):
        log.info("node %d: slot %d was taken while the store moved; this node is a spare now", agent.node, slot)
        slot = None
    if slot is None:
        log.info("node %d: hot spare, waiting for one of %d nodes to go", agent.node, agent.nodes)
        slot = spares.wait_for_vacancy(store, agent.job_id, agent.nodes, agent.node, moved=agent.generation > 0)
        if slot is None:
            return {}, None
    group = agent.group_of(slot)
    log.info(
        "node %d (slot %d of %d%s): agent for %d worker(s), rendezvous %s, up to %d restarts in the allocation",
        agent.node,
        slot,
        agent.nodes,
        f", replica group {group} of {agent.groups}, lighthouse {agent.lighthouse_url}" if agent.groups > 1 else "",
        agent.workers,
        agent.endpoint,
        max_restarts,
    )
    if agent.groups > 1:  # the forked workers inherit it: hpctrain.distributed.replicas.ReplicaPlace
        from hpctrain.distributed.replicas import GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV

        os.environ.update({GROUP_ENV: str(group), GROUPS_ENV: str(agent.groups), LIGHTHOUSE_ENV: agent.lighthouse_url})
    beat = spares.Heartbeat(agent.store_host, agent.port, agent.job_id, slot, agent.node, agent.join_timeout_s)
    beat.start()
    # A node that went silent (power lost, hung: its peers block, nothing fails) or died with no spare left (its
    # peers wait in the rendezvous for it): the agents watch each other's beats (spares.PeerWatch, `Verdicts`).
    verdicts = Verdicts(agent, task, slot)
    watch = spares.PeerWatch(
        agent.store_host,
        agent.port,
        agent.job_id,
        agent.nodes,
        slot,
        agent.join_timeout_s,
        own_workers,
        verdicts,
        min_nodes=agent.min_nodes if agent.groups == 1 else 0,
        group_size=agent.group_nodes,
        moved=agent.generation > 0,
    ).start()
    try:
        results = elastic_launch(agent.launch_config(max_restarts, slot), worker)(task)
        _announce_end(agent, group)  # before the beat stops: a watching peer must not take the end for a silence
    except ChildFailedError:  # the run is over, failed: the spares leave (a lost store is no end: no word)
        _announce_end(agent, group)
        raise
    except Exception:
        # another agent of this group left the run first and closed the group's rendezvous on its way out
        if agent.groups > 1 and _group_left(agent, group):
            raise LeaveRun(f"replica group {group} left the run (another of its nodes saw one go)", left=True) from None
        raise
    finally:
        watch.stop()
        beat.stop()
        verdicts.close()
    return results, slot


LEAVE_SIGNAL = signal.SIGUSR1  # the watch's verdict, to the main thread (`LeaveRun`)
# The agent got a termination signal (Slurm ends or requeues the job: every node's agent gets it and stops its
# workers, some sooner than others): a slot that goes silent then is no lost node (`_note_termination`).
ENDING = threading.Event()
_PENDING: list[LeaveRun] = []  # the verdict the main thread raises at LEAVE_SIGNAL (at most one)


class LeaveRun(BaseException):
    """This node's part of the run is over by its watch's verdict, raised in the agent's main thread from
    within torch's agent: its replica group leaves the run (`left`: the others train on), or the job ends.
    A BaseException: torch's agent handles every Exception as a failure of its own."""

    def __init__(self, why: str, left: bool) -> None:
        super().__init__(why)
        self.left = left


class NodesLost(RuntimeError):
    """Nodes of the job went silent with no spare left and no shrinking allowed: the job ends (requeued)."""


def _leave_now(signum: int, frame: Any) -> None:
    """LEAVE_SIGNAL's handler in the agent's main thread: raise the watch's verdict (nothing when none)."""
    if _PENDING:
        raise _PENDING.pop()


class Verdicts:
    """The agent's answer to its watch's verdicts (spares.PeerWatch calls it from the watch's thread).

    SHRINK stops this node's workers (the group restarts without the silent node). LEAVE and FAIL are final:
    the workers are killed (blocked on a peer that is gone, or waiting for it in the rendezvous: nothing to save
    that the group could commit), a failure record names every node the job lost (`blame`: the supervisor
    leaves them out of a resubmission), then for FAIL the first agent to see it requeues the job, and the verdict
    goes to the main thread (`LeaveRun`). `close()` at the launch's end: no verdict after it; one given before
    is raised there."""

    def __init__(self, agent: NodeAgent, task: Any, slot: int) -> None:
        self.agent, self.task, self.slot = agent, task, slot
        self._lock = threading.Lock()
        self._open = True

    def __call__(self, what: str, slot: int, lost: tuple[int, ...]) -> None:
        if ENDING.is_set():
            log.info("node %d: slot %d is silent, but the job is ending: its node ended with it", self.agent.node, slot)
            return
        if what == spares.SHRINK:
            _stop(own_workers())
            return
        with self._lock:
            if not self._open:
                return
            self._open = False
            agent, names = self.agent, ",".join(self.agent.name_of(n) for n in lost) or "unknown"
            store = spares.connect(agent.store_host, agent.port, spares.READ_TIMEOUT_S)
            _kill(own_workers())
            if what == spares.LEAVE:
                group = agent.group_of(self.slot)
                spares.leave_group(store, agent.job_id, group)
                why = (
                    f"replica group {group} lost node(s) {names} (silent: dead, hung or cut off) with no hot spare "
                    "left: it leaves the run, the other groups train on"
                )
            else:
                why = (
                    f"node(s) {names} of job {agent.job_id} went silent (dead, hung or cut off) with no hot spare "
                    f"left, and the job may not shrink (elastic.min_nodes={agent.min_nodes}): the job ends and "
                    "is requeued without them"
                )
            self._record(why, [agent.name_of(n) for n in lost])
            if what == spares.FAIL and spares.first_to_fail(store, agent.job_id, agent.node):
                _requeue(agent, Path(self.task.run_dir))
            _PENDING.append(LeaveRun(why, left=what == spares.LEAVE))
        signal.pthread_kill(threading.main_thread().ident or 0, LEAVE_SIGNAL)

    def _record(self, why: str, blame: list[str]) -> None:
        """A failure record of this node's in the current attempt's folder: the lost nodes are to blame."""
        run_dir = Path(self.task.run_dir)
        job_id = self.agent.job_id
        attempt = attempt_key(job_id, last_restart(run_dir, _run_key(job_id)), _requeue_count())
        path = record_failure(
            run_dir, attempt, self.slot * self.agent.workers, _last_step(run_dir), NodesLost(why), False, blame
        )
        log.warning("node %d: %s (record: %s)", self.agent.node, why, path)

    def close(self) -> None:
        with self._lock:
            self._open = False
        if _PENDING:
            raise _PENDING.pop()


def _requeue(agent: NodeAgent, run_dir: Path) -> None:
    """End the job now, requeued: Slurm starts it again once it declared the lost nodes down, never on them. A
    job that may not be requeued (cluster.requeue=false) fails instead: srun returns once Slurm declares them
    down, and the supervisor resubmits the job without the nodes the record names. An agent of an earlier run of
    the job (its node hung, the job was requeued meanwhile, and the node runs on) requeues nothing: the job's
    next run has started (its records are there)."""
    if RunPaths(run_dir).failures(attempt_key(agent.job_id, 0, _requeue_count() + 1)).exists():
        log.warning("node %d: a later run of job %s has started: not requeuing it", agent.node, agent.job_id)
    elif scheduler_for().requeue_self():
        log.warning("node %d: job %s requeued", agent.node, agent.job_id)
    else:
        log.error(
            "node %d: job %s could not be requeued: it fails, and the supervisor resubmits it once Slurm declares "
            "the lost nodes down",
            agent.node,
            agent.job_id,
        )


def _host_until_end(agent: NodeAgent) -> None:
    """As the store's (and lighthouse's) host whose replica group left the run: serve both until every group
    is over."""
    log.warning("node %d: hosting the rendezvous store and the lighthouse until the run ends", agent.node)
    with contextlib.suppress(Exception):  # a store that is gone: nothing left to serve
        _wait_for_groups(spares.connect(agent.store_host, agent.port, spares.READ_TIMEOUT_S), agent)


def _wait_for_groups(store: Any, agent: NodeAgent) -> None:
    """Until every replica group is over (done, left, or gone silent): the store and the lighthouse live in this
    process."""
    spares.wait_for_groups(store, agent.job_id, agent.groups, agent.group_nodes)


def _group_left(agent: NodeAgent, group: int) -> bool:
    with contextlib.suppress(Exception):  # a store that is gone: no word
        return spares.group_left(spares.connect(agent.store_host, agent.port, 5), agent.job_id, group)
    return False


def _last_step(run_dir: Path) -> int:
    """The run's last step in its metrics (the failure record's step); -1 before any."""
    path = RunPaths(run_dir).metrics
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError), path.open("rb") as file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
        return int(json.loads(file.read().splitlines()[-1])["step"])
    return -1


def _run_key(job_id: str) -> str:
    """The records' key of this run of the job (a requeued job keeps its id: hpctrain.records.failures)."""
    return attempt_key(job_id, 0, _requeue_count())


def _requeue_count() -> int:
    """How often the scheduler requeued this job (its records count its runs)."""
    return int(scheduler_for().job_context().get("restart_count") or 0)


def own_workers() -> set[int]:
    """This agent's workers: its child processes (torch's agent forks them from its main thread)."""
    children: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            children.update(int(pid) for pid in (task / "children").read_text().split())
    return children


def _kill(workers: set[int]) -> None:
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _stop(workers: set[int]) -> None:
    """SIGTERM the workers: they stop at the step boundary, or, blocked on a peer that is gone, leave through
    the watchdog within a few step times; torch's agent then restarts the group, and the rendezvous drops the
    silent node once its keep-alive lapses."""
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _announce_end(agent: NodeAgent, group: int) -> None:
    """This node's group is over (done, or failed for good): once every group is, the run is over and the spares
    leave. The store's host serves the store (and the lighthouse) until every group is over, and keeps it open a
    moment longer, so that a spare reads the word before the store goes (else it would take the closed store
    for a dead host and move it)."""
    with contextlib.suppress(Exception):  # the store's host may have closed it already
        store = spares.connect(agent.store_host, agent.port, 5)
        if agent.groups > 1:
            spares.group_over(store, agent.job_id, group)
            if agent.node == agent.store_node:
                _wait_for_groups(store, agent)
            elif not spares.groups_over(store, agent.job_id, agent.groups):
                return  # the others train on: their watches and the spares stay
        spares.announce_end(store, agent.job_id)
    if agent.node == agent.store_node:
        time.sleep(4 * spares.POLL_S)


def _run_completed(task: Any, job_id: str) -> bool:
    completed = read_completed(Path(task.run_dir))
    return completed is not None and completed.get("job_id") == job_id


def next_store(agent: NodeAgent, wait_s: float = NEXT_HOST_WAIT_S) -> NodeAgent:
    """The next node in line after the store's dead host that answers (or this one): every agent walks the same
    line, and a live node opens the new store as soon as it notices the old one is gone."""
    count = len(agent.hosts)
    for step in range(1, count):
        moved = replace(agent, store_node=(agent.store_node + step) % count, generation=agent.generation + step)
        if moved.store_node == agent.node or _answers(moved, wait_s):
            return moved
    raise RuntimeError(f"node {agent.node}: no node of the job answers for the rendezvous store")


def rendezvous_poll_s(nodes: int) -> float:
    """How often an agent waiting in the rendezvous reads its state, for a job of `nodes` agents."""
    return min(1.0, max(RENDEZVOUS_POLL_MIN_S, nodes * RENDEZVOUS_POLL_S_PER_NODE))


def _poll_rendezvous_every(poll_s: float) -> None:
    """Make torch's c10d rendezvous read its state every `poll_s` instead of every 1 s. Two fixed seconds pace
    it: `_delay(seconds=1)` between the reads of an agent that waits, and a state holder that serves its cached
    copy for `cache_duration=1` s; both are module globals of torch's dynamic_rendezvous, looked up at each
    call, so both are replaced here (the first round's random 0-0.3 s skew stays). Without those hooks
    (another torch), the rendezvous keeps its 1 s: slower restarts, nothing else."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    delay, holder = getattr(rdzv, "_delay", None), getattr(rdzv, "_BackendRendezvousStateHolder", None)
    if not callable(delay) or not isinstance(holder, type):
        return
    delay = getattr(delay, "__wrapped__", delay)  # once per process, however often the agent launches
    holder = getattr(holder, "__wrapped__", holder)

    def polled(seconds: float | tuple[float, float]) -> None:  # torch calls it by keyword
        delay(seconds=seconds if isinstance(seconds, tuple) else min(float(seconds), poll_s))

    class FreshStateHolder(holder):  # type: ignore[misc, valid-type]
        __wrapped__ = holder

        def __init__(self, backend: Any, settings: Any, cache_duration: float = 1) -> None:
            super().__init__(backend, settings, cache_duration=min(cache_duration, poll_s))
            self._judge = HeartbeatJudge(settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt)

        def _sanitize(self) -> None:
            if self._judge.may_judge(time.monotonic()):
                super()._sanitize()
            else:
                self._dead_nodes: list[Any] = []

    polled.__wrapped__ = delay  # type: ignore[attr-defined]
    rdzv._delay, rdzv._BackendRendezvousStateHolder = polled, FreshStateHolder  # type: ignore[misc]  # torch's


class HeartbeatJudge:
    """Whether this agent may call another dead for an old heartbeat. torch's rendezvous state holder drops every
    node whose last beat is older than keep_alive_interval x max_attempt (3 s here) at each sync. `scontrol
    suspend` stops every process of the job; at `scontrol resume` the first agent to run syncs before the others
    have beaten again and drops them all, itself included (its own beat is as old): the rendezvous starts a new
    round and every worker is stopped (seen in CI: SIGTERM 0.6 s after a 30 s suspension, the job lost). An
    agent whose own syncs were further apart than that window was stopped itself, so it judges no one for one
    more window, in which every live agent beats again; a node really dead is dropped a window later."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: float | None = None
        self._quiet_until = 0.0

    def may_judge(self, now: float) -> bool:
        if self._last is not None and now - self._last > self.window_s:
            log.warning(
                "agent: its own rendezvous syncs were %.1f s apart (the job suspended?): no node is "
                "judged dead for its heartbeat for %.0f s",
                now - self._last,
                self.window_s,
            )
            self._quiet_until = now + self.window_s
        self._last = now
        return now >= self._quiet_until


def _note_termination() -> None:
    """Set ENDING when the agent gets a termination signal. torch's agent registers its own handler for them at
    each start of its workers (`_terminate_process_handler`, a module global of torch's multiprocessing api,
    looked up then): the hook wraps that one. Without it (another torch), a node that ends before the others
    when the job is cancelled may be recorded as lost."""
    from torch.distributed.elastic.multiprocessing import api

    handler = getattr(api, "_terminate_process_handler", None)
    if not callable(handler):
        return
    handler = getattr(handler, "__wrapped__", handler)  # once per process, however often the agent launches

    def noted(signum: int, frame: Any) -> None:
        ENDING.set()
        handler(signum, frame)

    noted.__wrapped__ = handler  # type: ignore[attr-defined]
    api._terminate_process_handler = noted


def _bound_rendezvous_store_calls(seconds: float) -> None:
    """Give every store call of torch's c10d rendezvous `seconds` at most. Its backend sends them all through
    `C10dRendezvousBackend._call_store`; a store whose host lost power would otherwise hold the agent for
    good in its first read (spares.within says why), its workers blocked on the same silent node, and the job
    with them. A call that does not return raises torch's own RendezvousConnectionError, which ends the
    agent's launch like a closed store does (the store then moves); so does every later call of that backend,
    at once. Without that method (another torch), calls are not bounded: a silent store host hangs the job."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    call = getattr(c10d.C10dRendezvousBackend, "_call_store", None)
    if not callable(call):
        return
    call = getattr(call, "__wrapped__", call)  # once per process, however often the agent launches

    def bounded(backend: Any, store_op: str, *args: Any, **kwargs: Any) -> Any:
        if getattr(backend, "_hpctrain_silent", False):
            raise RendezvousConnectionError("The C10d store stopped answering earlier.")
        try:
            return spares.within(seconds, call, backend, store_op, *args, **kwargs)
        except spares.StoreSilent as exc:
            backend._hpctrain_silent = True
            raise RendezvousConnectionError(f"The C10d store did not answer a {store_op} in {seconds:.0f} s.") from exc

    bounded.__wrapped__ = call  # type: ignore[attr-defined]
    c10d.C10dRendezvousBackend._call_store = bounded  # type: ignore[method-assign, assignment]  # torch's own


def _host_lighthouse(agent: NodeAgent) -> LighthouseProcess | None:
    """torchft's lighthouse for the replica groups (None without groups), on this node's store port's twin, in
    a process of its own (hpctrain.distributed.lighthouse: not in this one, which forks the workers): every
    group's workers reach it at `agent.lighthouse_url`."""
    if agent.groups == 1:
        return None
    return LighthouseProcess.start(
        f"0.0.0.0:{agent.lighthouse_port}",
        agent.lighthouse.min_replicas,
        agent.lighthouse.join_timeout_ms,
        agent.lighthouse.heartbeat_timeout_ms,
    )


def _host_store(agent: NodeAgent) -> Any:
    """Open the store's server in this process before torch's rendezvous does: torch's own TCPStore for the
    endpoint (multi_tenant) then shares it, and a spare that waits outside the rendezvous can host it too."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        "0.0.0.0",
        agent.port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=spares.READ_TIMEOUT_S),
    )


def _still_answers(agent: NodeAgent, wait_s: float = 1.0) -> bool:
    """Whether the store, which just failed a call, still answers one: nothing takes a connection on its port
    (refused, or silent for `wait_s`) and it is gone at once; a socket that connects may still belong to a
    process in its last moments (its memory freed before its files are closed), so the store must also answer
    a call. (A store client alone would retry a refused connection for its whole timeout and back off once
    more: 5.5 s for a 3 s timeout, spent by every agent before the store moves.)"""
    try:
        socket.create_connection((agent.store_host, agent.port), timeout=wait_s).close()
    except OSError:
        return False
    try:
        spares.connect(agent.store_host, agent.port, wait_s).check(["hpctrain/ping"])
        return True
    except Exception:
        return False


def _answers(agent: NodeAgent, wait_s: float) -> bool:
    """Whether the agent's store takes connections within `wait_s`."""
    try:
        spares.connect(agent.store_host, agent.port, wait_s)
        return True
    except Exception:
        return False


def _end_job_after_run() -> None:
    """The run is over (done, or its restarts spent), but the batch script died with node 0 and Slurm would
    hold the other nodes until the time limit: end the job, once the other agents had a moment to return."""
    from hpctrain.scheduler import scheduler_for

    time.sleep(2)
    scheduler_for().end_self()


def _log_to_stderr(node: int) -> None:
    """The agents' own lines (hpctrain.distributed.*) in the task's stderr; torch's have their own handler."""
    logger = logging.getLogger("hpctrain.distributed")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[agent node {node}] %(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _plain_torch_log_format() -> None:
    """torch's own log formatter imports torch._dynamo (and sympy) the first time it formats a traceback: 1.1 s
    spent in the agent at the first failed worker, every agent alike, before any restart. The agent's torch
    lines get the standard formatter instead (what TORCH_LOGS_FORMAT would choose, had it been set before
    torch was imported)."""
    plain = logging.Formatter(
        "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(name)s:%(lineno)d] %(message)s", "%m%d %H:%M:%S"
    )
    torch_loggers = [
        logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger)
    ]
    for handler in (h for logger in torch_loggers for h in logger.handlers):
        formatter = handler.formatter
        if type(formatter).__name__ == "TorchLogsFormatter" and not getattr(formatter, "_is_trace", False):
            handler.setFormatter(plain)


def _leave_to_workers(signum: int, frame: Any) -> None:
    """USR2 (time limit, preemption) is the workers' to act on: they save, then requeue the job."""
    log.info("agent: %s left to the workers", signal.Signals(signum).name)
