"""Read what NCCL said at init (NCCL_DEBUG=INFO) and flag the setups that make a job slow or broken.

A multi-node job that is 5x slower than it should be is usually one of: a node with another NCCL build
(a mismatch fails init, or hangs), a node whose IB stack is missing so NCCL falls back to TCP sockets, a GPU
pair that talks through host shared memory instead of NVLink/PCIe P2P, or an inter-node link without
GPUDirect RDMA. All of it is in the INFO lines NCCL prints at communicator init; this module turns those
lines, from one file or a directory of per-rank logs, into an `NcclReport` with findings.

Pure text processing, no torch: it runs on a login node against the logs of a finished or hung job. Logs
of many ranks written to one stream interleave mid-line; a record cut by another rank's record, or by the
end of the file, is counted as garbled and ignored rather than misread (a cut `via NET/IB/0/GDRDMA` would
otherwise read as a link without GDRDMA).

Formats: NCCL 2.18-2.21 (older `Ring NN :` link lines and newer prefixed version lines are read too).
Ranks in link, ring and tree lines are communicator ranks; lines are tied to their communicator through
the thread that printed the communicator's `comm 0x... rank R nRanks N` / `Init START` line, and
communicators of different processes are matched by `commId` (else by their size).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ERROR = "error"
WARNING = "warning"
LOG_SUFFIXES = (".out", ".err", ".log", ".txt")

# `host:pid:tid [cudaDev] [file.cc:line ]NCCL INFO|WARN msg`; searched anywhere in a line, so srun --label,
# torchrun's `[default0]:` and Python logging prefixes are skipped.
_PREFIX = re.compile(r"(?P<host>[A-Za-z0-9][\w.\-]*):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
                     r"(?:(?P<where>[\w./\-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE) ")
# 2.18-2.21 print the version once per process, unprefixed, from a communicator's rank 0; torch's errors end
# in "NCCL version 2.18.3" (no +cuda), which must not count.
_LABEL = re.compile(r"\s*(?:\d+: |\[[\w\-]+\]:)?")  # srun --label, torchrun --tee
_BARE_VERSION = re.compile(r"^(?:\d+: |\[[\w\-]+\]:)?NCCL version (\d+\.\d+\.\d+\+cuda[\d.]+)\s*$")
_VERSION = re.compile(r"^NCCL version (\d+\.\d+\.\d+(?:\+cuda[\d.]+)?)$")
_MISMATCH = re.compile(r"^Mismatched NCCL version detected : rank (\d+) version (\d+) rank (\d+) version (\d+)")
_INIT = re.compile(r"^(?:ncclCommInitRank\w* )?comm (0x[0-9a-f]+) rank (\d+) nranks (\d+) cudaDev \d+"
                   r"(?: nvmlDev \d+)? busId \w+(?: commId (0x[0-9a-f]+))? - Init (?:START|COMPLETE)")
_COMM = re.compile(r"^comm (0x[0-9a-f]+) rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank \d+")
_LINK = re.compile(r"^(?:Channel|Ring) (\d+)(?:/\d+)? : (\d+)\[(\w+)\] -> (\d+)\[(\w+)\]"
                   r"(?: \[(send|receive)\])? via (\S.*?)\s*$")
_RING = re.compile(r"^(?:Channel (\d+)/\d+|Ring (\d+)) :((?:\s+\d+)+)\s*$")
_TREES = re.compile(r"^Trees((?: \[\d+\] -?\d+/-?\d+/-?\d+->-?\d+->-?\d+)+)\s*$")
_TREE = re.compile(r"\[(\d+)\] (-?\d+/-?\d+/-?\d+)->(-?\d+)->(-?\d+)")
_ENV = re.compile(r"^(NCCL_\w+) set (?:by environment )?to (.*?)\s*$")
_NET_IB = re.compile(r"^NET/(IB\w*) : Using (.*?); OOB")
_NET_SOCKET = re.compile(r"^NET/Socket : Using (.*)$")
_USING_NET = re.compile(r"^Using network (.+?)\s*$")
_NET_REASON = re.compile(r"NET/IB : No device found|Failed to open libibverbs|NET/IB : Unable to open|"
                         r"Call to ibv_\w+ failed|NCCL_IB_DISABLE set by environment to 1|"
                         r"^NET/Plugin ?: ?(?:Plugin load|dlerror|Could not find|Failed)")


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


@dataclass
class _Rec:
    host: str
    pid: int
    tid: int
    dev: int
    level: str
    where: str | None
    msg: str
    source: str


def _split(line: str, hosts: set[str]) -> list[tuple[str, re.Match[str], int]]:
    """Each record in a line as (host, match, start).

    A record glued to the cut end of another (`...NET/IB/0/GDgpu-d01:55:66 [1] NCCL INFO ...`) matches with
    the cut text in its host name; a known host that ends that name gives the real host and start.
    """
    found = []
    for m in _PREFIX.finditer(line):
        host, start = m["host"], m.start()
        if host not in hosts:
            real = max((h for h in hosts if host.endswith(h)), key=len, default=None)
            if real is not None:
                host, start = real, m.end("host") - len(real)
        found.append((host, m, start))
    return found


def _clean_starts(lines: Sequence[str]) -> set[str]:
    """Hosts of records that start a line, after at most a launcher label: glued records resolve against these."""
    hosts = set()
    for line in lines:
        m = _PREFIX.search(line)
        if m and _LABEL.fullmatch(line[:m.start()]):
            hosts.add(m["host"])
    return hosts


def _decode_version(code: int) -> str:
    """NCCL_VERSION_CODE as in a mismatch WARN: 21803 -> 2.18.3 (pre-2.9 codes were 2708 -> 2.7.8)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    out: list[str] = []
    for v in sorted(set(values)):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


class _Collector:
    """Accumulates records from one or more streams; `report()` resolves hosts and derives findings."""

    def __init__(self) -> None:
        self.sources: list[str] = []
        self.recs: list[_Rec] = []
        self.bare_versions: list[tuple[str, str]] = []
        self.stats = {"lines": 0, "nccl_lines": 0, "garbled": 0, "other_lines": 0}

    def feed(self, lines: Sequence[str], source: str, hosts: set[str], partial_last: bool = False) -> None:
        """Split one stream into records. An unprefixed version line belongs to the host of the record before
        it (the process that printed it), or of the first record when it opens the stream."""
        self.sources.append(source)
        host: str | None = None
        pending: list[str] = []
        last = len(lines) - 1 if partial_last else -1
        for i, raw in enumerate(lines):
            line = raw.rstrip("\r\n")
            self.stats["lines"] += 1
            found = _split(line, hosts)
            if not found:
                m = _BARE_VERSION.match(line)
                if m and i != last:
                    if host is None:
                        pending.append(m[1])
                    else:
                        self.bare_versions.append((host, m[1]))
                elif line.strip():
                    self.stats["other_lines"] += 1
                continue
            for j, (rec_host, m, _start) in enumerate(found):
                if j + 1 < len(found) or i == last:
                    self.stats["garbled"] += 1
                    continue
                self.stats["nccl_lines"] += 1
                self.recs.append(_Rec(rec_host, int(m["pid"]), int(m["tid"]), int(m["dev"]), m["level"], m["where"],
                                      line[m.end():].rstrip(), source))
            host = found[-1][0]
            self.bare_versions += [(host, v) for v in pending]
            pending = []

    def report(self, allow_socket: bool = False) -> NcclReport:
        # Communicator ids come from Init START/COMPLETE lines, which may follow the lines they name.
        comm_ids = {}
        for r in self.recs:
            if (m := _INIT.match(r.msg)) and m[4]:
                comm_ids[(r.host, r.pid, m[1])] = m[4]

        versions: dict[str, set[str]] = defaultdict(set)
        for host, v in self.bare_versions:
            versions[host].add(v)
        comms: dict[str, Communicator] = {}
        thread_comm: dict[tuple[str, int, int], str] = {}
        proc_comm: dict[tuple[str, int], str] = {}
        proc_rank: dict[tuple[str, int, int], tuple[int, int]] = {}
        links: dict[tuple[str, int, int, str | None, str], Link] = {}
        env: dict[str, dict[str, str]] = defaultdict(dict)
        ib_devs: dict[str, list[str]] = defaultdict(list)
        sock_devs: dict[str, list[str]] = defaultdict(list)
        using: dict[tuple[str, int, int], str] = {}
        reasons: dict[str, list[str]] = defaultdict(list)
        mismatches: list[tuple[str, int, int]] = []
        warn_recs: list[_Rec] = []

        def key_of(r: _Rec) -> str:
            return thread_comm.get((r.host, r.pid, r.tid)) or proc_comm.get((r.host, r.pid)) or "?"

        def comm_of(r: _Rec) -> Communicator:
            return comms.setdefault(key_of(r), Communicator(key_of(r)))

        def enter_comm(r: _Rec, ptr: str, rank: int, nranks: int) -> Communicator:
            key = comm_ids.get((r.host, r.pid, ptr), f"nranks={nranks}")
            thread_comm[(r.host, r.pid, r.tid)] = proc_comm[(r.host, r.pid)] = key
            comm = comms.setdefault(key, Communicator(key))
            comm.nranks = nranks
            comm.rank_hosts[rank] = r.host
            if proc_rank.get((r.host, r.pid, r.dev), (-1, 0))[0] < nranks:
                proc_rank[(r.host, r.pid, r.dev)] = (nranks, rank)
            return comm

        for r in self.recs:
            msg = r.msg
            if r.level == "WARN":
                warn_recs.append(r)
                if m := _MISMATCH.match(msg):
                    mismatches += [(key_of(r), int(m[1]), int(m[2])), (key_of(r), int(m[3]), int(m[4]))]
            elif m := _LINK.match(msg):
                comm = comm_of(r)
                src, dst, side, via = int(m[2]), int(m[4]), m[6], m[7]
                kind = via.split("/")[0]
                if side in (None, "send"):
                    comm.rank_hosts[src] = r.host
                if side == "receive" or (side is None and kind in ("P2P", "SHM")):
                    comm.rank_hosts[dst] = r.host
                link = links.setdefault((comm.key, src, dst, side, via),
                                        Link(comm.key, src, m[3], dst, m[5], side, via, kind,
                                             gdrdma="/GDRDMA" in via))
                if int(m[1]) not in link.channels:
                    link.channels.append(int(m[1]))
            elif m := _INIT.match(msg):
                enter_comm(r, m[1], int(m[2]), int(m[3]))
            elif m := _COMM.match(msg):
                comm = enter_comm(r, m[1], int(m[2]), int(m[3]))
                comm.nnodes, comm.local_ranks = int(m[4]), int(m[5])
            elif m := _RING.match(msg):
                comm_of(r).rings[int(m[1] or m[2])] = [int(x) for x in m[3].split()]
            elif m := _TREES.match(msg):
                comm = comm_of(r)
                for ch, children, rank, parent in _TREE.findall(m[1]):
                    comm.rank_hosts[int(rank)] = r.host
                    comm.trees.setdefault(int(rank), {})[int(ch)] = f"{children}->{rank}->{parent}"
            elif m := _VERSION.match(msg):
                versions[r.host].add(m[1])
            elif m := _NET_IB.match(msg):
                ib_devs[r.host] += [d for d in re.findall(r"\[\d+\](\S+)", m[2]) if d not in ib_devs[r.host]]
            elif m := _NET_SOCKET.match(msg):
                sock_devs[r.host] += [d for d in re.findall(r"\[\d+\]([^\s<]+)", m[1]) if d not in sock_devs[r.host]]
            elif m := _USING_NET.match(msg):
                using[(r.host, r.pid, r.dev)] = m[1]
            if r.level == "INFO" and (m := _ENV.match(msg)):
                value = m[2][:-1] if re.fullmatch(r"-?\d+\.", m[2]) else m[2]
                env[r.host][m[1]] = value
            if _NET_REASON.search(msg):
                reasons[r.host].append(msg)

        for key, rank, code in mismatches:
            host = comms[key].rank_hosts.get(rank) if key in comms else None
            if host is not None:
                version = _decode_version(code)
                if not any(v.split("+")[0] == version for v in versions[host]):
                    versions[host].add(version)

        for link in links.values():
            hosts = comms[link.comm].rank_hosts
            link.src_host, link.dst_host = hosts.get(link.src), hosts.get(link.dst)
            link.intra_node = link.kind in ("P2P", "SHM") or (
                link.kind == "NET" and link.src_host is not None and link.src_host == link.dst_host)
            link.channels.sort()

        networks: dict[str, HostNetwork] = {}
        all_hosts = sorted({r.host for r in self.recs} | {h for h, vs in versions.items() if vs})
        for host in all_hosts:
            net = HostNetwork(host, ib_devices=ib_devs[host], socket_devices=sock_devs[host])
            for (h, pid, dev), name in sorted(using.items()):
                if h == host:
                    if name not in net.networks:
                        net.networks.append(name)
                    if (h, pid, dev) in proc_rank:
                        net.rank_networks[proc_rank[(h, pid, dev)][1]] = name
            if not net.networks:
                net.networks = ["Socket"] if net.socket_devices else ["IB"] if net.ib_devices else []
            if "Socket" in net.networks:
                net.reasons = list(dict.fromkeys(reasons[host]))
            if net.networks or net.ib_devices or net.socket_devices:
                networks[host] = net

        warnings = [NcclWarning(r.host, r.pid, r.dev, proc_rank.get((r.host, r.pid, r.dev), (0, None))[1],
                                r.where, r.msg, r.source) for r in warn_recs]
        multi_node = len(all_hosts) > 1 or any((c.nnodes or 0) > 1 for c in comms.values())
        return NcclReport(
            sources=self.sources,
            hosts=all_hosts,
            versions={h: sorted(vs) for h, vs in sorted(versions.items())},
            networks=networks,
            communicators=comms,
            links=sorted(links.values(), key=lambda k: (k.comm, k.src, k.dst, k.side or "", k.transport)),
            env={h: dict(sorted(e.items())) for h, e in sorted(env.items())},
            warnings=warnings,
            findings=_findings(versions, networks, list(links.values()), env, warnings, multi_node, allow_socket),
            stats=self.stats,
        )


def _findings(versions: dict[str, set[str]], networks: dict[str, HostNetwork], links: list[Link],
              env: dict[str, dict[str, str]], warnings: list[NcclWarning], multi_node: bool,
              allow_socket: bool) -> list[Finding]:
    """The policy: what is an error (exit 1) and what a warning; see the tools/nccl_log.py docstring."""
    out: list[Finding] = []
    base = {v.split("+")[0] for vs in versions.values() for v in vs}
    if len(base) > 1:
        per_host = ", ".join(f"{h}={'/'.join(sorted(vs))}" for h, vs in sorted(versions.items()))
        out.append(Finding(ERROR, "version-mismatch", f"NCCL versions differ across hosts: {per_host}"))

    for host, net in sorted(networks.items()):
        if "Socket" in net.networks:
            why = "; ".join(net.reasons) or "no reason logged"
            scope = "a multi-node job" if multi_node else "a single-node job"
            severity = ERROR if multi_node and not allow_socket else WARNING
            out.append(Finding(severity, "socket-fallback",
                               f"{host}: NCCL uses TCP sockets ({', '.join(net.socket_devices) or '?'}) "
                               f"instead of IB/RoCE on {scope}; reason: {why}", host=host))

    slow: dict[tuple[str, int, int], list[Link]] = defaultdict(list)
    for link in links:
        if link.intra_node and link.kind in ("SHM", "NET"):
            slow[(link.comm, link.src, link.dst)].append(link)
    for (comm, src, dst), group in sorted(slow.items()):
        host = group[0].src_host or group[0].dst_host
        p2p = len({(k.src, k.dst) for k in links if k.comm == comm and k.kind == "P2P"})
        channels = _ranges(c for k in group for c in k.channels)
        hint = "; ".join(f"{k}={v}" for k, v in env.get(host or "", {}).items() if k.startswith(("NCCL_P2P", "NCCL_SHM")))
        out.append(Finding(WARNING, "intra-node-slow-path",
                           f"{host}: intra-node hop {src}[{group[0].src_dev}] -> {dst}[{group[0].dst_dev}] "
                           f"uses {', '.join(sorted({k.transport for k in group}))} (channels {channels}), "
                           + (f"while {p2p} other intra-node rank pairs use P2P" if p2p else "no link uses P2P")
                           + (f"; {hint}" if hint else ""), host=host, rank=src))

    inter = [k for k in links if k.kind == "NET" and not k.intra_node and not k.transport.startswith("NET/Socket")]
    if any(k.gdrdma for k in inter):
        for k in inter:
            if not k.gdrdma:
                host = k.src_host if k.side == "send" else k.dst_host
                out.append(Finding(WARNING, "no-gdrdma",
                                   f"{host}: inter-node link {k.src} -> {k.dst} ({k.side} side) uses {k.transport} "
                                   f"without GPUDirect RDMA (channels {_ranges(k.channels)}) while other "
                                   "inter-node links use GDRDMA", host=host, rank=k.src if k.side == "send" else k.dst))

    for w in warnings:
        out.append(Finding(WARNING, "nccl-warn", f"{w.host} rank {w.rank} [{w.device}]: {w.message}",
                           host=w.host, rank=w.rank))
    return out


def parse_lines(lines: Iterable[str], source: str = "<input>", allow_socket: bool = False) -> NcclReport:
    """Analyze one stream of log lines (newlines optional)."""
    lines = list(lines)
    collector = _Collector()
    collector.feed(lines, source, _clean_starts(lines))
    return collector.report(allow_socket)


def _natural(path: Path) -> list[Any]:
    """`7731_10_log.out` sorts after `7731_9_log.out`."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", path.name)]


def log_files(paths: Sequence[str | Path]) -> list[Path]:
    """Files to read: each file as given, each directory's *.out/*.err/*.log/*.txt (submitit's per-rank logs)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted((f for f in p.iterdir() if f.is_file() and f.suffix in LOG_SUFFIXES), key=_natural)
            if not found:
                raise FileNotFoundError(f"{p}: no {'/'.join('*' + s for s in LOG_SUFFIXES)} files")
            files += found
        else:
            files.append(p)
    return files


def analyze(paths: Sequence[str | Path], allow_socket: bool = False) -> NcclReport:
    """Analyze log files and directories of them together, as one job. Raises OSError when one is unreadable."""
    texts = [(str(f), f.read_text(errors="replace")) for f in log_files(paths)]
    split = [(name, text.splitlines(), bool(text) and not text.endswith(("\n", "\r"))) for name, text in texts]
    hosts = set().union(*(_clean_starts(lines) for _, lines, _ in split))
    collector = _Collector()
    for name, lines, partial in split:
        collector.feed(lines, name, hosts, partial_last=partial)
    return collector.report(allow_socket)


def format_text(report: NcclReport) -> str:
    """The human summary: versions, networks, communicators, transports, env, warnings, findings."""
    out = [(f"NCCL log analysis: {len(report.sources)} file(s), {len(report.hosts)} host(s), "
            f"{report.stats['nccl_lines']} NCCL lines, {report.stats['garbled']} garbled/truncated ignored")]
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
        shape = [f"{n} {what}" for n, what in [(comm.nranks, "ranks"), (comm.nnodes, "nodes"),
                                                (comm.local_ranks, "local ranks"), (len(comm.rings), "rings"),
                                                (len(comm.trees), "ranks with trees")] if n]
        out.append(f"communicator {comm.key}: {', '.join(shape)}")
        for ch, order in sorted(comm.rings.items())[:2]:
            out.append(f"  ring {ch:02d}: {' '.join(map(str, order))}")
        counts: dict[tuple[str, str], set[tuple[int, int]]] = defaultdict(set)
        for k in links:
            counts[("intra-node" if k.intra_node else "inter-node", re.sub(r"/\d+(\(\d+\))?", "", k.transport))].add(
                (k.src, k.dst))
        for (scope, via), pairs in sorted(counts.items()):
            out.append(f"  {scope} {via}: {len(pairs)} rank pairs")
    if report.env:
        out.append("environment:")
        out += [f"  {h}: " + " ".join(f"{k}={v}" for k, v in e.items()) for h, e in report.env.items()]
    if report.warnings:
        out.append("NCCL WARN:")
        out += [" ".join(filter(None, [f"  {w.host} rank {w.rank} [{w.device}]", w.where, w.message]))
                for w in report.warnings]
    errors = len(report.errors)
    out.append("findings:")
    out += [f"  {f.severity.upper()} {f.code}: {f.message}" for f in report.findings] or ["  none"]
    out.append(f"result: {errors} error(s), {len(report.findings) - errors} warning(s)")
    return "\n".join(out)
