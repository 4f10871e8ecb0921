"""The NCCL log analyzer on hand-written logs in NCCL 2.18-2.21's exact INFO formats (fixtures/nccl/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.health.nccl_log import NcclReport, _decode_version, analyze, parse_lines

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).resolve().parent / "fixtures" / "nccl"
TOOL = REPO / "tools" / "nccl_log.py"


def links(report: NcclReport) -> set[tuple[int, int, str | None, str, tuple[int, ...], bool]]:
    return {(k.src, k.dst, k.side, k.transport, tuple(k.channels), k.intra_node) for k in report.links}


def codes(report: NcclReport) -> list[tuple[str, str, str | None, int | None]]:
    return [(f.severity, f.code, f.host, f.rank) for f in report.findings]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )


def test_ib_2x8_submitit_dir_is_clean() -> None:
    r = analyze([FIX / "ib_2x8"])
    assert [Path(s).name for s in r.sources][:4] == [
        "7731_0_log.err",
        "7731_0_log.out",
        "7731_1_log.out",
        "7731_2_log.out",
    ]
    assert len(r.sources) == 18 and not any(s.endswith(".pkl") for s in r.sources)
    assert r.hosts == ["gpu-a01", "gpu-a02"]
    assert r.versions == {"gpu-a01": ["2.19.3+cuda12.3"]}  # 2.19 prints it once, unprefixed, from rank 0
    hcas = ["mlx5_0:1/IB", "mlx5_1:1/IB", "mlx5_2:1/IB", "mlx5_3:1/IB"]
    for host, ranks in (("gpu-a01", range(8)), ("gpu-a02", range(8, 16))):
        net = r.networks[host]
        assert (net.networks, net.ib_devices, net.socket_devices, net.reasons) == (["IB"], hcas, [], [])
        assert net.rank_networks == {rank: "IB" for rank in ranks}
    ib = {"NCCL_IB_HCA": "mlx5_0,mlx5_1,mlx5_2,mlx5_3", "NCCL_IB_TIMEOUT": "22", "NCCL_SOCKET_IFNAME": "ib0"}
    assert r.env == {"gpu-a01": ib, "gpu-a02": ib}
    (comm,) = r.communicators.values()
    assert (comm.key, comm.nranks, comm.nnodes, comm.local_ranks) == ("0x6b1f0e4c9d2a7853", 16, 2, 8)
    assert comm.rings == {0: list(range(16)), 1: list(range(16))}
    assert comm.trees[0] == {0: "1/8/-1->0->-1", 1: "1/-1/-1->0->8"}
    assert comm.trees[8] == {0: "9/-1/-1->8->0", 1: "9/0/-1->8->-1"}
    assert comm.rank_hosts == {rank: "gpu-a01" if rank < 8 else "gpu-a02" for rank in range(16)}

    both = (0, 1)
    intra = {(s, s + 1) for s in range(16) if s % 8 != 7} | {(s, s - 1) for s in range(16) if s % 8}
    expected = {(s, d, None, "P2P/CUMEM", both, True) for s, d in intra}
    expected |= {
        (7, 8, "send", "NET/IB/3/GDRDMA", both, False),
        (7, 8, "receive", "NET/IB/0/GDRDMA", both, False),
        (15, 0, "send", "NET/IB/3/GDRDMA", both, False),
        (15, 0, "receive", "NET/IB/0/GDRDMA", both, False),
    }
    expected |= {
        (s, d, side, "NET/IB/0/GDRDMA", both, False) for s, d in ((0, 8), (8, 0)) for side in ("send", "receive")
    }
    assert links(r) == expected
    assert all(k.gdrdma for k in r.links if k.kind == "NET")
    assert r.warnings == [] and r.findings == [] and r.exit_code == 0
    assert r.stats["garbled"] == 0


def test_socket_fallback_with_reason_is_an_error_on_multi_node() -> None:
    r = analyze([FIX / "socket_libibverbs.log"])
    assert r.versions == {"gpu-b01": ["2.18.1+cuda12.1"]}  # "0: NCCL version ..." behind srun --label
    plugin = (
        "NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open shared object "
        "file: No such file or directory"
    )
    reasons = [plugin, "Failed to open libibverbs.so[.1]"]
    for host, ip, ranks in (("gpu-b01", "10.20.0.11", {0, 1}), ("gpu-b02", "10.20.0.12", {2, 3})):
        net = r.networks[host]
        assert (net.networks, net.socket_devices, net.ib_devices) == (["Socket"], [f"eth0:{ip}"], [])
        assert net.reasons == reasons
        assert net.rank_networks == {rank: "Socket" for rank in ranks}
    assert codes(r) == [("error", "socket-fallback", "gpu-b01", None), ("error", "socket-fallback", "gpu-b02", None)]
    assert "Failed to open libibverbs.so[.1]" in r.findings[0].message and "multi-node" in r.findings[0].message
    both = (0, 1)
    assert links(r) == {
        (0, 1, None, "P2P/IPC", both, True),
        (1, 0, None, "P2P/IPC", both, True),
        (2, 3, None, "P2P/IPC", both, True),
        (3, 2, None, "P2P/IPC", both, True),
        *{
            (s, d, side, "NET/Socket/0", both, False)
            for s, d in ((1, 2), (3, 0), (0, 2), (2, 0))
            for side in ("send", "receive")
        },
    }
    assert r.exit_code == 1
    relaxed = analyze([FIX / "socket_libibverbs.log"], allow_socket=True)
    assert [f.severity for f in relaxed.findings] == ["warning", "warning"] and relaxed.exit_code == 0


def test_shm_hop_instead_of_direct_pointer_is_flagged() -> None:
    r = analyze([FIX / "shm_vs_p2p.log"])
    assert r.versions == {"gpu-l01": ["2.21.5+cuda12.4"]}
    assert r.networks["gpu-l01"].ib_devices == ["mlx5_0:1/RoCE"]
    assert r.env == {"gpu-l01": {"NCCL_IB_GID_INDEX": "3"}}  # the integer form ends in "."
    shm = {(3, 4), (4, 3), (7, 0)}
    pairs = {(d, d + 1) for d in range(7)} | {(d, d - 1) for d in range(1, 8)} | {(7, 0)}
    assert links(r) == {
        (s, d, None, "SHM/direct/direct" if (s, d) in shm else "P2P/direct pointer", (0, 1), True) for s, d in pairs
    }
    assert codes(r) == [
        ("warning", "intra-node-slow-path", "gpu-l01", 3),
        ("warning", "intra-node-slow-path", "gpu-l01", 4),
        ("warning", "intra-node-slow-path", "gpu-l01", 7),
    ]
    assert r.findings[0].message == (
        "gpu-l01: intra-node hop 3[3] -> 4[4] uses SHM/direct/direct (channels 0-1), "
        "while 12 other intra-node rank pairs use P2P"
    )
    assert r.exit_code == 0
    (comm,) = r.communicators.values()
    assert (comm.nranks, comm.nnodes, comm.local_ranks, comm.rings[0]) == (8, 1, 8, list(range(8)))


def test_version_mismatch_between_hosts() -> None:
    r = analyze([FIX / "version_mismatch"])
    # gpu-c02's 2.19.3 never prints its version line (not a rank 0): it comes from the mismatch WARN's 21903;
    # torch's "..., NCCL version 2.18.3" error line is not a version line
    assert r.versions == {"gpu-c01": ["2.18.3+cuda12.1"], "gpu-c02": ["2.19.3"]}
    assert codes(r) == [
        ("error", "version-mismatch", None, None),
        ("warning", "nccl-warn", "gpu-c01", 0),
        ("warning", "nccl-warn", "gpu-c01", 1),
        ("warning", "nccl-warn", "gpu-c02", 2),
        ("warning", "nccl-warn", "gpu-c02", 3),
    ]
    assert r.findings[0].message == "NCCL versions differ across hosts: gpu-c01=2.18.3+cuda12.1, gpu-c02=2.19.3"
    assert [(w.host, w.rank, w.device, w.where) for w in r.warnings] == [
        ("gpu-c01", 0, 0, "init.cc:643"),
        ("gpu-c01", 1, 1, "init.cc:643"),
        ("gpu-c02", 2, 0, "init.cc:712"),
        ("gpu-c02", 3, 1, "init.cc:712"),
    ]
    assert r.warnings[2].message == "Mismatched NCCL version detected : rank 0 version 21803 rank 2 version 21903"
    assert r.env["gpu-c02"] == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert r.links == [] and r.exit_code == 1


def test_interleaved_and_truncated_lines_are_dropped_not_misread() -> None:
    r = analyze([FIX / "garbled_interleaved.log"])
    # cut records: rank 3's NET/IB line, rank 2's Trees, a `via NET/IB/0/GD` receive, an Init COMPL, the last WARN
    assert r.stats["garbled"] == 5
    assert r.hosts == ["gpu-d01", "gpu-d02"]  # "...OOgpu-d01:..." and "...GDgpu-d02:..." resolve to known hosts
    assert r.versions == {"gpu-d01": ["2.20.5+cuda12.4"]}
    assert r.networks["gpu-d01"].rank_networks == {0: "IB", 1: "IB"}  # rank 1's line was glued after a cut one
    assert r.networks["gpu-d02"].rank_networks == {2: "IB", 3: "IB"}
    both, ch0 = (0, 1), (0,)
    assert links(r) == {
        (0, 1, None, "P2P/IPC", both, True),
        (1, 0, None, "P2P/IPC", both, True),
        (2, 3, None, "P2P/IPC", both, True),
        (3, 2, None, "P2P/IPC", both, True),
        (1, 2, "send", "NET/IB/1/GDRDMA", both, False),
        (1, 2, "receive", "NET/IB/0/GDRDMA", both, False),
        (3, 0, "send", "NET/IB/1/GDRDMA", both, False),
        (3, 0, "receive", "NET/IB/0/GDRDMA", ch0, False),
        (0, 2, "send", "NET/IB/0/GDRDMA", both, False),
        (0, 2, "receive", "NET/IB/0/GDRDMA", both, False),
        (2, 0, "send", "NET/IB/0/GDRDMA", both, False),
        (2, 0, "receive", "NET/IB/0/GDRDMA", both, False),
    }
    (comm,) = r.communicators.values()
    assert sorted(comm.trees) == [0, 1, 3]
    ib = {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert r.env == {"gpu-d01": ib, "gpu-d02": ib}
    assert [(w.host, w.rank, w.where) for w in r.warnings] == [("gpu-d02", 2, "transport/net_ib.cc:1696")]
    assert codes(r) == [("warning", "nccl-warn", "gpu-d02", 2)] and r.exit_code == 0


def test_cut_last_line_is_not_a_link(tmp_path: Path) -> None:
    log = tmp_path / "rank1.out"
    log.write_text(
        "n1:10:11 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA\n"
        "n1:10:11 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [send] via NET/IB/0"
    )  # killed mid-write
    r = analyze([log])
    assert links(r) == {(1, 0, "send", "NET/IB/0/GDRDMA", (0,), False)} and r.stats["garbled"] == 1


def test_net_inside_a_node_and_missing_gdrdma() -> None:
    r = parse_lines(
        [
            "n1:10:11 [0] NCCL INFO comm 0x1 rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0",
            "n1:10:11 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1.",
            "n1:10:11 [0] NCCL INFO NCCL_SHM_DISABLE set by environment to 1.",
            "n1:10:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA",
            "n1:12:13 [1] NCCL INFO comm 0x2 rank 1 nRanks 4 nNodes 2 localRanks 2 localRank 1 MNNVL 0",
            "n1:12:13 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/1",
            "n2:20:21 [0] NCCL INFO comm 0x3 rank 2 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0",
            "n2:20:21 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/IB/0/GDRDMA",
        ]
    )
    assert codes(r) == [("warning", "intra-node-slow-path", "n1", 0), ("warning", "no-gdrdma", "n1", 1)]
    assert r.findings[0].message == (
        "n1: intra-node hop 0[0] -> 1[1] uses NET/IB/0/GDRDMA (channels 0), no link "
        "uses P2P; NCCL_P2P_DISABLE=1; NCCL_SHM_DISABLE=1"
    )
    assert "1 -> 2 (send side)" in r.findings[1].message


def test_version_codes() -> None:
    assert [_decode_version(c) for c in (21803, 22703, 2708)] == ["2.18.3", "2.27.3", "2.7.8"]


def test_cli_text_and_exit_codes(tmp_path: Path) -> None:
    ok = run_tool(str(FIX / "ib_2x8"))
    assert ok.returncode == 0, ok.stderr
    assert "gpu-a02: IB [mlx5_0:1/IB mlx5_1:1/IB mlx5_2:1/IB mlx5_3:1/IB] (IB ranks 8-15)" in ok.stdout
    assert "  inter-node NET/IB/GDRDMA: 4 rank pairs\n  intra-node P2P/CUMEM: 28 rank pairs" in ok.stdout
    assert ok.stdout.rstrip().endswith("findings:\n  none\nresult: 0 error(s), 0 warning(s)")

    bad = run_tool(str(FIX / "version_mismatch" / "node-a.log"), str(FIX / "version_mismatch" / "node-b.log"))
    assert bad.returncode == 1
    assert "ERROR version-mismatch: NCCL versions differ across hosts" in bad.stdout
    assert "gpu-c02 rank 2 [0] init.cc:712 Mismatched NCCL version detected" in bad.stdout

    sock = run_tool(str(FIX / "socket_libibverbs.log"))
    assert sock.returncode == 1 and "    reason: Failed to open libibverbs.so[.1]" in sock.stdout
    assert run_tool(str(FIX / "socket_libibverbs.log"), "--allow-socket").returncode == 0

    (tmp_path / "empty").mkdir()
    (tmp_path / "plain.log").write_text("step 10 | loss 7.1\n")
    for args, why in (
        ([str(tmp_path / "missing.log")], "No such file"),
        ([str(tmp_path / "empty")], "no *.out"),
        ([str(tmp_path / "plain.log")], "NCCL_DEBUG=INFO"),
    ):
        res = run_tool(*args)
        assert res.returncode == 2 and why in res.stderr and res.stdout == ""


@pytest.mark.parametrize(
    "name, exit_code", [("shm_vs_p2p.log", 0), ("garbled_interleaved.log", 0), ("version_mismatch", 1)]
)
def test_cli_json(name: str, exit_code: int) -> None:
    res = run_tool(str(FIX / name), "--json")
    assert res.returncode == exit_code, res.stderr
    data = json.loads(res.stdout)
    assert data["exit_code"] == exit_code
    assert data == json.loads(json.dumps({**analyze([FIX / name]).to_dict(), "exit_code": exit_code}))
    assert set(data) == {
        "sources",
        "hosts",
        "versions",
        "networks",
        "communicators",
        "links",
        "env",
        "warnings",
        "findings",
        "stats",
        "exit_code",
    }
