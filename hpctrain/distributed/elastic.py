"""One agent per node: torch.distributed.elastic restarts the node's workers inside the allocation.

With `launcher.in_allocation` (the default) each Slurm task is one node's agent, not a training rank: it runs
torch.distributed.elastic's `LocalElasticAgent` (what torchrun is built on) with the c10d rendezvous, and
the agent forks one worker per GPU (hpctrain/train/worker.py) from itself, the training stack imported
once. When a worker raises, dies (SIGKILL, the OOM killer) or is ended by the hang watchdog, every agent
stops its workers, the agents meet again in the rendezvous, and new workers start on the same nodes with the
same job id: no sbatch, no queue.
The workers resume from the newest checkpoint, the node-local RAM tier first.

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
- a node that loses power fails nothing (its peers block in collectives): a spare notices its beats stop, and
  in a job that may shrink without spares the training agents watch each other's beats;
- torch's rendezvous paces itself with a fixed 1 s (a sleep between reads, a 1 s state cache): both follow
  the job's size instead (`rendezvous_poll_s`);
- submitit's USR2 handler would requeue from the agent: the agent ignores USR2, and the workers (which
  Slurm signals too, as every process of the step) save and requeue as without agents.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpctrain.distributed import spares
from hpctrain.distributed.environment import node_addresses, port_for_job
from hpctrain.records.failures import attempt_key, last_restart
from hpctrain.records.jobs import read_completed
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
class NodeAgent:
    """What one node's agent needs: its place among the nodes and the run's limits."""

    job_id: str
    node: int  # this agent's node in the job: 0 .. nodes + spares - 1
    nodes: int  # the nodes that train (cluster.nodes); the ones after them are hot spares
    workers: int  # per node: one per GPU (processes on CPU)
    hosts: tuple[str, ...]  # every node's address, by node index
    max_restarts: int
    join_timeout_s: int
    min_nodes: int = 0  # elastic.min_nodes: go on with this many after losing nodes (0: all `nodes`)
    spares: int = 0  # hot spare nodes after the `nodes` that train (cluster.spare_nodes)
    store_node: int = 0  # the node whose agent hosts the rendezvous store
    generation: int = 0  # how often the store moved (each move: a new store on a new port)

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

    def launch_config(self, max_restarts: int) -> Any:
        from torch.distributed.launcher.api import LaunchConfig

        low = self.min_nodes or self.nodes
        config = LaunchConfig(
            min_nodes=low,
            max_nodes=self.nodes,
            nproc_per_node=self.workers,
            run_id=self.job_id,
            role="hpctrain",
            rdzv_backend="c10d",
            rdzv_endpoint=self.endpoint,
            rdzv_configs={
                "is_host": self.node == self.store_node,
                "join_timeout": self.join_timeout_s,
                "last_call_timeout": LAST_CALL_S if low == self.nodes else SHRINK_LAST_CALL_S,
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
    nodes: int, workers: int, max_restarts: int, join_timeout_s: int, min_nodes: int = 0
) -> NodeAgent:
    """This node's agent, from submitit's view of the job (one task per node; `nodes` of them train)."""
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
    )


def run_agent(agent: NodeAgent, task: Any, worker: Callable[[Any], Any]) -> dict[int, Any]:
    """Run this node's workers until they finish, restarting all of them on any failure (every node alike).

    `worker(task)` is what each forked worker runs (hpctrain.train.worker.run_worker: the caller imports it, torch
    and the training stack with it, once, before the fork; this module stays below the training loop). `task`
    (config, run directory, layout) goes to every worker. Returns the workers' results by local rank;
    raises torch's ChildFailedError once `max_restarts` restarts are spent. When the rendezvous store's host
    dies, the store moves to the next live node and the agents go on there.
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
    _poll_rendezvous_every(rendezvous_poll_s(len(agent.hosts)))
    _bound_rendezvous_store_calls(spares.READ_TIMEOUT_S + spares.CALL_MARGIN_S)
    slot: int | None = None if agent.spare else agent.node
    while True:
        server = _host_store(agent) if agent.node == agent.store_node else None  # torch's store reuses it
        base = last_restart(Path(task.run_dir), _run_key(agent.job_id)) + 1 if agent.generation else 0
        os.environ["HPCTRAIN_RESTART_BASE"] = str(base)
        try:
            results, slot = _launch(agent, task, worker, slot, agent.max_restarts - base)
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
            agent = next_store(agent)
            log.warning(
                "node %d: the rendezvous store is now on node %d (%s)", agent.node, agent.store_node, agent.endpoint
            )
            continue
        if agent.generation and server is not None:  # node 0, the batch host, is gone: no one else ends the job
            _end_job_after_run()
        return results


def _launch(
    agent: NodeAgent, task: Any, worker: Callable[[Any], Any], slot: int | None, max_restarts: int
) -> tuple[dict[int, Any], int | None]:
    """One launch of torch's agent against the current store: (the workers' results, the slot this node held)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # What the agent holds now (torch, the training stack: 300k objects) is never garbage: out of the
    # collector's sight, a worker's full collections stop scanning it (0.19 s each, several in a resume) and
    # stop touching, hence copying, the pages it shares with the agent (the gc module's advice for forking).
    gc.freeze()
    if max_restarts < 0:
        raise RuntimeError(f"node {agent.node}: the restarts of launcher.max_restarts={agent.max_restarts} are spent")
    may_shrink = 0 < agent.min_nodes < agent.nodes
    if not agent.spares and not may_shrink:
        log.info(
            "node %d: agent for %d worker(s), rendezvous %s, up to %d restarts in the allocation",
            agent.node,
            agent.workers,
            agent.endpoint,
            max_restarts,
        )
        return elastic_launch(agent.launch_config(max_restarts), worker)(task), slot
    store = spares.connect(agent.store_host, agent.port, agent.join_timeout_s)
    if slot is not None and not spares.hold(store, agent.job_id, slot, agent.node):
        log.info("node %d: slot %d was taken while the store moved; this node is a spare now", agent.node, slot)
        slot = None
    if slot is None:
        log.info("node %d: hot spare, waiting for one of %d nodes to go", agent.node, agent.nodes)
        slot = spares.wait_for_vacancy(store, agent.job_id, agent.nodes, agent.node, moved=agent.generation > 0)
        if slot is None:
            return {}, None
    log.info(
        "node %d (slot %d of %d): agent for %d worker(s), rendezvous %s, up to %d restarts in the allocation",
        agent.node,
        slot,
        agent.nodes,
        agent.workers,
        agent.endpoint,
        max_restarts,
    )
    beat = spares.Heartbeat(agent.store_host, agent.port, agent.job_id, slot, agent.node, agent.join_timeout_s)
    beat.start()
    # No spare to notice a node that went silent (power lost: its peers block, nothing fails): the agents
    # watch each other's beats and restart the group without it.
    watch = None
    if may_shrink and not agent.spares:
        watch = spares.PeerWatch(
            agent.store_host,
            agent.port,
            agent.job_id,
            agent.nodes,
            slot,
            agent.join_timeout_s,
            own_workers,
            lambda _: _stop(own_workers()),
        ).start()
    try:
        results = elastic_launch(agent.launch_config(max_restarts), worker)(task)
        _announce_end(agent)  # before the beat stops: a watching peer must not take the end for a silence
    except ChildFailedError:  # the run is over, failed: the spares leave (a lost store is no end: no word)
        _announce_end(agent)
        raise
    finally:
        if watch is not None:
            watch.stop()
        beat.stop()
    return results, slot


def _run_key(job_id: str) -> str:
    """The records' key of this run of the job (a requeued job keeps its id: hpctrain.records.failures)."""
    return attempt_key(job_id, 0, int(scheduler_for().job_context().get("restart_count") or 0))


def own_workers() -> set[int]:
    """This agent's workers: its child processes (torch's agent forks them from its main thread)."""
    children: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            children.update(int(pid) for pid in (task / "children").read_text().split())
    return children


def _stop(workers: set[int]) -> None:
    """SIGTERM the workers: they stop at the step boundary, or, blocked on a peer that is gone, leave through
    the watchdog within a few step times; torch's agent then restarts the group, and the rendezvous drops the
    silent node once its keep-alive lapses."""
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _announce_end(agent: NodeAgent) -> None:
    """The run is over: the spares leave. The store's host keeps it open a moment longer, so that a spare reads
    the word before the store goes (else it would take the closed store for a dead host and move it)."""
    with contextlib.suppress(Exception):  # the store's host may have closed it already
        spares.announce_end(spares.connect(agent.store_host, agent.port, 5), agent.job_id)
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
