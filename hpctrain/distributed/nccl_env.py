"""Topology-aware NCCL settings for one task, from the cluster config and what its node reports.

Decisions (each unit-tested on captured `nvidia-smi topo -m` and /sys/class/infiniband layouts):
- NCCL_IB_HCA: the HCAs with an ACTIVE port (a down or disabled port would make NCCL try it and time out),
  unless cluster.nccl.ib_hca says otherwise. Each local rank's nearest HCA (PIX/PXB before PHB/NODE/SYS) is
  listed first, so the rank's traffic leaves through the NIC on its own PCIe switch (GPUDirect RDMA).
- NCCL_IB_GID_INDEX: RoCE (link layer Ethernet) needs the RoCEv2 GID, conventionally index 3; InfiniBand
  needs none.
- NCCL_SOCKET_IFNAME: bootstrap and socket traffic stay off loopback and container bridges unless configured.
- NCCL_TOPO_FILE: the topology file is an environment variable (torch's init has no argument for it).
- NCCL_DEBUG / NCCL_DEBUG_SUBSYS on demand; TORCH_NCCL_ASYNC_ERROR_HANDLING so a failed collective raises.
Values the user set (cluster.nccl, cluster.env, or the job's environment) are never overridden.
"""

from __future__ import annotations

from typing import Any

ROCE_V2_GID_INDEX = "3"


def active_hcas(ib: dict[str, Any]) -> list[tuple[str, str]]:
    """(device, link layer) of every HCA with at least one ACTIVE port, in name order."""
    out = []
    for name, dev in sorted(ib.get("devices", {}).items()):
        ports = dev.get("ports", {}).values()
        active = [p for p in ports if "ACTIVE" in str(p.get("state", "")).upper()]
        if active:
            out.append((name, str(active[0].get("link_layer") or "InfiniBand")))
    return out


def nearest_hcas(topology: dict[str, Any], local_rank: int) -> list[str]:
    gpu = topology.get("gpus", {}).get(f"GPU{local_rank}", {})
    return list(gpu.get("nearest_nics", []))


def nccl_environment(nccl_cfg: Any, local_rank: int, topology: dict[str, Any] | None,
                     ib: dict[str, Any] | None) -> dict[str, str]:
    """The NCCL variables for this task (only those it has reason to set)."""
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if nccl_cfg.debug:
        env["NCCL_DEBUG"] = str(nccl_cfg.debug)
        if nccl_cfg.debug_subsys:
            env["NCCL_DEBUG_SUBSYS"] = str(nccl_cfg.debug_subsys)
    if nccl_cfg.topo_file:
        env["NCCL_TOPO_FILE"] = str(nccl_cfg.topo_file)
    env["NCCL_SOCKET_IFNAME"] = str(nccl_cfg.socket_ifname or "^lo,docker,virbr")
    hcas = active_hcas(ib or {})
    if nccl_cfg.ib_hca:
        env["NCCL_IB_HCA"] = str(nccl_cfg.ib_hca)
    elif hcas:
        names = [name for name, _ in hcas]
        near = [n for n in nearest_hcas(topology or {}, local_rank) if n in names]
        env["NCCL_IB_HCA"] = ",".join(near + [n for n in names if n not in near])
    if nccl_cfg.ib_gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(nccl_cfg.ib_gid_index)
    elif any(layer.lower() == "ethernet" for _, layer in hcas):
        env["NCCL_IB_GID_INDEX"] = ROCE_V2_GID_INDEX
    return env


def apply(env: dict[str, str], current: dict[str, str]) -> dict[str, str]:
    """What to add to the process environment: never override what the user or the job already set."""
    return {k: v for k, v in env.items() if k not in current}
