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
- the rendezvous store lives in node 0's agent, the node that also runs the batch script: Slurm ends the
  job when that node dies anyway, so it adds no point of failure of its own;
- a new interpreter per worker would import torch again on every restart (2.5-4 s of each): the workers are
  forked from the agent, which never touches CUDA or runs a torch op, so forking it is safe;
- a spare agent waiting in the rendezvous makes the running agents restart every second: spares wait outside
  it until a node is gone (hpctrain/distributed/spares.py);
- submitit's USR2 handler would requeue from the agent: the agent ignores USR2, and the workers (which
  Slurm signals too, as every process of the step) save and requeue as without agents.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from hpctrain.distributed import spares
from hpctrain.distributed.environment import first_node_address, port_for_job

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 0.2  # how often the agent polls its workers: part of the detection time of a crash
LAST_CALL_S = 1  # a fixed node count never needs the rendezvous' last call
# A job that may shrink closes a round once min_nodes are in and no one came for this long: long enough for
# every agent's start-up skew (one who misses the first round is admitted by one more restart), short
# enough to add little to each restart.
SHRINK_LAST_CALL_S = 3
KEEP_ALIVE_S = 1  # a dead agent is noticed after KEEP_ALIVE_S x KEEP_ALIVE_MISSES
KEEP_ALIVE_MISSES = 3


@dataclass(frozen=True)
class NodeAgent:
    """What one node's agent needs: its place among the nodes and the run's limits."""

    job_id: str
    node: int  # this agent's node in the job: 0 .. nodes + spares - 1
    nodes: int  # the nodes that train (cluster.nodes); the ones after them are hot spares
    workers: int  # per node: one per GPU (processes on CPU)
    store_host: str  # the rendezvous store: node 0's agent hosts it
    max_restarts: int
    join_timeout_s: int
    min_nodes: int = 0  # elastic.min_nodes: go on with this many after losing nodes (0: all `nodes`)
    spares: int = 0  # hot spare nodes after the `nodes` that train (cluster.spare_nodes)

    @property
    def port(self) -> int:
        # Not port_for_job itself: the same job's workers (without agents) rendezvous there.
        return port_for_job(self.job_id + "/rendezvous")

    @property
    def endpoint(self) -> str:
        return f"{self.store_host}:{self.port}"

    @property
    def spare(self) -> bool:
        return self.node >= self.nodes

    def launch_config(self) -> Any:
        from torch.distributed.launcher.api import LaunchConfig

        low = self.min_nodes or self.nodes
        return LaunchConfig(
            min_nodes=low, max_nodes=self.nodes, nproc_per_node=self.workers, run_id=self.job_id,
            role="hpctrain", rdzv_backend="c10d", rdzv_endpoint=self.endpoint,
            rdzv_configs={"is_host": self.node == 0, "join_timeout": self.join_timeout_s,
                          "last_call_timeout": LAST_CALL_S if low == self.nodes else SHRINK_LAST_CALL_S,
                          "keep_alive_interval": KEEP_ALIVE_S,
                          "keep_alive_max_attempt": KEEP_ALIVE_MISSES},
            max_restarts=self.max_restarts, monitor_interval=MONITOR_INTERVAL_S, start_method="fork")


def agent_from_submitit(nodes: int, workers: int, max_restarts: int, join_timeout_s: int, min_nodes: int = 0
                        ) -> NodeAgent:
    """This node's agent, from submitit's view of the job (one task per node; `nodes` of them train)."""
    import submitit

    je = submitit.JobEnvironment()
    return NodeAgent(job_id=str(je.job_id), node=je.node, nodes=nodes, workers=workers, store_host=first_node_address(je),
                     max_restarts=max_restarts, join_timeout_s=join_timeout_s, min_nodes=min_nodes,
                     spares=je.num_nodes - nodes)


def run_agent(agent: NodeAgent, task: Any) -> dict[int, Any]:
    """Run this node's workers until they finish, restarting all of them on any failure (every node alike).

    `task` (config, run directory, layout) goes to every worker. Returns the workers' results by local rank;
    raises torch's ChildFailedError once `max_restarts` restarts are spent.
    """
    from torch.distributed.launcher.api import elastic_launch

    from hpctrain.train.worker import (
        run_worker,  # torch and the training stack, imported once, before forking
    )

    _log_to_stderr(agent.node)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["HPCTRAIN_JOB_ID"] = agent.job_id
    signal.signal(signal.SIGUSR2, _leave_to_workers)
    slot = agent.node
    if agent.spare:
        log.info("node %d: hot spare, waiting for one of %d nodes to go", agent.node, agent.nodes)
        slot = spares.wait_for_vacancy(spares.connect(agent.store_host, agent.port, agent.join_timeout_s),
                                       agent.job_id, agent.nodes, agent.node)
        if slot is None:
            return {}
    log.info("node %d (slot %d of %d): agent for %d worker(s), rendezvous %s, up to %d restarts in the allocation",
             agent.node, slot, agent.nodes, agent.workers, agent.endpoint, agent.max_restarts)
    if not agent.spares:
        return elastic_launch(agent.launch_config(), run_worker)(task)
    beat = spares.Heartbeat(agent.store_host, agent.port, agent.job_id, slot, agent.node, agent.join_timeout_s)
    beat.start()
    try:
        return elastic_launch(agent.launch_config(), run_worker)(task)
    finally:
        beat.stop()
        with contextlib.suppress(Exception):  # node 0's agent may have closed the store already
            spares.announce_end(spares.connect(agent.store_host, agent.port, 5), agent.job_id)


def _log_to_stderr(node: int) -> None:
    """The agents' own lines (hpctrain.distributed.*) in the task's stderr; torch's have their own handler."""
    logger = logging.getLogger("hpctrain.distributed")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[agent node {node}] %(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _leave_to_workers(signum: int, frame: Any) -> None:
    """USR2 (time limit, preemption) is the workers' to act on: they save, then requeue the job."""
    log.info("agent: %s left to the workers", signal.Signals(signum).name)
