"""Learning-rate schedule as a pure function of the step.

No scheduler object means no scheduler state to checkpoint: the step alone restores the exact lr.
"""

from __future__ import annotations

import math
from typing import Any


def lr_at(step: int, optim: Any, max_steps: int) -> float:
    """Linear warmup to optim.lr, then cosine/linear decay to lr x min_lr_ratio at max_steps (step counts from 0)."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.decay == "constant":
        return optim.lr
    span = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    if optim.decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    min_lr = optim.lr * optim.min_lr_ratio
    return min_lr + (optim.lr - min_lr) * factor
