"""Topology-aware NCCL settings for one task, from the cluster config and what its node reports.

Decisions (each unit-tested on captured `nvidia-smi topo -m`, ibstat and /sys/class/infiniband layouts):
- NCCL_IB_HCA lists the node's compute HCAs, in NCCL's exact-match form with the active port
  (`=mlx5_0:1,mlx5_1:1`): without the leading `=` each name is a prefix, and `mlx5_1` also selects `mlx5_10`.
  The rank's nearest HCA (PIX/PXB before PHB/NODE/SYS) comes first. A compute HCA is one with an ACTIVE
  port (a down port would make NCCL try it and time out) that is not a storage or management NIC:
  1. never one named in cluster.nccl.exclude_hca (the site's storage HCAs, exact names);
  2. when any active port is InfiniBand, the Ethernet ones are left out: the compute fabric is IB, and an
     Ethernet port there is the storage/front-end network (an IB port cannot reach a RoCE port);
  3. when `nvidia-smi topo -m` names the HCAs, one that is the nearest NIC of no GPU is left out: compute
     NICs sit next to the GPUs (one or two per PCIe switch), storage NICs hang off the CPU (the DGX A100's
     mlx5_4/5/10/11, the DGX H100's storage ConnectX-7s). Skipped when the names do not match sysfs.
  cluster.nccl.ib_hca, when set, is passed verbatim instead.
- NCCL_IB_GID_INDEX=3 (RoCEv2 over IPv4, by convention) only when every selected HCA is RoCE (link layer
  Ethernet); InfiniBand needs none, and on a mixed node it would break the IB ports. NCCL >= 2.21 picks the
  RoCEv2 GID itself; set cluster.nccl.ib_gid_index where index 3 is not the right one.
- NCCL_SOCKET_IFNAME only when cluster.nccl.socket_ifname is set: NCCL's own choice already skips lo and
  docker* (unless nothing else exists) and prefers ib*; any value replaces that choice.
- NCCL_TOPO_FILE: the topology file is an environment variable (torch's init has no argument for it).
- NCCL_DEBUG / NCCL_DEBUG_SUBSYS on demand. TORCH_NCCL_ASYNC_ERROR_HANDLING is left at torch's default, 3
  (SkipCleanUp): when a collective fails or times out, NCCL's watchdog thread ends the process without
  ncclCommAbort, which can itself hang on a broken fabric; 1 (TearDown) aborts the communicators first. In
  neither mode does the training thread get an exception: the process ends, and the agent restarts the group.
Values the user set (cluster.nccl, cluster.env, or the job's environment) are never overridden.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from hpctrain.config.schema import NcclConfig

ROCE_V2_GID_INDEX = "3"


class Port(NamedTuple):
    hca: str
    port: str
    link_layer: str


def _natural(name: str) -> list[Any]:
    """mlx5_2 before mlx5_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def active_ports(ib: dict[str, Any]) -> list[Port]:
    """Every ACTIVE port of every HCA, in natural name order."""
    out = []
    for name, dev in sorted(ib.get("devices", {}).items(), key=lambda kv: _natural(kv[0])):
        for number, p in sorted(dev.get("ports", {}).items(), key=lambda kv: _natural(kv[0])):
            if "ACTIVE" in str(p.get("state", "")).upper():
                out.append(Port(name, number, str(p.get("link_layer") or "InfiniBand")))
    return out


def nearest_hcas(topology: dict[str, Any], local_rank: int) -> list[str]:
    gpu = topology.get("gpus", {}).get(f"GPU{local_rank}", {})
    return list(gpu.get("nearest_nics", []))


def _near_some_gpu(topology: dict[str, Any]) -> set[str]:
    return {nic for gpu in topology.get("gpus", {}).values() for nic in gpu.get("nearest_nics", [])}


def compute_ports(
    ib: dict[str, Any], topology: dict[str, Any], exclude: str | None = None
) -> tuple[list[Port], dict[str, str]]:
    """The ports NCCL should use, and each left-out HCA with the reason (rules in the module docstring)."""
    ports, dropped = active_ports(ib), {}
    excluded = {n.strip().lstrip("=") for n in (exclude or "").split(",") if n.strip()}
    for p in ports:
        if p.hca in excluded:
            dropped[p.hca] = "cluster.nccl.exclude_hca"
    if any(p.link_layer.lower() == "infiniband" for p in ports):
        for p in ports:
            if p.link_layer.lower() != "infiniband":
                dropped.setdefault(p.hca, f"{p.link_layer} port on an InfiniBand node (storage/front-end)")
    near = _near_some_gpu(topology)
    if near & {p.hca for p in ports}:
        for p in ports:
            if p.hca not in near:
                dropped.setdefault(p.hca, "not the nearest NIC of any GPU (nvidia-smi topo -m)")
    return [p for p in ports if p.hca not in dropped], dropped


def hca_list(ports: list[Port], first: list[str]) -> str:
    """NCCL_IB_HCA in exact-match form, the HCAs in `first` leading."""
    ordered = [p for p in ports if p.hca in first] + [p for p in ports if p.hca not in first]
    return "=" + ",".join(f"{p.hca}:{p.port}" for p in ordered)


def selects(spec: str, port: Port) -> bool:
    """Whether an NCCL_IB_HCA value selects this port: `^` excludes, `=` matches exact names (else prefixes),
    `:n` restricts to port n."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    hit = False
    for token in filter(None, (t.strip() for t in spec.split(","))):
        name, _, number = token.partition(":")
        named = port.hca == name if exact else port.hca.startswith(name)
        hit = hit or (named and (not number or number == port.port))
    return hit != exclude


def nccl_environment(
    nccl_cfg: NcclConfig, local_rank: int, topology: dict[str, Any] | None, ib: dict[str, Any] | None
) -> dict[str, str]:
    """The NCCL variables for this task (only those it has reason to set)."""
    env: dict[str, str] = {}
    if nccl_cfg.debug:
        env["NCCL_DEBUG"] = str(nccl_cfg.debug)
        if nccl_cfg.debug_subsys:
            env["NCCL_DEBUG_SUBSYS"] = str(nccl_cfg.debug_subsys)
    if nccl_cfg.topo_file:
        env["NCCL_TOPO_FILE"] = str(nccl_cfg.topo_file)
    if nccl_cfg.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = str(nccl_cfg.socket_ifname)
    topology, ib = topology or {}, ib or {}
    if nccl_cfg.ib_hca:
        env["NCCL_IB_HCA"] = str(nccl_cfg.ib_hca)
        selected = [p for p in active_ports(ib) if selects(str(nccl_cfg.ib_hca), p)]
    else:
        selected, _ = compute_ports(ib, topology, nccl_cfg.exclude_hca)
        if selected:
            env["NCCL_IB_HCA"] = hca_list(selected, nearest_hcas(topology, local_rank))
    if nccl_cfg.ib_gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(nccl_cfg.ib_gid_index)
    elif selected and all(p.link_layer.lower() == "ethernet" for p in selected):
        env["NCCL_IB_GID_INDEX"] = ROCE_V2_GID_INDEX
    return env


def apply(env: dict[str, str], current: dict[str, str]) -> dict[str, str]:
    """What to add to the process environment: never override what the user or the job already set."""
    return {k: v for k, v in env.items() if k not in current}
