"""What one node reports about itself, and how to compare nodes.

At thousands of GPUs hardware faults are routine: uncorrectable ECC errors, pending row remaps or page
retirements, Xid errors, NVLink links that did not train, IB ports down or at the wrong rate, firmware
that differs from the rest of the fleet (mismatched IB firmware has caused millisecond-level collective
delays). Each collector here runs a vendor tool (or reads sysfs) and hands the text to a pure parser, so
the parsing and the decisions are tested on real captured outputs (tests/health/fixtures/node) on a
machine without any of that hardware. Every collector says "not present" instead of failing when its
tool or directory is missing.

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
import re
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

NOT_PRESENT = "not present"
TOOL_TIMEOUT_S = 30.0
XID_SOURCE = ("nvidia-smi does not list Xid errors; they are in the kernel log (dmesg / journalctl -k) "
              "as 'NVRM: Xid (PCI:...): N, ...' lines: pass that text to parse_xid_lines")
# Xids that point at the GPU, its memory or its links rather than at the application (NVIDIA's Xid
# catalogue): 48 DBE, 63/64 row remap event/failure, 74 NVLink, 79 fallen off the bus, 92 high SBE
# rate, 94/95 contained/uncontained ECC, 119/120 GSP. Application faults (13, 31, 43, 45) are not
# node problems: the next job on the node will not hit them.
HARDWARE_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
# nvidia-smi topo -m path kinds, nearest first: a NIC behind the same PCIe switch (PIX/PXB) gives
# GPUDirect RDMA at full rate; through the CPU host bridge (PHB), another bridge of the NUMA node
# (NODE) or across sockets (SYS) it does not.
PATH_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}


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


# ---------------------------------------------------------------------------------------- GPUs

def _text(node: ET.Element | None, path: str) -> str | None:
    """Element text with nvidia-smi's "N/A" (and empty) read as None."""
    el = node.find(path) if node is not None else None
    if el is None or el.text is None:
        return None
    value = el.text.strip()
    return None if value in ("", "N/A") else value


def _number(node: ET.Element | None, *paths: str) -> float | None:
    """First of `paths` that holds a number such as "1275 MHz" or "67.03 W"."""
    for path in paths:
        value = _text(node, path)
        if value is not None:
            match = re.match(r"-?\d+(\.\d+)?", value)
            if match:
                return float(match.group())
    return None


def _int(node: ET.Element | None, *paths: str) -> int | None:
    value = _number(node, *paths)
    return None if value is None else int(value)


def _yes(node: ET.Element | None, path: str) -> bool | None:
    value = _text(node, path)
    return None if value is None else value.lower() == "yes"


def _uncorrectable(counts: ET.Element | None) -> dict[str, int]:
    """Uncorrectable ECC counts by location; Ampere+ drivers say SRAM/DRAM (newer split SRAM into
    parity/SECDED), pre-Ampere ones count double-bit errors."""
    found: dict[str, int] = {}
    sram = [_int(counts, tag) for tag in ("sram_uncorrectable", "sram_uncorrectable_parity",
                                          "sram_uncorrectable_secded")]
    if any(v is not None for v in sram):
        found["sram"] = sum(v for v in sram if v is not None)
    for key, path in (("dram", "dram_uncorrectable"), ("double_bit", "double_bit/total")):
        value = _int(counts, path)
        if value is not None:
            found[key] = value
    return found


def _gpu(index: int, el: ET.Element) -> dict[str, Any]:
    remap = el.find("remapped_rows")
    has_remap = remap is not None and len(remap) > 0  # "N/A" when unsupported (pre-Ampere, MIG mode)
    return {
        "index": index,
        "uuid": _text(el, "uuid"),
        "pci_bus_id": _text(el, "pci/pci_bus_id") or el.get("id"),
        "product_name": _text(el, "product_name"),
        "ecc_mode": _text(el, "ecc_mode/current_ecc"),
        "ecc_uncorrectable": {"volatile": _uncorrectable(el.find("ecc_errors/volatile")),
                              "aggregate": _uncorrectable(el.find("ecc_errors/aggregate"))},
        "retired_pages": {
            "single_bit": _int(el, "retired_pages/multiple_single_bit_retirement/retired_count"),
            "double_bit": _int(el, "retired_pages/double_bit_retirement/retired_count"),
            "pending": _yes(el, "retired_pages/pending_retirement"),
        },
        "remapped_rows": {
            "correctable": _int(remap, "remapped_row_corr"),
            "uncorrectable": _int(remap, "remapped_row_unc"),
            "pending": _yes(remap, "remapped_row_pending"),
            "failure": _yes(remap, "remapped_row_failure"),
        } if has_remap else None,
        "sm_clock_mhz": _int(el, "clocks/sm_clock"),
        "sm_clock_max_mhz": _int(el, "max_clocks/sm_clock"),
        "power_draw_w": _number(el, "gpu_power_readings/power_draw", "gpu_power_readings/instant_power_draw",
                                "power_readings/power_draw"),
        "power_limit_w": _number(el, "gpu_power_readings/current_power_limit", "power_readings/power_limit"),
        "temperature_c": _number(el, "temperature/gpu_temp"),
    }


def parse_nvidia_smi_xml(text: str) -> dict[str, Any]:
    """The GPU part of the report from `nvidia-smi -q -x` output."""
    root = ET.fromstring(text.strip())
    gpus = [_gpu(i, el) for i, el in enumerate(root.findall("gpu"))]
    return {
        "status": "ok",
        "count": len(gpus),
        "attached_gpus": _int(root, "attached_gpus"),
        "driver_version": _text(root, "driver_version"),
        "cuda_version": _text(root, "cuda_version"),
        "product_names": sorted({g["product_name"] for g in gpus if g["product_name"]}),
        "gpus": gpus,
        "xid_source": XID_SOURCE,
    }


def gpu_report() -> dict[str, Any]:
    """`nvidia-smi -q -x` parsed; "not present" without nvidia-smi. Xids are not in it (see XID_SOURCE)."""
    report = _collect(["nvidia-smi", "-q", "-x"], parse_nvidia_smi_xml)
    report.setdefault("xid_source", XID_SOURCE)
    return report


_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>\d+), (?P<rest>.*)$")


def parse_xid_lines(text: str) -> list[dict[str, Any]]:
    """Xid events from kernel-log text (dmesg, dmesg -T, journalctl -k): one dict per NVRM Xid line."""
    events = []
    for line in text.splitlines():
        match = _XID.search(line)
        if not match:
            continue
        rest = match.group("rest")
        pid = re.match(r"pid='?(?P<pid>[^,']+)'?, name=(?P<name>[^,]*), (?P<msg>.*)$", rest)
        events.append({
            "pci": match.group("pci").lower(),
            "xid": int(match.group("xid")),
            "pid": pid.group("pid") if pid else None,
            "name": pid.group("name") if pid else None,
            "message": (pid.group("msg") if pid else rest).strip(),
        })
    return events


# -------------------------------------------------------------------------------------- NVLink

def parse_nvlink_status(text: str) -> dict[str, Any]:
    """`nvidia-smi nvlink -s`: per GPU, per link its speed in GB/s, or None for `<inactive>`."""
    gpus: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        head = re.match(r"GPU (\d+): (.*?)(?: \(UUID: (.*)\))?\s*$", line)
        if head:
            current = {"name": head.group(2), "uuid": head.group(3), "links": {}}
            gpus[head.group(1)] = current
            continue
        link = re.match(r"\s+Link (\d+): (.*?)\s*$", line)
        if link and current is not None:
            speed = re.match(r"([\d.]+) GB/s", link.group(2))
            current["links"][link.group(1)] = float(speed.group(1)) if speed else None
    return {"status": "ok", "gpus": gpus}


def nvlink_report() -> dict[str, Any]:
    """NVLink link states; "not present" without nvidia-smi."""
    return _collect(["nvidia-smi", "nvlink", "-s"], parse_nvlink_status)


# ------------------------------------------------------------------------------------ topology

def parse_topo_matrix(text: str) -> dict[str, Any]:
    """`nvidia-smi topo -m`: each GPU's nearest NIC(s) (used to pick NCCL_IB_HCA per local rank) and
    its CPU/NUMA affinity. NICn columns are renamed through the "NIC Legend" when present."""
    lines = [line.rstrip() for line in text.splitlines()]
    header_at = next(i for i, line in enumerate(lines) if re.match(r"\s+GPU0\b", line))
    columns = [c for c in re.split(r"\t+|\s{2,}", lines[header_at].strip()) if c]
    extra_at = next((i for i, c in enumerate(columns) if "Affinity" in c or "NUMA" in c), len(columns))
    devices, extras = columns[:extra_at], columns[extra_at:]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.MULTILINE))
    names = [legend.get(d, d) for d in devices]
    nics = [n for d, n in zip(devices, names) if not d.startswith("GPU")]
    gpus: dict[str, dict[str, Any]] = {}
    for line in lines[header_at + 1:]:
        tokens = line.split()
        if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]) or len(tokens) < 1 + len(devices):
            continue
        cells = dict(zip(names, tokens[1:1 + len(devices)]))
        rest = dict(zip(extras, tokens[1 + len(devices):]))
        paths = {nic: cells[nic] for nic in nics if cells[nic] in PATH_RANK}
        best = min((PATH_RANK[p] for p in paths.values()), default=None)
        gpus[tokens[0]] = {
            "nearest_nics": [nic for nic, p in paths.items() if PATH_RANK[p] == best],
            "nic_path": next((p for p in paths.values() if PATH_RANK[p] == best), None),
            "cpu_affinity": rest.get("CPU Affinity"),
            "numa_affinity": rest.get("NUMA Affinity"),
        }
    return {"status": "ok", "nics": nics, "gpus": gpus}


def topology_report() -> dict[str, Any]:
    """GPU/NIC topology; "not present" without nvidia-smi."""
    return _collect(["nvidia-smi", "topo", "-m"], parse_topo_matrix)


# ---------------------------------------------------------------------------------- InfiniBand

def _rate_gbps(rate: str | None) -> float | None:
    match = re.match(r"\s*([\d.]+)", rate or "")
    return float(match.group(1)) if match else None


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
            ports[port.name] = {"state": _read(port / "state"), "phys_state": _read(port / "phys_state"),
                                "rate": rate, "rate_gbps": _rate_gbps(rate),
                                "link_layer": _read(port / "link_layer")}
        devices[dev.name] = {"hca_type": _read(dev / "hca_type"), "fw_ver": _read(dev / "fw_ver"),
                             "board_id": _read(dev / "board_id"), "ports": ports}
    return {"status": "ok", "devices": devices}


def parse_ibstat(text: str) -> dict[str, Any]:
    """`ibstat` text in the same shape as `ib_report` (board_id is not in ibstat: None)."""
    devices: dict[str, dict[str, Any]] = {}
    dev: dict[str, Any] | None = None
    port: dict[str, Any] | None = None
    for line in text.splitlines():
        ca = re.match(r"CA '([^']+)'", line)
        if ca:
            dev = {"hca_type": None, "fw_ver": None, "board_id": None, "ports": {}}
            devices[ca.group(1)] = dev
            port = None
            continue
        field = re.match(r"\s+([^:]+):\s*(.*?)\s*$", line)
        if dev is None or not field:
            continue
        key, value = field.groups()
        number = re.fullmatch(r"Port (\d+)", key)
        if number:
            port = {"state": None, "phys_state": None, "rate": None, "rate_gbps": None, "link_layer": None}
            dev["ports"][number.group(1)] = port
        elif port is None:
            dev.update({"CA type": {"hca_type": value}, "Firmware version": {"fw_ver": value}}.get(key, {}))
        elif key == "Rate":
            port.update(rate=value, rate_gbps=_rate_gbps(value))
        else:
            port.update({"State": {"state": value}, "Physical state": {"phys_state": value},
                         "Link layer": {"link_layer": value}}.get(key, {}))
    return {"status": "ok", "devices": devices}


# ------------------------------------------------------------------------------------ software

def software_versions(driver: str | None = None) -> dict[str, Any]:
    """Versions that must agree across nodes; torch is imported here, not at module level, so the
    health check stays cheap where torch is absent."""
    versions: dict[str, Any] = {"python": platform.python_version(), "torch": None, "cuda": None,
                                "nccl": None, "driver": driver, "hostname": socket.gethostname(),
                                "kernel": platform.release()}
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


# ------------------------------------------------------------------------------------ problems

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
            problems.append(f"GPU {index}: NVLink link(s) {', '.join(down)} inactive "
                            f"({len(links) - len(down)} of {len(links)} active)")
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


def node_report(expected_gpus: int, expected_gpu_name: str | None, kernel_log: str | None = None
                ) -> dict[str, Any]:
    """Everything this node says about itself plus the `problems` found in it. `kernel_log` is the
    text of dmesg/journalctl -k when the caller can read it (often needs root), for Xids."""
    gpu = gpu_report()
    nvlink = nvlink_report()
    ib = ib_report()
    xids = parse_xid_lines(kernel_log) if kernel_log else []
    problems = (gpu_problems(gpu, expected_gpus, expected_gpu_name) + nvlink_problems(nvlink)
                + ib_problems(ib) + xid_problems(xids))
    return {"hostname": socket.gethostname(), "gpu": gpu, "nvlink": nvlink, "topology": topology_report(),
            "ib": ib, "software": software_versions(gpu.get("driver_version")), "xids": xids,
            "problems": problems}


# ------------------------------------------------------------------------------- across nodes

def _facts(report: dict[str, Any]) -> dict[str, str]:
    """What must be identical on every node of a job, as printable values ("absent" when missing)."""
    sw = report.get("software", {})
    gpu = report.get("gpu", {})
    facts = {"driver version": sw.get("driver") or gpu.get("driver_version"),
             "CUDA version": sw.get("cuda"), "NCCL version": sw.get("nccl"), "torch version": sw.get("torch"),
             "GPU model": ", ".join(gpu.get("product_names", [])) or None, "GPU count": gpu.get("count")}
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
            messages.append((f"{key} differs: {odd}, {len(majority)} {others} {_has(majority)} {common}",
                             [n for _, nodes in rest for n in nodes]))
        else:
            groups_text = "; ".join(f"{_names(nodes)} {_has(nodes)} {value}" for value, nodes in ordered)
            messages.append((f"{key} differs: {groups_text}", sorted(facts)))
    return messages


if __name__ == "__main__":
    import json

    json.dump(node_report(int(sys.argv[1]) if len(sys.argv) > 1 else 0, None), sys.stdout, indent=2)
