"""What the NCCL log analysis (nccl_log.py) reports: the report's data, the policy that turns it into findings
(what is an error, what a warning) and the human summary. Pure data, no parsing."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

ERROR = "error"
WARNING = "warning"


@dataclass
class Finding:
    """One problem: `error` makes the CLI exit 1, `warning` is reported only."""

    severity: str
    code: str
    message: str
    host: str | None = None
    rank: int | None = None


@dataclass
class NcclWarning:
    """An `NCCL WARN` line, with the rank of the process that printed it (its largest communicator's)."""

    host: str
    pid: int
    device: int
    rank: int | None
    where: str | None
    message: str
    source: str


@dataclass
class HostNetwork:
    """What NCCL picked for inter-node traffic on one host, and why when it is the socket fallback."""

    host: str
    networks: list[str] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    socket_devices: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rank_networks: dict[int, str] = field(default_factory=dict)


@dataclass
class Link:
    """One connection as one side printed it: `channels` lists every channel it appeared on."""

    comm: str
    src: int
    src_dev: str
    dst: int
    dst_dev: str
    side: str | None
    transport: str
    kind: str
    channels: list[int] = field(default_factory=list)
    src_host: str | None = None
    dst_host: str | None = None
    intra_node: bool = False
    gdrdma: bool = False


@dataclass
class Communicator:
    """A communicator's shape, ring orders (by channel) and tree edges (by rank, then channel)."""

    key: str
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    rank_hosts: dict[int, str] = field(default_factory=dict)
    rings: dict[int, list[int]] = field(default_factory=dict)
    trees: dict[int, dict[int, str]] = field(default_factory=dict)


@dataclass
class NcclReport:
    """Everything read from the logs, plus the findings derived from it."""

    sources: list[str]
    hosts: list[str]
    versions: dict[str, list[str]]
    networks: dict[str, HostNetwork]
    communicators: dict[str, Communicator]
    links: list[Link]
    env: dict[str, dict[str, str]]
    warnings: list[NcclWarning]
    findings: list[Finding]
    stats: dict[str, int]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    out: list[str] = []
    for v in sorted(set(values)):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def derive_findings(
    versions: dict[str, set[str]],
    networks: dict[str, HostNetwork],
    links: list[Link],
    env: dict[str, dict[str, str]],
    warnings: list[NcclWarning],
    multi_node: bool,
    allow_socket: bool,
) -> list[Finding]:
    """The policy: what is an error (exit 1) and what a warning; see the tools/nccl_log.py docstring."""
    out: list[Finding] = []
    base = {v.split("+")[0] for vs in versions.values() for v in vs}
    if len(base) > 1:
        per_host = ", ".join(f"{h}={'/'.join(sorted(vs))}" for h, vs in sorted(versions.items()))
        out.append(Finding(ERROR, "version-mismatch", f"NCCL versions differ across hosts: {per_host}"))

    for net_host, net in sorted(networks.items()):
        if "Socket" in net.networks:
            why = "; ".join(net.reasons) or "no reason logged"
            scope = "a multi-node job" if multi_node else "a single-node job"
            severity = ERROR if multi_node and not allow_socket else WARNING
            out.append(
                Finding(
                    severity,
                    "socket-fallback",
                    f"{net_host}: NCCL uses TCP sockets ({', '.join(net.socket_devices) or '?'}) "
                    f"instead of IB/RoCE on {scope}; reason: {why}",
                    host=net_host,
                )
            )

    slow: dict[tuple[str, int, int], list[Link]] = defaultdict(list)
    for link in links:
        if link.intra_node and link.kind in ("SHM", "NET"):
            slow[(link.comm, link.src, link.dst)].append(link)
    for (comm, src, dst), group in sorted(slow.items()):
        host = group[0].src_host or group[0].dst_host
        p2p = len({(k.src, k.dst) for k in links if k.comm == comm and k.kind == "P2P"})
        channels = _ranges(c for k in group for c in k.channels)
        hint = "; ".join(
            f"{k}={v}" for k, v in env.get(host or "", {}).items() if k.startswith(("NCCL_P2P", "NCCL_SHM"))
        )
        out.append(
            Finding(
                WARNING,
                "intra-node-slow-path",
                f"{host}: intra-node hop {src}[{group[0].src_dev}] -> {dst}[{group[0].dst_dev}] "
                f"uses {', '.join(sorted({k.transport for k in group}))} (channels {channels}), "
                + (f"while {p2p} other intra-node rank pairs use P2P" if p2p else "no link uses P2P")
                + (f"; {hint}" if hint else ""),
                host=host,
                rank=src,
            )
        )

    inter = [k for k in links if k.kind == "NET" and not k.intra_node and not k.transport.startswith("NET/Socket")]
    if any(k.gdrdma for k in inter):
        for k in inter:
            if not k.gdrdma:
                host = k.src_host if k.side == "send" else k.dst_host
                out.append(
                    Finding(
                        WARNING,
                        "no-gdrdma",
                        f"{host}: inter-node link {k.src} -> {k.dst} ({k.side} side) uses {k.transport} "
                        f"without GPUDirect RDMA (channels {_ranges(k.channels)}) while other "
                        "inter-node links use GDRDMA",
                        host=host,
                        rank=k.src if k.side == "send" else k.dst,
                    )
                )

    for w in warnings:
        out.append(
            Finding(WARNING, "nccl-warn", f"{w.host} rank {w.rank} [{w.device}]: {w.message}", host=w.host, rank=w.rank)
        )
    return out


def format_text(report: NcclReport) -> str:
    """The human summary: versions, networks, communicators, transports, env, warnings, findings."""
    out = [
        (
            f"NCCL log analysis: {len(report.sources)} file(s), {len(report.hosts)} host(s), "
            f"{report.stats['nccl_lines']} NCCL lines, {report.stats['garbled']} garbled/truncated ignored"
        )
    ]
    out.append("versions:")
    out += [f"  {h}: {', '.join(vs)}" for h, vs in report.versions.items()] or ["  (none logged)"]
    out.append("network:")
    for host, net in report.networks.items():
        by_net: dict[str, list[int]] = defaultdict(list)
        for rank, name in net.rank_networks.items():
            by_net[name].append(rank)
        ranks = "; ".join(f"{n} ranks {_ranges(rs)}" for n, rs in by_net.items())
        devs = net.socket_devices if "Socket" in net.networks else net.ib_devices
        out.append(f"  {host}: {'/'.join(net.networks) or '?'} [{' '.join(devs)}]" + (f" ({ranks})" if ranks else ""))
        out += [f"    reason: {r}" for r in net.reasons]
    for comm in report.communicators.values():
        links = [k for k in report.links if k.comm == comm.key]
        if not (links or comm.rings or comm.nranks):
            continue
        shape = [
            f"{n} {what}"
            for n, what in [
                (comm.nranks, "ranks"),
                (comm.nnodes, "nodes"),
                (comm.local_ranks, "local ranks"),
                (len(comm.rings), "rings"),
                (len(comm.trees), "ranks with trees"),
            ]
            if n
        ]
        out.append(f"communicator {comm.key}: {', '.join(shape)}")
        for ch, order in sorted(comm.rings.items())[:2]:
            out.append(f"  ring {ch:02d}: {' '.join(map(str, order))}")
        counts: dict[tuple[str, str], set[tuple[int, int]]] = defaultdict(set)
        for k in links:
            counts[("intra-node" if k.intra_node else "inter-node", re.sub(r"/\d+(\(\d+\))?", "", k.transport))].add(
                (k.src, k.dst)
            )
        for (scope, via), pairs in sorted(counts.items()):
            out.append(f"  {scope} {via}: {len(pairs)} rank pairs")
    if report.env:
        out.append("environment:")
        out += [f"  {h}: " + " ".join(f"{k}={v}" for k, v in e.items()) for h, e in report.env.items()]
    if report.warnings:
        out.append("NCCL WARN:")
        out += [
            " ".join(filter(None, [f"  {w.host} rank {w.rank} [{w.device}]", w.where, w.message]))
            for w in report.warnings
        ]
    errors = len(report.errors)
    out.append("findings:")
    out += [f"  {f.severity.upper()} {f.code}: {f.message}" for f in report.findings] or ["  none"]
    out.append(f"result: {errors} error(s), {len(report.findings) - errors} warning(s)")
    return "\n".join(out)
