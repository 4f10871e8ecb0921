"""Node health pre-flight: every job start checks its nodes before training, cheaply.

1. One task per node reports what the node says about itself (GPUs, ECC, NVLink, InfiniBand, versions;
   `node.py`); "not present" passes on a machine without GPUs or IB.
2. Rank 0 compares the nodes (versions and firmware must agree; the odd node is named).
3. Every rank times the same matmul (on its GPU, or one CPU thread), all ranks at once, and the job times an
   all-reduce; a node whose matmul is an outlier by median and MAD (`outliers.py`) is named: uneven clocks
   from rack power or a sick GPU slow the whole synchronous job. A node is named only when a second round,
   timed again by every rank, finds it slow again: a hiccup (a daemon waking up, a page fault storm) costs a
   healthy node nothing, a sick GPU is slow every time.
4. Policy (`health.preflight`): `warn` logs; `exclude` stops the job with a failure record blaming those
   nodes, so the supervisor resubmits without them; `drain` also drains them (`scontrol update ...
   state=drain`, needs the rights); `off` skips all of it.
The report goes to `<run dir>/health/<job id>/preflight.json`.

`HPCTRAIN_TEST_SLOW_HOST=<hostname>` multiplies that host's benchmark time by 10: a configured artificial delay
for the tests, which cannot slow a real GPU.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpctrain.health.node import inconsistencies, node_report
from hpctrain.health.outliers import robust_outliers
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for

if TYPE_CHECKING:
    from hpctrain.config.schema import Config, HealthConfig

log = logging.getLogger(__name__)

SLOW_HOST_VARIABLE = "HPCTRAIN_TEST_SLOW_HOST"
ALLREDUCE_ROUNDS = 3


class UnhealthyNodes(RuntimeError):
    def __init__(self, hosts: list[str], reasons: dict[str, list[str]]) -> None:
        self.hosts = hosts
        detail = "; ".join(f"{h}: {', '.join(r)}" for h, r in reasons.items())
        super().__init__(f"pre-flight found unhealthy node(s) {', '.join(hosts)}: {detail}")


@dataclass(frozen=True)
class Preflight:
    bad: dict[str, list[str]]
    path: Path | None


def matmul_seconds(device: torch.device, repeats: int = 5) -> float:
    """Fastest of `repeats` timings of a fixed matmul workload: large on GPUs (bf16, wall clock), small on one
    CPU thread (fp32, that thread's CPU time). The fastest, not the median: contention only ever adds time, a
    slow clock slows every repeat. On CPU, ranks may share cores (more ranks than cores, other jobs): wall
    time would measure the wait for a core (3 ranks on 2 cores: up to 3x between healthy nodes), a thread's
    CPU time measures the core itself."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (384, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    clock = time.perf_counter if cuda else time.thread_time
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # the matmul then runs in this thread: its CPU time is all of it
    times = []
    try:
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(device)
            started = clock()
            for _ in range(4):
                a @ b
            if cuda:
                torch.cuda.synchronize(device)
            times.append(clock() - started)
    finally:
        torch.set_num_threads(threads)
    seconds = min(times[1:])
    if os.environ.get(SLOW_HOST_VARIABLE) == socket.gethostname():
        time.sleep(9 * seconds)
        seconds *= 10
    return seconds


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits until the device has run everything queued: CUDA collectives return before they finish."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def allreduce_busbw(
    device: torch.device,
    megabytes: int,
    group: Any = None,
    synchronize: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float | None:
    """Bus bandwidth of an all-reduce over `group` (default: the whole job), bytes/s as nccl-tests defines it.

    The clock starts only once the warm-up all-reduce has finished on the device (it sets up NCCL's channels
    and may still be running when the call returns), and stops once the timed ones have."""
    if not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    if n == 1:
        return None
    sync = synchronize or device_synchronizer(device)
    t = torch.ones(megabytes * 2**20 // 4, device=device)
    dist.all_reduce(t, group=group)
    sync()
    started = clock()
    for _ in range(ALLREDUCE_ROUNDS):
        dist.all_reduce(t, group=group)
    sync()
    seconds = (clock() - started) / ALLREDUCE_ROUNDS
    return 2 * (n - 1) / n * t.numel() * t.element_size() / seconds


def use_device(device: torch.device, cuda: Any = torch.cuda) -> None:
    """Make `device` the current CUDA device. all_gather_object under NCCL puts its tensors on
    torch.cuda.current_device(): left at GPU 0, every rank of a node would gather on GPU 0."""
    if device.type == "cuda" and device.index is not None and cuda.current_device() != device.index:
        cuda.set_device(device)


def run_preflight(
    cfg: Config, rank: int, local_rank: int, job_id: str, run_dir: Path, device: torch.device
) -> Preflight:
    hc = cfg.health
    if hc.preflight == "off":
        return Preflight({}, None)
    started = time.perf_counter()
    use_device(device)
    host = socket.gethostname()
    expected = cfg.cluster.gpus_per_node if device.type == "cuda" else 0
    report = node_report(expected, None) if local_rank == 0 else None
    everyone = _gather({"host": host, "rank": rank, "report": report, "matmul_s": _timed_together(device)})
    busbw = allreduce_busbw(device, hc.allreduce_mb)
    bad: dict[str, list[str]] = {}
    summary: dict[str, Any] = {}
    if rank == 0:
        bad, summary = _judge(everyone, hc)
    if _broadcast(summary.get("slow", {}), device):  # confirm: everyone times again, slow twice to count
        again = _gather({"host": host, "matmul_s": _timed_together(device)})
        if rank == 0:
            bad, summary = _judge(everyone, hc, again)
    path = None
    if rank == 0:
        summary.update(busbw_bytes_per_s=busbw, seconds=time.perf_counter() - started, policy=hc.preflight)
        path = RunPaths(run_dir).preflight(job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1, default=str))
    bad = _broadcast(bad, device)
    if bad:
        for h, reasons in bad.items():
            log.warning("pre-flight: node %s: %s", h, "; ".join(reasons))
        if hc.preflight == "drain" and rank == 0:
            reason = "; ".join(f"{h}: {r[0]}" for h, r in bad.items())
            scheduler_for().drain(sorted(bad), f"hpctrain pre-flight: {reason[:200]}")
        if hc.preflight in ("exclude", "drain"):
            raise UnhealthyNodes(sorted(bad), bad)
    else:
        log.info(
            "pre-flight: %d node(s) healthy in %.1f s",
            len({e["host"] for e in everyone}),
            time.perf_counter() - started,
        )
    return Preflight(bad, path)


def _timed_together(device: torch.device) -> float:
    """The matmul timing, started by every rank at once so that no rank times while others still set up."""
    if dist.is_initialized():
        # NCCL's barrier is an all-reduce: on this rank's GPU, not one guessed from the global rank.
        ids = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else None
        dist.barrier(group=dist.group.WORLD, device_ids=ids)
    return matmul_seconds(device)


def _gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's value, over the whole job (on the current device under NCCL: see use_device)."""
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=dist.group.WORLD)
    return everyone


def _broadcast(value: Any, device: torch.device) -> Any:
    """Rank 0's value on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=dist.group.WORLD, device=device)
    return box[0]


def _slowest_per_host(timings: list[dict[str, Any]]) -> dict[str, float]:
    """A node is as slow as its slowest GPU: one sick GPU holds back the whole synchronous job."""
    per_host: dict[str, float] = {}
    for e in timings:
        per_host[e["host"]] = max(per_host.get(e["host"], 0.0), e["matmul_s"])
    return per_host


def _judge(
    everyone: list[dict[str, Any]], hc: HealthConfig, again: list[dict[str, Any]] | None = None
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """The bad nodes and the report. With `again` (the confirming round), a node is slow only when it is an
    outlier in both rounds; its reason gives both timings."""
    hosts = sorted({e["host"] for e in everyone})
    reports = {e["host"]: e["report"] for e in everyone if e["report"] is not None}
    bad: dict[str, list[str]] = {}
    for h, report in reports.items():
        for problem in report.get("problems", []):
            bad.setdefault(h, []).append(problem)
    found = inconsistencies(reports) if len(reports) > 1 else []
    for message, odd in found:
        for h in odd:
            bad.setdefault(h, []).append(message)
    consistency = [message for message, _ in found]
    rounds = [_slowest_per_host(everyone)] + ([_slowest_per_host(again)] if again is not None else [])
    flagged = [
        robust_outliers(r, threshold=hc.outlier_threshold, higher_is_worse=True, min_rel=hc.min_slowdown)
        if len(hosts) >= 3
        else {}
        for r in rounds
    ]
    slow = {h: min(f[h] for f in flagged) for h in flagged[0] if all(h in f for f in flagged)}
    for h, score in slow.items():
        timings = " then ".join(
            f"{r[h] * 1e3:.1f} ms vs median {statistics.median(r.values()) * 1e3:.1f} ms" for r in rounds
        )
        bad.setdefault(h, []).append(f"matmul {timings} (robust z {score:.1f})")
    summary = {
        "hosts": {h: {"report": reports.get(h), "matmul_s": [r[h] for r in rounds]} for h in hosts},
        "consistency": consistency,
        "slow": slow,
        "suspects": sorted(flagged[0]),
        "bad": bad,
    }
    return bad, summary
