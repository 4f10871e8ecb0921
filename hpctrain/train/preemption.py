"""Signals in one place: the handler only sets a flag; the loop acts on it at a step boundary, all ranks together.

Slurm sends SIGUSR2 `--signal` seconds before the time limit, and at preemption (with
preempt_send_user_signal); SIGTERM comes before a kill. Saving inside the handler could interrupt a
collective half way and a sharded save needs every rank anyway, so nothing else happens here. submitit's
own handlers are replaced for the duration of training (its checkpoint() runs only on rank 0, where a sharded
save cannot happen) and restored afterwards. Requeueing goes through the scheduler seam (hpctrain/scheduler/).
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from hpctrain.scheduler import scheduler_for

REASONS = {signal.SIGUSR2: "time limit or preemption (SIGUSR2)", signal.SIGTERM: "terminated (SIGTERM)"}


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopFlag":
        for signum in REASONS:
            self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def control_values(self) -> list[float]:
        """[received SIGUSR2, received SIGTERM] on this rank, for the step's one all-reduce (summed: how many
        ranks received each)."""
        return [float(self.signum == signal.SIGUSR2), float(self.signum == signal.SIGTERM)]

    @staticmethod
    def agreed(counts: list[float]) -> int | None:
        """The signal any rank received (USR2 wins over TERM), from the summed `control_values`; None if none."""
        usr2, term = counts
        return signal.SIGUSR2 if usr2 else signal.SIGTERM if term else None


def agree_any(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (once, at a stop: not a per-step collective).

    The tensor lives on the engine's device, so the default group's device backend carries it (NCCL on GPUs)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def wait_to_be_ended(limit_s: float = 600.0) -> None:
    """Sleep until the scheduler's requeue ends this task (SIGTERM is only flagged here; SIGKILL follows)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(1.0)


def requeue_own_job() -> bool:
    """Put the job this task runs in back in its queue (it restarts from the same pickle and run directory);
    False where the scheduler has none (the local executor) or the requeue failed."""
    return scheduler_for().requeue_self()


