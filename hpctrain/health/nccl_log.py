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
communicators of different processes are matched by `commId` (else by their size). The report, its findings
and its text are in nccl_report.py.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.health.nccl_report import Communicator, HostNetwork, Link, NcclReport, NcclWarning, derive_findings

LOG_SUFFIXES = (".out", ".err", ".log", ".txt")

# `host:pid:tid [cudaDev] [file.cc:line ]NCCL INFO|WARN msg`; searched anywhere in a line, so srun --label,
# torchrun's `[default0]:` and Python logging prefixes are skipped.
_PREFIX = re.compile(
    r"(?P<host>[A-Za-z0-9][\w.\-]*):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:(?P<where>[\w./\-]+:\d+) )?NCCL (?P<level>INFO|WARN|TRACE) "
)
# 2.18-2.21 print the version once per process, unprefixed, from a communicator's rank 0; torch's errors end
# in "NCCL version 2.18.3" (no +cuda), which must not count.
_LABEL = re.compile(r"\s*(?:\d+: |\[[\w\-]+\]:)?")  # srun --label, torchrun --tee
_BARE_VERSION = re.compile(r"^(?:\d+: |\[[\w\-]+\]:)?NCCL version (\d+\.\d+\.\d+\+cuda[\d.]+)\s*$")
_VERSION = re.compile(r"^NCCL version (\d+\.\d+\.\d+(?:\+cuda[\d.]+)?)$")
_MISMATCH = re.compile(r"^Mismatched NCCL version detected : rank (\d+) version (\d+) rank (\d+) version (\d+)")
_INIT = re.compile(
    r"^(?:ncclCommInitRank\w* )?comm (0x[0-9a-f]+) rank (\d+) nranks (\d+) cudaDev \d+"
    r"(?: nvmlDev \d+)? busId \w+(?: commId (0x[0-9a-f]+))? - Init (?:START|COMPLETE)"
)
_COMM = re.compile(r"^comm (0x[0-9a-f]+) rank (\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank \d+")
_LINK = re.compile(
    r"^(?:Channel|Ring) (\d+)(?:/\d+)? : (\d+)\[(\w+)\] -> (\d+)\[(\w+)\]"
    r"(?: \[(send|receive)\])? via (\S.*?)\s*$"
)
_RING = re.compile(r"^(?:Channel (\d+)/\d+|Ring (\d+)) :((?:\s+\d+)+)\s*$")
_TREES = re.compile(r"^Trees((?: \[\d+\] -?\d+/-?\d+/-?\d+->-?\d+->-?\d+)+)\s*$")
_TREE = re.compile(r"\[(\d+)\] (-?\d+/-?\d+/-?\d+)->(-?\d+)->(-?\d+)")
_ENV = re.compile(r"^(NCCL_\w+) set (?:by environment )?to (.*?)\s*$")
_NET_IB = re.compile(r"^NET/(IB\w*) : Using (.*?); OOB")
_NET_SOCKET = re.compile(r"^NET/Socket : Using (.*)$")
_USING_NET = re.compile(r"^Using network (.+?)\s*$")
_NET_REASON = re.compile(
    r"NET/IB : No device found|Failed to open libibverbs|NET/IB : Unable to open|"
    r"Call to ibv_\w+ failed|NCCL_IB_DISABLE set by environment to 1|"
    r"^NET/Plugin ?: ?(?:Plugin load|dlerror|Could not find|Failed)"
)


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
        if m and _LABEL.fullmatch(line[: m.start()]):
            hosts.add(m["host"])
    return hosts


def _decode_version(code: int) -> str:
    """NCCL_VERSION_CODE as in a mismatch WARN: 21803 -> 2.18.3 (pre-2.9 codes were 2708 -> 2.7.8)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


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
                self.recs.append(
                    _Rec(
                        rec_host,
                        int(m["pid"]),
                        int(m["tid"]),
                        int(m["dev"]),
                        m["level"],
                        m["where"],
                        line[m.end() :].rstrip(),
                        source,
                    )
                )
            host = found[-1][0]
            self.bare_versions += [(host, v) for v in pending]
            pending = []

    def report(self, allow_socket: bool = False) -> NcclReport:
        """The records read in order, then what only the whole log tells: versions named by mismatch WARNs only,
        the hosts of each link's ends, each host's network; and the findings."""
        reader = _Reader(self._comm_ids(), self.bare_versions)
        for r in self.recs:
            reader.take(r)
        reader.resolve_mismatches()
        reader.resolve_links()
        versions, comms, env = reader.versions, reader.comms, reader.env
        all_hosts = sorted({r.host for r in self.recs} | {h for h, vs in versions.items() if vs})
        networks = reader.networks(all_hosts)
        warnings = reader.warnings()
        links = list(reader.links.values())
        multi_node = len(all_hosts) > 1 or any((c.nnodes or 0) > 1 for c in comms.values())
        return NcclReport(
            sources=self.sources,
            hosts=all_hosts,
            versions={h: sorted(vs) for h, vs in sorted(versions.items())},
            networks=networks,
            communicators=comms,
            links=sorted(links, key=lambda k: (k.comm, k.src, k.dst, k.side or "", k.transport)),
            env={h: dict(sorted(e.items())) for h, e in sorted(env.items())},
            warnings=warnings,
            findings=derive_findings(versions, networks, links, env, warnings, multi_node, allow_socket),
            stats=self.stats,
        )

    def _comm_ids(self) -> dict[tuple[str, int, str], str]:
        """Communicator ids by (host, pid, comm pointer), from Init START/COMPLETE lines, which may follow the
        lines they name."""
        comm_ids = {}
        for r in self.recs:
            if (m := _INIT.match(r.msg)) and m[4]:
                comm_ids[(r.host, r.pid, m[1])] = m[4]
        return comm_ids


class _Reader:
    """Reads the records in order: which communicator each thread is in (from its last init line), and what each
    record says about links, rings, trees, versions, networks and the environment."""

    def __init__(self, comm_ids: dict[tuple[str, int, str], str], bare_versions: list[tuple[str, str]]) -> None:
        self.comm_ids = comm_ids
        self.versions: dict[str, set[str]] = defaultdict(set)
        for host, v in bare_versions:
            self.versions[host].add(v)
        self.comms: dict[str, Communicator] = {}
        self.thread_comm: dict[tuple[str, int, int], str] = {}
        self.proc_comm: dict[tuple[str, int], str] = {}
        self.proc_rank: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.links: dict[tuple[str, int, int, str | None, str], Link] = {}
        self.env: dict[str, dict[str, str]] = defaultdict(dict)
        self.ib_devs: dict[str, list[str]] = defaultdict(list)
        self.sock_devs: dict[str, list[str]] = defaultdict(list)
        self.using: dict[tuple[str, int, int], str] = {}
        self.reasons: dict[str, list[str]] = defaultdict(list)
        self.mismatches: list[tuple[str, int, int]] = []
        self.warn_recs: list[_Rec] = []

    def key_of(self, r: _Rec) -> str:
        return self.thread_comm.get((r.host, r.pid, r.tid)) or self.proc_comm.get((r.host, r.pid)) or "?"

    def comm_of(self, r: _Rec) -> Communicator:
        return self.comms.setdefault(self.key_of(r), Communicator(self.key_of(r)))

    def enter_comm(self, r: _Rec, ptr: str, rank: int, nranks: int) -> Communicator:
        key = self.comm_ids.get((r.host, r.pid, ptr), f"nranks={nranks}")
        self.thread_comm[(r.host, r.pid, r.tid)] = self.proc_comm[(r.host, r.pid)] = key
        comm = self.comms.setdefault(key, Communicator(key))
        comm.nranks = nranks
        comm.rank_hosts[rank] = r.host
        if self.proc_rank.get((r.host, r.pid, r.dev), (-1, 0))[0] < nranks:
            self.proc_rank[(r.host, r.pid, r.dev)] = (nranks, rank)
        return comm

    def take(self, r: _Rec) -> None:
        """One record: the first pattern that matches says what it is; any record may set env or give a reason."""
        msg = r.msg
        if r.level == "WARN":
            self.warn_recs.append(r)
            if m := _MISMATCH.match(msg):
                self.mismatches += [(self.key_of(r), int(m[1]), int(m[2])), (self.key_of(r), int(m[3]), int(m[4]))]
        elif m := _LINK.match(msg):
            self.take_link(r, m)
        elif m := _INIT.match(msg):
            self.enter_comm(r, m[1], int(m[2]), int(m[3]))
        elif m := _COMM.match(msg):
            comm = self.enter_comm(r, m[1], int(m[2]), int(m[3]))
            comm.nnodes, comm.local_ranks = int(m[4]), int(m[5])
        elif m := _RING.match(msg):
            self.comm_of(r).rings[int(m[1] or m[2])] = [int(x) for x in m[3].split()]
        elif m := _TREES.match(msg):
            comm = self.comm_of(r)
            for ch, children, rank, parent in _TREE.findall(m[1]):
                comm.rank_hosts[int(rank)] = r.host
                comm.trees.setdefault(int(rank), {})[int(ch)] = f"{children}->{rank}->{parent}"
        elif m := _VERSION.match(msg):
            self.versions[r.host].add(m[1])
        elif m := _NET_IB.match(msg):
            ib = self.ib_devs[r.host]
            ib += [d for d in re.findall(r"\[\d+\](\S+)", m[2]) if d not in ib]
        elif m := _NET_SOCKET.match(msg):
            sock = self.sock_devs[r.host]
            sock += [d for d in re.findall(r"\[\d+\]([^\s<]+)", m[1]) if d not in sock]
        elif m := _USING_NET.match(msg):
            self.using[(r.host, r.pid, r.dev)] = m[1]
        if r.level == "INFO" and (m := _ENV.match(msg)):
            value = m[2][:-1] if re.fullmatch(r"-?\d+\.", m[2]) else m[2]
            self.env[r.host][m[1]] = value
        if _NET_REASON.search(msg):
            self.reasons[r.host].append(msg)

    def take_link(self, r: _Rec, m: re.Match[str]) -> None:
        """A link line places the ranks on the printing host: the sender always, the receiver when it is the
        receive side or an intra-node (P2P/SHM) link."""
        comm = self.comm_of(r)
        src, dst, side, via = int(m[2]), int(m[4]), m[6], m[7]
        kind = via.split("/")[0]
        if side in (None, "send"):
            comm.rank_hosts[src] = r.host
        if side == "receive" or (side is None and kind in ("P2P", "SHM")):
            comm.rank_hosts[dst] = r.host
        link = self.links.setdefault(
            (comm.key, src, dst, side, via),
            Link(comm.key, src, m[3], dst, m[5], side, via, kind, gdrdma="/GDRDMA" in via),
        )
        if int(m[1]) not in link.channels:
            link.channels.append(int(m[1]))

    def resolve_mismatches(self) -> None:
        """A "Mismatched NCCL version" WARN names a rank's version: it counts for the rank's host unless that host
        logged the same version already."""
        for key, rank, code in self.mismatches:
            host = self.comms[key].rank_hosts.get(rank) if key in self.comms else None
            if host is not None:
                version = _decode_version(code)
                if not any(v.split("+")[0] == version for v in self.versions[host]):
                    self.versions[host].add(version)

    def resolve_links(self) -> None:
        """The hosts of each link's ends, known once every line has placed its ranks."""
        for link in self.links.values():
            hosts = self.comms[link.comm].rank_hosts
            link.src_host, link.dst_host = hosts.get(link.src), hosts.get(link.dst)
            link.intra_node = link.kind in ("P2P", "SHM") or (
                link.kind == "NET" and link.src_host is not None and link.src_host == link.dst_host
            )
            link.channels.sort()

    def networks(self, hosts: list[str]) -> dict[str, HostNetwork]:
        """What each host uses between nodes (by its processes' "Using network" lines, else by the devices it
        listed), and why, when that is the socket fallback."""
        networks: dict[str, HostNetwork] = {}
        for host in hosts:
            net = HostNetwork(host, ib_devices=self.ib_devs[host], socket_devices=self.sock_devs[host])
            for (h, pid, dev), name in sorted(self.using.items()):
                if h == host:
                    if name not in net.networks:
                        net.networks.append(name)
                    if (h, pid, dev) in self.proc_rank:
                        net.rank_networks[self.proc_rank[(h, pid, dev)][1]] = name
            if not net.networks:
                net.networks = ["Socket"] if net.socket_devices else ["IB"] if net.ib_devices else []
            if "Socket" in net.networks:
                net.reasons = list(dict.fromkeys(self.reasons[host]))
            if net.networks or net.ib_devices or net.socket_devices:
                networks[host] = net
        return networks

    def warnings(self) -> list[NcclWarning]:
        return [
            NcclWarning(
                r.host, r.pid, r.dev, self.proc_rank.get((r.host, r.pid, r.dev), (0, None))[1], r.where, r.msg, r.source
            )
            for r in self.warn_recs
        ]


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
