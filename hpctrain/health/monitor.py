"""In-run detection at negligible cost: stragglers and memory leaks.

Stragglers: in a synchronous job every rank's step takes as long as the slowest rank's, so step times alone
cannot say who is slow. Every `health.straggler_every` steps each rank times the same small matmul (a few
ms) before the step; its time and its last step time go in the rank's own two slots of a 2 x world block
that rides on the step's one all-reduce (`control_values`), so every rank gets every rank's probe at no
collective of its own. A rank whose probe is a robust outlier (median and MAD) and at least
`health.straggler_factor` x the median for `health.straggler_patience` probes in a row is reported with its
host, in the log, the metrics and the events.

Memory leaks (the design article's 5.2.2): the process's memory (CUDA allocated bytes on GPU, RSS on CPU)
is sampled every step; over each window of `health.memory_window` steps a least-squares slope that would
grow memory by more than `health.leak_mb` per window is reported.
"""

from __future__ import annotations

import logging
import resource
import socket
from collections import deque
from typing import Any

import torch

from hpctrain.config.schema import HealthConfig
from hpctrain.health.outliers import robust_outliers
from hpctrain.health.preflight import matmul_seconds

log = logging.getLogger(__name__)


def memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return float(f.read().split()[1]) * resource.getpagesize()


def slope(values: list[float]) -> float:
    """Least-squares slope per sample."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den if den else 0.0


class RunMonitor:
    def __init__(self, hc: HealthConfig, rank: int, device: torch.device, hosts: list[str] | None = None) -> None:
        self.every, self.factor, self.patience = hc.straggler_every, hc.straggler_factor, hc.straggler_patience
        self.threshold = hc.outlier_threshold
        self.window, self.leak_bytes = hc.memory_window, hc.leak_mb * 2**20
        self.rank, self.device, self.host = rank, device, socket.gethostname()
        self.hosts = hosts or [self.host]  # every rank's host, by rank
        self.last_step_s = 0.0
        self.flags: dict[int, int] = {}
        self.memory: deque[float] = deque(maxlen=max(2, self.window))

    def control_values(self, step: int) -> list[float]:
        """Before step `step`: on probe steps this rank's probe time and last step time in its own slots of
        a 2 x world block (zeros elsewhere: summed over ranks, the block holds every rank's values)."""
        if not (self.every > 0 and step % self.every == 0):
            return []
        values = [0.0] * (2 * len(self.hosts))
        values[2 * self.rank] = matmul_seconds(self.device, repeats=2)
        values[2 * self.rank + 1] = self.last_step_s
        return values

    def after_step(
        self, step: int, step_time: float, probes: list[float] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Metrics and events of this step (rank 0's view; other ranks get empty ones). `probes`: the
        block of `control_values` summed over all ranks, on probe steps."""
        metrics: dict[str, float] = {}
        events: list[dict[str, Any]] = []
        if self.window > 1:
            self.memory.append(memory_bytes(self.device))
            if step % self.window == 0 and len(self.memory) == self.window:
                growth = slope(list(self.memory)) * self.window
                metrics["health/memory_growth_mb_per_window"] = growth / 2**20
                if growth > self.leak_bytes:
                    events.append(
                        {
                            "event": "memory_leak",
                            "rank": self.rank,
                            "host": self.host,
                            "mb_per_window": growth / 2**20,
                            "window": self.window,
                        }
                    )
                    log.warning(
                        "memory grew steadily by %.1f MB over the last %d steps on rank %d (%s): a leak?",
                        growth / 2**20,
                        self.window,
                        self.rank,
                        self.host,
                    )
        self.last_step_s = step_time
        if probes and self.rank == 0:
            gathered = [
                {"rank": r, "host": host, "probe_s": probes[2 * r], "step_s": probes[2 * r + 1]}
                for r, host in enumerate(self.hosts)
            ]
            m, e = self._judge(gathered, step)
            metrics.update(m)
            events += e
        return (metrics, events) if self.rank == 0 else ({}, [e for e in events if e["event"] == "memory_leak"])

    def _judge(self, gathered: list[dict[str, Any]], step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        probes = {g["rank"]: g["probe_s"] for g in gathered}
        median = sorted(probes.values())[len(probes) // 2]
        outliers = (
            robust_outliers(
                {str(r): t for r, t in probes.items()},
                threshold=self.threshold,
                higher_is_worse=True,
                min_rel=self.factor - 1,
            )
            if len(probes) >= 3
            else {}
        )
        slow = {int(r) for r in outliers}
        self.flags = {r: self.flags.get(r, 0) + 1 for r in slow}
        metrics = {"health/probe_max_over_median": max(probes.values()) / median if median else 1.0}
        events = []
        for r, count in self.flags.items():
            if count >= self.patience:
                host = next(g["host"] for g in gathered if g["rank"] == r)
                ratio = probes[r] / median
                events.append({"event": "straggler", "rank": r, "host": host, "slowdown": ratio, "checks": count})
                log.warning(
                    "straggler: rank %d on %s is %.2fx slower than the median rank for %d checks in a row (step %d)",
                    r,
                    host,
                    ratio,
                    count,
                    step,
                )
        return metrics, events
