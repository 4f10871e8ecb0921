"""What one node reports about itself, and how to compare nodes.

At thousands of GPUs hardware faults are routine: uncorrectable ECC errors, pending row remaps or page
retirements, Xid errors, NVLink links that did not train, IB ports down or at the wrong rate, firmware
that differs from the rest of the fleet (mismatched IB firmware has caused millisecond-level collective
delays). Each collector here runs a vendor tool (or reads sysfs) and hands the text to a pure parser
(node_parse.py); node_problems.py decides what needs action. So the parsing and the decisions are tested
on real captured outputs (tests/health/fixtures/node) on a machine without any of that hardware. Every
collector says "not present" instead of failing when its tool or directory is missing.

Report shape (JSON-serializable, see `node_report`)::

    {"hostname": str,
     "gpu": {"status": "ok" | "not present" | "error: ...", "count": int, "attached_gpus": int | None,
             "driver_version": str | None, "cuda_version": str | None, "product_names": [str],
             "gpus": [{"index", "uuid", "pci_bus_id", "product_name", "ecc_mode",
                       "ecc_uncorrectable": {"volatile": {"sram"|"dram"|"double_bit": int},
                                             "aggregate": {...}},
                       "retired_pages": {"single_bit": int | None, "double_bit": int | None,
                                         "pending": bool | None},
                       "remapped_rows": {"correctable", "uncorrectable": int | None,
                                         "pending", "failure": bool | None} | None,
                       "sm_clock_mhz", "sm_clock_max_mhz": int | None,
                       "power_draw_w", "power_limit_w", "temperature_c": float | None}],
             "xid_source": str},
     "nvlink": {"status", "gpus": {"<index>": {"name", "uuid", "links": {"<n>": GB/s float | None}}}},
     "topology": {"status", "nics": [str], "gpus": {"GPU0": {"nearest_nics": [str], "nic_path": str | None,
                  "cpu_affinity": str | None, "numa_affinity": str | None}}},
     "ib": {"status", "devices": {"mlx5_0": {"hca_type", "fw_ver", "board_id",
            "ports": {"1": {"state", "phys_state", "rate", "rate_gbps", "link_layer"}}}}},
     "software": {"python", "torch", "cuda", "nccl", "driver", "hostname", "kernel"},
     "xids": [{"pci", "xid", "pid", "name", "message"}],
     "problems": [str]}
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpctrain.health.node_parse import (
    XID_SOURCE,
    parse_nvidia_smi_xml,
    parse_nvlink_status,
    parse_topo_matrix,
    parse_xid_lines,
    rate_gbps,
)
from hpctrain.health.node_problems import gpu_problems, ib_problems, nvlink_problems, xid_problems

NOT_PRESENT = "not present"
TOOL_TIMEOUT_S = 30.0


def _run(cmd: list[str]) -> str | None:
    """stdout of a tool, or None when it is not installed; raises on failure or timeout."""
    if shutil.which(cmd[0]) is None:
        return None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=True).stdout


def _collect(cmd: list[str], parse: Any) -> dict[str, Any]:
    """Run a tool and parse its text; a missing tool is "not present", a failing one an error status."""
    try:
        text = _run(cmd)
    except (subprocess.SubprocessError, OSError) as exc:
        return {"status": f"error: {' '.join(cmd)}: {exc}"}
    if text is None:
        return {"status": NOT_PRESENT}
    return parse(text)


# ------------------------------------------------------------------------------------ collectors


def gpu_report() -> dict[str, Any]:
    """`nvidia-smi -q -x` parsed; "not present" without nvidia-smi. Xids are not in it (see XID_SOURCE)."""
    report = _collect(["nvidia-smi", "-q", "-x"], parse_nvidia_smi_xml)
    report.setdefault("xid_source", XID_SOURCE)
    return report


def nvlink_report() -> dict[str, Any]:
    """NVLink link states; "not present" without nvidia-smi."""
    return _collect(["nvidia-smi", "nvlink", "-s"], parse_nvlink_status)


def topology_report() -> dict[str, Any]:
    """GPU/NIC topology; "not present" without nvidia-smi."""
    return _collect(["nvidia-smi", "topo", "-m"], parse_topo_matrix)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def ib_report(root: str | os.PathLike[str] = "/sys/class/infiniband") -> dict[str, Any]:
    """Per HCA and port: state ("4: ACTIVE"), phys_state ("5: LinkUp"), rate ("200 Gb/sec (4X HDR)"),
    link_layer (InfiniBand, or Ethernet for RoCE), fw_ver, board_id, from sysfs."""
    base = Path(root)
    if not base.is_dir():
        return {"status": NOT_PRESENT, "devices": {}}
    devices = {}
    for dev in sorted(base.iterdir()):
        ports = {}
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            rate = _read(port / "rate")
            ports[port.name] = {
                "state": _read(port / "state"),
                "phys_state": _read(port / "phys_state"),
                "rate": rate,
                "rate_gbps": rate_gbps(rate),
                "link_layer": _read(port / "link_layer"),
            }
        devices[dev.name] = {
            "hca_type": _read(dev / "hca_type"),
            "fw_ver": _read(dev / "fw_ver"),
            "board_id": _read(dev / "board_id"),
            "ports": ports,
        }
    return {"status": "ok", "devices": devices}


# ------------------------------------------------------------------------------------ software


def software_versions(driver: str | None = None) -> dict[str, Any]:
    """Versions that must agree across nodes; torch is imported here, not at module level, so the
    health check stays cheap where torch is absent."""
    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": None,
        "cuda": None,
        "nccl": None,
        "driver": driver,
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
    }
    try:
        import torch
    except ImportError:
        return versions
    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return versions


# -------------------------------------------------------------------------------------- the node


def node_report(expected_gpus: int, expected_gpu_name: str | None, kernel_log: str | None = None) -> dict[str, Any]:
    """Everything this node says about itself plus the `problems` found in it. `kernel_log` is the
    text of dmesg/journalctl -k when the caller can read it (often needs root), for Xids."""
    gpu = gpu_report()
    nvlink = nvlink_report()
    ib = ib_report()
    xids = parse_xid_lines(kernel_log) if kernel_log else []
    problems = (
        gpu_problems(gpu, expected_gpus, expected_gpu_name)
        + nvlink_problems(nvlink)
        + ib_problems(ib)
        + xid_problems(xids)
    )
    return {
        "hostname": socket.gethostname(),
        "gpu": gpu,
        "nvlink": nvlink,
        "topology": topology_report(),
        "ib": ib,
        "software": software_versions(gpu.get("driver_version")),
        "xids": xids,
        "problems": problems,
    }


# ------------------------------------------------------------------------------- across nodes


def _facts(report: dict[str, Any]) -> dict[str, str]:
    """What must be identical on every node of a job, as printable values ("absent" when missing)."""
    sw = report.get("software", {})
    gpu = report.get("gpu", {})
    facts = {
        "driver version": sw.get("driver") or gpu.get("driver_version"),
        "CUDA version": sw.get("cuda"),
        "NCCL version": sw.get("nccl"),
        "torch version": sw.get("torch"),
        "GPU model": ", ".join(gpu.get("product_names", [])) or None,
        "GPU count": gpu.get("count"),
    }
    for name, dev in report.get("ib", {}).get("devices", {}).items():
        facts[f"IB firmware of {name}"] = dev.get("fw_ver")
    return {k: "absent" if v is None else str(v) for k, v in facts.items()}


def _names(nodes: list[str]) -> str:
    return ", ".join(nodes) if len(nodes) <= 5 else f"{', '.join(nodes[:5])} and {len(nodes) - 5} more"


def _has(nodes: list[str]) -> str:
    return "has" if len(nodes) == 1 else "have"


def compare_nodes(reports: dict[str, dict[str, Any]]) -> list[str]:
    """Cross-node consistency: one message per fact that differs, naming the minority node(s), e.g.
    "IB firmware of mlx5_0 differs: n7 has 20.31.1014, 15 others have 20.35.2000". Without a strict
    majority (e.g. 1 vs 1) every group is named. A fact missing on a node counts as "absent" there."""
    return [message for message, _ in inconsistencies(reports)]


def inconsistencies(reports: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """compare_nodes' messages with the odd nodes of each (every node when there is no strict majority)."""
    facts = {node: _facts(report) for node, report in reports.items()}
    keys = list(dict.fromkeys(k for f in facts.values() for k in f))
    messages: list[tuple[str, list[str]]] = []
    for key in keys:
        groups: dict[str, list[str]] = {}
        for node in sorted(facts):
            groups.setdefault(facts[node].get(key, "absent"), []).append(node)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        (common, majority), rest = ordered[0], ordered[1:]
        if len(majority) > len(rest[0][1]):
            odd = "; ".join(f"{_names(nodes)} {_has(nodes)} {value}" for value, nodes in rest)
            others = "other" if len(majority) == 1 else "others"
            messages.append(
                (
                    f"{key} differs: {odd}, {len(majority)} {others} {_has(majority)} {common}",
                    [n for _, nodes in rest for n in nodes],
                )
            )
        else:
            groups_text = "; ".join(f"{_names(nodes)} {_has(nodes)} {value}" for value, nodes in ordered)
            messages.append((f"{key} differs: {groups_text}", sorted(facts)))
    return messages


if __name__ == "__main__":
    import json

    from hpctrain.entry import EntryParser

    parser = EntryParser(prog="python -m hpctrain.health.node", description=__doc__)
    parser.add_argument(
        "expected_gpus", type=int, nargs="?", default=0, help="the GPUs this node should have (0: any number)"
    )
    json.dump(node_report(parser.parse_args().expected_gpus, None), sys.stdout, indent=2)
