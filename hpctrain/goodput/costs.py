"""Checkpoint costs as measured on a cluster (a JSON file the checkpoint bench writes) and their scaling.

Schema `hpctrain.goodput.costs/1` (times in seconds, bytes per node):

    {
      "schema": "hpctrain.goodput.costs/1",
      "state_bytes_per_node": 4.79e9,   # checkpoint bytes one node saved in the measurement; optional
      "tiers": {                        # any names; "durable" defaults to true for "shared" only
        "ram":    {"blocked_s": 1.2, "write_s": 0.5, "load_s": 0.5, "durable": false},
        "shared": {"blocked_s": 1.2, "write_s": 24.5, "load_s": 24.5, "durable": true}
      },
      "restart_s": 300,                 # requeue delay + start + init + warm-up, without the load
      "p_fast": 0.3,                    # optional: share of failures that leave every node usable
      "source": "free text: host, date, bench arguments"   # optional
    }

blocked_s is the time training stops per save, write_s the background write until commit (0 if
synchronous), load_s the read at a restart (defaults to write_s). Scaling: a save moves each node's shard of
the state, so every cost scales with the bytes per node (state / nodes, fully sharded as with ZeRO-3 and DCP);
a durable tier's write and load (and its blocked time when write_s is 0: a synchronous save) are also bounded
below by total bytes / the file system's aggregate bandwidth.
Without state_bytes_per_node the costs are used as they are at every scale.

Replica groups (recovery=replicas|diloco) add two network costs: a rejoining group's heal, its state from a
live peer (`heal_seconds`), and DiLoCo's outer all-reduce across the groups (`outer_sync_seconds`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.goodput.model import TierCost

SCHEMA = "hpctrain.goodput.costs/1"

# The defaults where nothing was measured: tools/goodput.py's flags and the dry-run plan's estimate (docs/goodput.md)
STAGE_GBPS = 4.0  # per node: staging a save into host memory (blocking)
RAM_GBPS = 10.0  # per node: the RAM tier's write and read
SHARED_NODE_GBPS = 2.0  # per node: to the shared file system
SHARED_GBPS = 40.0  # the file system's aggregate bandwidth for the job
RESTART_S = 300.0  # requeue + start + init + warm-up, without the load
IN_ALLOCATION_S = 10.0  # a restart inside the allocation (the agents; a replica group on a spare), without the load
P_FAST = 0.3  # share of failures that leave every node usable (Llama 3: most unexpected interruptions were hardware)
BYTES_PER_PARAM = 14.0  # checkpoint bytes per parameter: bf16 weights 2 + fp32 master 4 + Adam 8
PEER_GBPS = 10.0  # per node: a live peer's state to a rejoining group, or DiLoCo's sync (torchft over the node's NIC)
QUORUM_S = 0.002  # torchft's quorum round trip per step: 2.0-2.3 ms median measured here (2 replicas, gloo, CPU)
SYNC_BYTES_PER_PARAM = 4.0  # DiLoCo's pseudo-gradient, fp32


@dataclass(frozen=True)
class MeasuredTier:
    cost: TierCost
    durable: bool


@dataclass(frozen=True)
class MeasuredCosts:
    """The costs of one measurement, for state_bytes_per_node bytes per node (None: do not scale)."""

    tiers: dict[str, MeasuredTier]
    restart_s: float
    p_fast: float | None = None
    state_bytes_per_node: float | None = None


def parse_costs(data: dict[str, Any]) -> MeasuredCosts:
    """Validate a costs object; errors name the offending key, since a bench script writes it."""
    if data.get("schema", SCHEMA) != SCHEMA:
        raise ValueError(f"costs: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    tiers_in = data.get("tiers")
    if not isinstance(tiers_in, dict) or not tiers_in:
        raise ValueError("costs: 'tiers' must be a non-empty object of tier name -> costs")
    tiers = {}
    for name, t in tiers_in.items():
        if "blocked_s" not in t:
            raise ValueError(f"costs: tiers.{name}.blocked_s is missing")
        write = float(t.get("write_s", 0.0))
        cost = TierCost(float(t["blocked_s"]), write, float(t.get("load_s", write)))
        if min(cost.blocked_s, cost.write_s, cost.load_s) < 0:
            raise ValueError(f"costs: tiers.{name} has a negative time")
        tiers[name] = MeasuredTier(cost, bool(t.get("durable", name == "shared")))
    if not any(t.durable for t in tiers.values()):
        raise ValueError('costs: no durable tier (set "durable": true on the shared-storage tier)')
    p_fast = data.get("p_fast")
    if p_fast is not None and not 0.0 <= float(p_fast) <= 1.0:
        raise ValueError("costs: p_fast must lie in [0, 1]")
    state = data.get("state_bytes_per_node")
    return MeasuredCosts(
        tiers,
        float(data.get("restart_s", 0.0)),
        None if p_fast is None else float(p_fast),
        None if state is None else float(state),
    )


def load_costs(path: str | Path) -> MeasuredCosts:
    return parse_costs(json.loads(Path(path).read_text()))


def costs_from_bandwidths(
    stage_gbps: float, ram_gbps: float, shared_node_gbps: float, restart_s: float, p_fast: float | None = None
) -> MeasuredCosts:
    """Costs of 1 GB per node from per-node bandwidths (GB/s): both tiers stage into host memory (blocking),
    then write to /dev/shm or to the shared file system in the background."""
    return MeasuredCosts(
        {
            "ram": MeasuredTier(TierCost(1.0 / stage_gbps, 1.0 / ram_gbps, 1.0 / ram_gbps), False),
            "shared": MeasuredTier(TierCost(1.0 / stage_gbps, 1.0 / shared_node_gbps, 1.0 / shared_node_gbps), True),
        },
        restart_s,
        p_fast,
        1e9,
    )


def node_state_bytes(params: float, bytes_per_param: float, n_gpus: int, gpus_per_node: int) -> float:
    """Checkpoint bytes per node with the state fully sharded over all GPUs."""
    return params * bytes_per_param / max(1.0, n_gpus / gpus_per_node)


def scale_tier(
    tier: MeasuredTier,
    measured_bytes: float | None,
    node_bytes: float,
    total_bytes: float,
    aggregate_gbps: float | None,
) -> TierCost:
    """A tier's costs at node_bytes per node: linear in the bytes per node, and for a durable tier no faster
    than the file system's aggregate bandwidth allows for the whole state."""
    c = tier.cost
    if measured_bytes is None:
        return c
    r = node_bytes / measured_bytes
    blocked, write, load = c.blocked_s * r, c.write_s * r, c.load_s * r
    if tier.durable and aggregate_gbps:
        floor = total_bytes / (aggregate_gbps * 1e9)
        write, load = max(write, floor), max(load, floor)
        if c.write_s == 0.0:  # synchronous: training waits for the file system itself
            blocked = max(blocked, floor)
    return TierCost(blocked, write, load)


def pick_tiers(costs: MeasuredCosts, fast: str | None, slow: str | None) -> tuple[str | None, str]:
    """The two tiers the model uses: named ones, else the cheapest node-local and the cheapest durable tier."""

    def cheapest(durable: bool) -> str | None:
        names = [n for n, t in costs.tiers.items() if t.durable == durable]
        return min(names, key=lambda n: costs.tiers[n].cost.blocked_s + costs.tiers[n].cost.write_s, default=None)

    slow = slow or cheapest(True)
    fast = fast or cheapest(False)
    for name in (fast, slow):
        if name is not None and name not in costs.tiers:
            raise ValueError(f"costs: no tier {name!r} (have {', '.join(costs.tiers)})")
    assert slow is not None  # parse_costs requires a durable tier
    return fast, slow


def heal_seconds(total_bytes: float, nodes: int, groups: int, peer_gbps: float) -> float:
    """A rejoining group's state from a live peer: each of its nodes receives its shard of the whole state
    (every group holds a whole copy, sharded over its nodes / groups nodes) from its counterpart, in parallel."""
    return total_bytes / max(1.0, nodes / groups) / (peer_gbps * 1e9)


def outer_sync_seconds(params: float, bytes_per_param: float, nodes: int, groups: int, peer_gbps: float) -> float:
    """DiLoCo's outer step: a ring all-reduce of each node's shard of the pseudo-gradient across the groups,
    2 (R - 1) / R of the shard sent and received per node."""
    if groups < 2:
        return 0.0
    shard = params * bytes_per_param / max(1.0, nodes / groups)
    return 2.0 * (groups - 1) / groups * shard / (peer_gbps * 1e9)
