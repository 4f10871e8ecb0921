"""The pre-flight's verdict on node timings: a node is named only when it is slow in two rounds, and the
report keeps both timings; its collectives (the all-reduce timing waits for the device, object collectives on
the rank's own GPU), and one real two-rank gloo run. Multi-node runs are in tests/slurm/test_health_on_slurm.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from hpctrain.config.schema import HealthConfig
from hpctrain.health import preflight
from hpctrain.health.preflight import _judge


def timings(**per_host: float) -> list[dict]:
    """Two ranks per host, the second 1% slower (a node is as slow as its slowest GPU)."""
    return [
        {"host": h, "rank": 2 * i + j, "report": None, "matmul_s": t * (1 + 0.01 * j)}
        for i, (h, t) in enumerate(per_host.items())
        for j in range(2)
    ]


def test_a_node_slow_in_both_rounds_is_named_with_both_timings() -> None:
    bad, summary = _judge(
        timings(n1=0.005, n2=0.050, n3=0.0051, n4=0.0049),
        HealthConfig(),
        timings(n1=0.0050, n2=0.049, n3=0.0050, n4=0.0052),
    )
    assert set(bad) == {"n2"} and summary["suspects"] == ["n2"]
    assert "50.5 ms" in bad["n2"][0] and "then 49.5 ms" in bad["n2"][0]
    assert summary["hosts"]["n2"]["matmul_s"] == [0.0505, 0.049 * 1.01]


def test_a_node_slow_only_once_is_a_hiccup_not_a_bad_node() -> None:
    bad, summary = _judge(
        timings(n1=0.0073, n3=0.0032, n4=0.0033), HealthConfig(), timings(n1=0.0034, n3=0.0033, n4=0.0032)
    )
    assert bad == {} and summary["slow"] == {} and summary["suspects"] == ["n1"]


def test_a_small_spread_on_identical_nodes_names_nobody() -> None:
    bad, summary = _judge(timings(n1=0.0050, n2=0.0052, n3=0.0051, n4=0.0055), HealthConfig())
    assert bad == {} and summary["suspects"] == []


def test_two_nodes_are_not_compared() -> None:
    bad, _ = _judge(timings(n1=0.005, n2=0.5), HealthConfig(), timings(n1=0.005, n2=0.5))
    assert bad == {}


class Recorder:
    """Records the order of all-reduces, device syncs and clock reads (the CUDA sync cannot run here)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.groups: list[object] = []
        self.now = 0.0

    def all_reduce(self, t: torch.Tensor, group: object = None) -> None:
        self.calls.append("all_reduce")
        self.tensors.append(t)
        self.groups.append(group)

    def sync(self) -> None:
        self.calls.append("sync")

    def clock(self) -> float:
        self.calls.append("clock")
        self.now += 0.5
        return self.now


def test_a_cpu_node_is_timed_on_one_thread_and_the_rank_keeps_its_threads(monkeypatch) -> None:
    """Ranks sharing cores would time the wait for a core: the CPU timing is one thread's CPU time, and the
    rank's thread count is back as it was afterwards (the straggler probe runs it mid-training)."""
    seen = []
    clock = preflight.time.thread_time
    monkeypatch.setattr(preflight.time, "thread_time", lambda: seen.append(torch.get_num_threads()) or clock())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert preflight.matmul_seconds(torch.device("cpu"), repeats=2) > 0
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_bandwidth_clock_starts_after_the_warmup_finished_on_the_device(monkeypatch) -> None:
    rec, group = Recorder(), object()
    monkeypatch.setattr(preflight.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(preflight.dist, "get_world_size", lambda g=None: 4 if g is group else 1)
    monkeypatch.setattr(preflight.dist, "all_reduce", rec.all_reduce)
    device = torch.device("cpu")
    busbw = preflight.allreduce_busbw(device, 1, group=group, synchronize=rec.sync, clock=rec.clock)
    assert rec.calls == ["all_reduce", "sync", "clock", "all_reduce", "all_reduce", "all_reduce", "sync", "clock"]
    assert all(t.device == device for t in rec.tensors) and rec.groups == [group] * 4
    assert busbw == 2 * 3 / 4 * 2**20 / (0.5 / 3)


def test_cuda_work_is_waited_for_on_the_rank_s_own_gpu(monkeypatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    preflight.device_synchronizer(torch.device("cuda", 3))()
    preflight.device_synchronizer(torch.device("cpu"))()
    assert synced == [torch.device("cuda", 3)]


def test_object_collectives_run_on_the_rank_s_own_gpu() -> None:
    class FakeCuda:
        def __init__(self) -> None:
            self.current, self.set = 0, []

        def current_device(self) -> int:
            return self.current

        def set_device(self, device: torch.device) -> None:
            self.set.append(device)

    cuda = FakeCuda()
    preflight.use_device(torch.device("cuda", 5), cuda)
    preflight.use_device(torch.device("cpu"), cuda)
    assert cuda.set == [torch.device("cuda", 5)]


TWO_RANKS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from omegaconf import OmegaConf
    from hpctrain.config.schema import Config
    from hpctrain.health.preflight import run_preflight
    rank, port, run_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"health": {"allreduce_mb": 1}})
    result = run_preflight(cfg, rank, rank, "job1", run_dir, torch.device("cpu"))
    print(json.dumps({"bad": result.bad, "path": str(result.path)}))
    dist.destroy_process_group()
""")


def test_the_preflight_runs_on_two_real_gloo_ranks(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(r), port, str(tmp_path)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    report = json.loads((tmp_path / "health" / "job1" / "preflight.json").read_text())
    assert report["busbw_bytes_per_s"] > 0 and report["bad"] == {}
