"""The callable submitit pickles and runs on every task.

It carries only plain data (the resolved config as a dict, the run directory and the Layout the login node
resolved and checked), so unpickling on a compute node needs nothing from the login node's session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config.layout import Layout


@dataclass
class TrainTask:
    config: dict[str, Any]
    run_dir: str
    layout: Layout

    def __call__(self) -> dict[str, Any]:
        launcher = self.config["launcher"]
        if not launcher["in_allocation"]:
            from hpctrain.train.loop import train

            return train(self.config, self.run_dir, self.layout)
        # This task is its node's agent: it starts the node's workers and restarts them in the allocation.
        from hpctrain.distributed.elastic import Lighthouse, agent_from_submitit, run_agent
        from hpctrain.records.jobs import read_report
        from hpctrain.records.paths import RunPaths
        from hpctrain.train.worker import run_worker  # torch and the training stack, imported once, before forking

        # With replica groups (recovery=replicas|diloco) the layout is one group's: the job trains on every group's
        recovery = self.config["recovery"]
        agent = agent_from_submitit(
            self.layout.job_nodes,
            self.layout.gpus_per_node,
            int(launcher["max_restarts"]),
            int(launcher["rendezvous_timeout_s"]),
            int(self.config["elastic"]["min_nodes"]),
            groups=self.layout.replicas,
            lighthouse=Lighthouse(
                int(recovery["min_replicas"]), int(recovery["heartbeat_timeout_ms"]), int(recovery["join_timeout_ms"])
            ),
        )
        results = run_agent(agent, self, run_worker)
        report = read_report(Path(self.run_dir))
        if report and report.get("job_id") == agent.job_id:  # the workers stopped a restart loop
            raise RunStopped(f"run stopped: {report['why']} (report: {RunPaths(Path(self.run_dir)).failed})")
        leave = sorted({h for r in results.values() if isinstance(r, dict) for h in r.get("leave", [])})
        if leave:  # the job fails, and its supervisor resubmits it without these hosts
            raise LeaveAllocation(f"the health checks condemned {','.join(leave)}: leaving the allocation")
        return {"node": agent.node, "workers": results}


class LeaveAllocation(RuntimeError):
    """Nodes of the job were condemned (pre-flight, hang blame): restarting on them cannot help."""


class RunStopped(RuntimeError):
    """The workers found the same failure twice in a row and wrote FAILED.json: the job ends FAILED."""
