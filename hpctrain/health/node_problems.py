"""What in one node's report needs action: each function turns a part of the report (node.py) into problem
messages, empty when the part is healthy or not present."""

from __future__ import annotations

from collections import Counter
from typing import Any

# Xids that point at the GPU, its memory or its links rather than at the application (NVIDIA's Xid
# catalogue): 48 DBE, 63/64 row remap event/failure, 74 NVLink, 79 fallen off the bus, 92 high SBE
# rate, 94/95 contained/uncontained ECC, 119/120 GSP. Application faults (13, 31, 43, 45) are not
# node problems: the next job on the node will not hit them.
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


def gpu_problems(gpu: dict[str, Any], expected_gpus: int, expected_gpu_name: str | None) -> list[str]:
    """GPU count/model against the request, uncorrectable ECC since boot, pending retirements/remaps.

    An SM clock well below its maximum is deliberately NOT a problem: an idle GPU drops to a low
    clock (P-state) and boosts under load, so an idle reading says nothing about throttling; slow
    GPUs are found under load by comparing step or kernel times across nodes (outliers.py).
    Aggregate (lifetime) ECC counts are reported but not flagged: they include errors already
    handled by retirement/remapping; what needs action is a volatile count or a pending remap.
    """
    if gpu.get("status") != "ok":
        return [f"expected {expected_gpus} GPUs, nvidia-smi {gpu.get('status')}"] if expected_gpus else []
    problems = []
    if expected_gpus and gpu["count"] != expected_gpus:
        problems.append(f"GPU count {gpu['count']} != expected {expected_gpus}")
    for g in gpu["gpus"]:
        where = f"GPU {g['index']} ({g['pci_bus_id']})"
        if expected_gpu_name and expected_gpu_name.lower() not in (g["product_name"] or "").lower():
            problems.append(f"{where}: model {g['product_name']}, expected {expected_gpu_name}")
        volatile = {k: v for k, v in g["ecc_uncorrectable"]["volatile"].items() if v}
        if volatile:
            counts = ", ".join(f"{k} {v}" for k, v in volatile.items())
            problems.append(f"{where}: uncorrectable ECC errors since boot ({counts})")
        if g["retired_pages"]["pending"]:
            problems.append(f"{where}: page retirement pending (reset the GPU)")
        remap = g["remapped_rows"] or {}
        if remap.get("pending"):
            problems.append(f"{where}: row remapping pending (reset the GPU)")
        if remap.get("failure"):
            problems.append(f"{where}: row remapping failed (replace the GPU)")
    return problems


def nvlink_problems(nvlink: dict[str, Any]) -> list[str]:
    """Inactive links on a GPU whose other links are up (a GPU with none up has no NVLink at all)."""
    problems = []
    for index, g in nvlink.get("gpus", {}).items():
        links = g["links"]
        down = [n for n, speed in links.items() if speed is None]
        if down and len(down) < len(links):
            problems.append(
                f"GPU {index}: NVLink link(s) {', '.join(down)} inactive "
                f"({len(links) - len(down)} of {len(links)} active)"
            )
    return problems


def ib_problems(ib: dict[str, Any]) -> list[str]:
    """Ports not ACTIVE, and active ports slower than the node's fastest port of the same HCA model
    and link layer (a link trained at a lower width or speed)."""
    problems = []
    fastest: dict[tuple[Any, Any], float] = {}
    active = []
    for name, dev in ib.get("devices", {}).items():
        for number, port in dev["ports"].items():
            where = f"{name} port {number}"
            if "ACTIVE" not in (port["state"] or "").upper():
                problems.append(f"{where}: state {port['state']} ({port['phys_state']}), not ACTIVE")
            elif port["rate_gbps"] is not None:
                key = (dev["hca_type"], port["link_layer"])
                fastest[key] = max(fastest.get(key, 0.0), port["rate_gbps"])
                active.append((where, key, port))
    for where, key, port in active:
        if port["rate_gbps"] < fastest[key]:
            problems.append(f"{where}: rate {port['rate']} below the node's other ports ({fastest[key]:g} Gb/sec)")
    return problems


def xid_problems(xids: list[dict[str, Any]]) -> list[str]:
    """Hardware Xids, one line per (GPU, Xid)."""
    seen = Counter((e["pci"], e["xid"]) for e in xids if e["xid"] in HARDWARE_XIDS)
    return [f"GPU {pci}: Xid {xid} in the kernel log ({n}x)" for (pci, xid), n in sorted(seen.items())]
