"""Pure parsers of what the node tools print: `nvidia-smi -q -x`, `nvidia-smi nvlink -s`, `nvidia-smi topo -m`,
`ibstat` and kernel-log Xid lines. Text in, report dicts out (shapes in node.py's docstring), so that they are
tested on real captured outputs (tests/health/fixtures/node) on a machine without any of that hardware."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

XID_SOURCE = (
    "nvidia-smi does not list Xid errors; they are in the kernel log (dmesg / journalctl -k) "
    "as 'NVRM: Xid (PCI:...): N, ...' lines: pass that text to parse_xid_lines"
)
# nvidia-smi topo -m path kinds, nearest first: a NIC behind the same PCIe switch (PIX/PXB) gives
# GPUDirect RDMA at full rate; through the CPU host bridge (PHB), another bridge of the NUMA node
# (NODE) or across sockets (SYS) it does not.
PATH_RANK = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}


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
    sram = [
        _int(counts, tag) for tag in ("sram_uncorrectable", "sram_uncorrectable_parity", "sram_uncorrectable_secded")
    ]
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
        "ecc_uncorrectable": {
            "volatile": _uncorrectable(el.find("ecc_errors/volatile")),
            "aggregate": _uncorrectable(el.find("ecc_errors/aggregate")),
        },
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
        }
        if has_remap
        else None,
        "sm_clock_mhz": _int(el, "clocks/sm_clock"),
        "sm_clock_max_mhz": _int(el, "max_clocks/sm_clock"),
        "power_draw_w": _number(
            el, "gpu_power_readings/power_draw", "gpu_power_readings/instant_power_draw", "power_readings/power_draw"
        ),
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
        events.append(
            {
                "pci": match.group("pci").lower(),
                "xid": int(match.group("xid")),
                "pid": pid.group("pid") if pid else None,
                "name": pid.group("name") if pid else None,
                "message": (pid.group("msg") if pid else rest).strip(),
            }
        )
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
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]) or len(tokens) < 1 + len(devices):
            continue
        cells = dict(zip(names, tokens[1 : 1 + len(devices)]))
        rest = dict(zip(extras, tokens[1 + len(devices) :]))
        paths = {nic: cells[nic] for nic in nics if cells[nic] in PATH_RANK}
        best = min((PATH_RANK[p] for p in paths.values()), default=None)
        gpus[tokens[0]] = {
            "nearest_nics": [nic for nic, p in paths.items() if PATH_RANK[p] == best],
            "nic_path": next((p for p in paths.values() if PATH_RANK[p] == best), None),
            "cpu_affinity": rest.get("CPU Affinity"),
            "numa_affinity": rest.get("NUMA Affinity"),
        }
    return {"status": "ok", "nics": nics, "gpus": gpus}


# ---------------------------------------------------------------------------------- InfiniBand


def rate_gbps(rate: str | None) -> float | None:
    """Gb/s from an IB rate such as "200 Gb/sec (4X HDR)"."""
    match = re.match(r"\s*([\d.]+)", rate or "")
    return float(match.group(1)) if match else None


def parse_ibstat(text: str) -> dict[str, Any]:
    """`ibstat` text in the same shape as node.py's `ib_report` (board_id is not in ibstat: None)."""
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
            port.update(rate=value, rate_gbps=rate_gbps(value))
        else:
            port.update(
                {
                    "State": {"state": value},
                    "Physical state": {"phys_state": value},
                    "Link layer": {"link_layer": value},
                }.get(key, {})
            )
    return {"status": "ok", "devices": devices}
