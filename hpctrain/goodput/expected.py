"""The goodput one configured run can expect, for the dry-run plan: the model (model.py) fed from the config and the
planner's step time, with costs.py's default bandwidths where the run has measured nothing (tools/goodput.py
takes measured costs). It says which recovery mode the run uses and, for replica groups, what restart would give.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import PurePosixPath
from typing import Any

from hpctrain.config.schema import Config, TierConfig
from hpctrain.goodput import costs as defaults
from hpctrain.goodput.costs import (
    costs_from_bandwidths,
    heal_seconds,
    node_state_bytes,
    outer_sync_seconds,
    scale_tier,
)
from hpctrain.goodput.model import (
    CheckpointPolicy,
    Failures,
    Loss,
    Replicas,
    TierCost,
    daly_interval,
    expected_goodput,
    loss_split,
    mtbf_s,
    replica_loss,
    restart_cost,
)

# Paths whose checkpoints stay on their node (the RAM tier, node-local disks); any other absolute path, and every
# path inside the run directory, is taken as shared storage that survives a node
_NODE_LOCAL = ("/dev/shm", "/tmp", "/run", "/var/tmp")


def node_local(tier: TierConfig) -> bool:
    """A tier whose checkpoints are lost with their node, guessed from its path (the run checks it by probing)."""
    path = PurePosixPath(tier.path)
    if not path.is_absolute():
        return False
    return any(path.is_relative_to(root) for root in _NODE_LOCAL) or any("local" in part for part in path.parts)


def interval_s(tier: TierConfig, cost: TierCost, step_s: float, mtbf: float) -> float:
    """The tier's interval in seconds: the sooner of its steps and minutes; Daly's optimum when it is automatic."""
    if tier.auto:
        return max(daly_interval(max(cost.blocked_s, 1e-3), mtbf), cost.write_s)
    given = [x for x in (60.0 * tier.interval_minutes, tier.interval_steps * step_s) if x > 0]
    return min(given, default=math.inf)


def run_policy(cfg: Config, params: float, step_s: float, mtbf: float, copies: int = 1) -> CheckpointPolicy | None:
    """The run's tiers as the model's two: the shared tier and the node-local tier that save most often, costed
    from the default bandwidths at this run's state per node, `copies` groups each saving a whole copy (replica
    groups save their own checkpoints); None without a periodic shared tier."""
    ckpt, cluster = cfg.checkpoint, cfg.cluster
    if not ckpt.enabled:
        return None
    n_gpus = cluster.nodes * cluster.gpus_per_node
    node_bytes = node_state_bytes(params, defaults.BYTES_PER_PARAM, n_gpus // copies, cluster.gpus_per_node)
    measured = costs_from_bandwidths(
        defaults.STAGE_GBPS, defaults.RAM_GBPS, defaults.SHARED_NODE_GBPS, defaults.RESTART_S
    )
    total = copies * params * defaults.BYTES_PER_PARAM

    def cost(name: str) -> TierCost:
        return scale_tier(measured.tiers[name], measured.state_bytes_per_node, node_bytes, total, defaults.SHARED_GBPS)

    slow, fast = cost("shared"), cost("ram")
    tau_slow = min((interval_s(t, slow, step_s, mtbf) for t in ckpt.tiers if not node_local(t)), default=math.inf)
    tau_fast = min((interval_s(t, fast, step_s, mtbf) for t in ckpt.tiers if node_local(t)), default=math.inf)
    if math.isinf(tau_slow):
        return None
    if math.isinf(tau_fast):
        return CheckpointPolicy(slow, tau_slow)
    return CheckpointPolicy(slow, tau_slow, fast, tau_fast)


def run_replicas(cfg: Config, params: float, step_s: float) -> Replicas:
    """The run's replica groups (recovery.*) with the default network costs at its scale."""
    rec, cluster = cfg.recovery, cfg.cluster
    diloco = rec.mode == "diloco"
    groups = max(1, rec.groups)
    sync = outer_sync_seconds(params, defaults.SYNC_BYTES_PER_PARAM, cluster.nodes, groups, defaults.PEER_GBPS)
    return Replicas(
        groups=groups,
        step_s=step_s,
        detect_s=rec.heartbeat_timeout_ms / 1e3,
        group_restart_s=defaults.IN_ALLOCATION_S,
        heal_s=heal_seconds(params * defaults.BYTES_PER_PARAM, cluster.nodes, groups, defaults.PEER_GBPS),
        quorum_s=defaults.QUORUM_S,
        min_replicas=min(max(1, rec.min_replicas), groups),
        p_spare=1.0 if cluster.spare_nodes else 0.0,
        requeue_s=60.0 * cluster.time_min / 2.0,  # a group without a spare is back when the job requeues
        sync_every=max(1, rec.sync_every) if diloco else 1,
        sync_s=sync if diloco else 0.0,
    )


def run_failures(cfg: Config) -> Failures:
    """The job's failures: its MTBF at cluster.failure_rate_per_gpu_day, and the restart of every rank, inside
    the allocation where the agents can (every failure with spares or shrinking, else crashes and hangs)."""
    cluster = cfg.cluster
    m = mtbf_s(cluster.failure_rate_per_gpu_day, cluster.nodes * cluster.gpus_per_node)
    if not cfg.launcher.in_allocation:
        p_stay = 0.0
    elif cluster.spare_nodes or cfg.elastic.min_nodes:
        p_stay = 1.0
    else:
        p_stay = defaults.P_FAST
    restart = restart_cost(defaults.RESTART_S, 0.0, p_stay, defaults.IN_ALLOCATION_S)
    return Failures(m, defaults.P_FAST, restart)


def run_goodput(cfg: Config, params: float, step_s: float) -> dict[str, Any]:
    """The expected goodput of the run in its recovery mode, and in restart mode for comparison; `reason` instead
    when the model has nothing to go on (no periodic shared checkpoint: a failure would restart from step 0)."""
    failures = run_failures(cfg)
    mode = cfg.recovery.mode
    rate = cfg.cluster.failure_rate_per_gpu_day
    out: dict[str, Any] = {
        "mode": mode,
        "failure_rate_per_gpu_day": rate,
        "mtbf_h": failures.mtbf_s / 3600 if math.isfinite(failures.mtbf_s) else None,
        "step_s": step_s,
    }
    policy = run_policy(cfg, params, step_s, failures.mtbf_s)
    if policy is None:
        return {**out, "reason": "no shared checkpoint tier saves periodically: a failure restarts from step 0"}
    restart = expected_goodput(policy, failures)
    out["restart_goodput"] = restart
    loss: Loss = loss_split(policy, failures)
    if mode in ("replicas", "diloco"):
        replicas = run_replicas(cfg, params, step_s)
        own = run_policy(cfg, params, step_s, failures.mtbf_s, replicas.groups)
        assert own is not None  # the same tiers as `policy`
        loss = replica_loss(own, failures, replicas)
        out.update(goodput=loss.goodput, heal_s=replicas.heal_s, sync_s=replicas.sync_s)
        if loss.dominant == "groups out" and not replicas.p_spare:
            out["hint"] = "a group that loses a node is out until the job requeues: give the job cluster.spare_nodes"
    else:
        out["goodput"] = restart
    return {**out, "dominant": loss.dominant, "loss": asdict(loss)}


def describe(expected: dict[str, Any]) -> str:
    """The plan's goodput line."""
    if "reason" in expected:
        return f"not estimated: {expected['reason']}"
    mode, rate = expected["mode"], expected["failure_rate_per_gpu_day"]
    vs = f" (restart: {expected['restart_goodput']:.1%})" if mode != "restart" else ""
    every = f"a failure every {expected['mtbf_h']:.2f} h" if expected["mtbf_h"] else "no failures"
    return (
        f"expected {expected['goodput']:.1%} with recovery={mode}{vs}: {every} "
        f"({rate:.2%} of GPUs a day), most lost to {expected['dominant']}"
        + (f" ({expected['hint']})" if "hint" in expected else "")
        + "; the model at default costs (tools/goodput.py, docs/goodput.md)"
    )
