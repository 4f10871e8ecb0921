"""The progress line a user watches: step, loss, lr, throughput and time to go."""

from __future__ import annotations

import datetime
from typing import Any


class Progress:
    """ETA from an exponential average of step times, so the first (warm-up) step does not dominate."""

    def __init__(self, total_steps: int, start_step: int, smoothing: float = 0.1) -> None:
        self.total = total_steps
        self.start = start_step
        self.smoothing = smoothing
        self.avg_step_s: float | None = None

    def update(self, step: int, step_time: float, metrics: dict[str, Any]) -> str:
        if self.avg_step_s is None or step <= self.start + 2:
            self.avg_step_s = step_time
        else:
            self.avg_step_s += self.smoothing * (step_time - self.avg_step_s)
        eta = datetime.timedelta(seconds=round(self.avg_step_s * (self.total - step)))
        return (f"step {step}/{self.total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
                f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | "
                f"{step_time:.3f} s/step | ETA {eta}")
