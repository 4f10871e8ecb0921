"""Signals in one place: the handler only sets a flag; the loop acts on it at a step boundary, all ranks together.

Slurm sends SIGUSR2 `--signal` seconds before the time limit, and at preemption (with
preempt_send_user_signal); SIGTERM comes before a kill. Saving inside the handler could interrupt a
collective half way and a sharded save needs every rank anyway, so nothing else happens here (the watchdog is
told too, from a thread, so that a rank that cannot reach the boundary leaves: see StopFlag). submitit's
own handlers are replaced for the duration of training (its checkpoint() runs only on rank 0, where a sharded
save cannot happen) and restored afterwards. Requeueing goes through the scheduler seam (hpctrain/scheduler/).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import torch
import torch.distributed as dist

from hpctrain.scheduler import scheduler_for

# What each signal says of its cause, and no more: Slurm sends SIGUSR2 before the time limit and at preemption,
# but `scancel --signal=USR2` by a user arrives the same, and a task cannot tell them apart.
REASONS: dict[int, str] = {
    signal.SIGUSR2: "time limit, preemption or a user's signal (SIGUSR2)",
    signal.SIGTERM: "terminated (SIGTERM)",
}


class StopFlag:
    """`on_signal(signum)` is told of each stop signal as it arrives, on a thread of its own: a Python handler
    runs only once the main thread is back in the interpreter, and a rank blocked in a collective whose peers
    are gone never is (an agent tearing the group down for a restart sends it exactly then). The watchdog, told
    so, gives the step a few step times to end."""

    def __init__(self, on_signal: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        self.on_signal = on_signal
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (our pipe's write end, the wakeup fd it replaced)

    def install(self) -> StopFlag:
        for signum in REASONS:
            self._previous[signum] = signal.signal(signum, self._handler)
            # The handler only sets a flag: system calls it lands in (gloo's, in any thread) resume instead
            # of failing with EINTR.
            signal.siginterrupt(signum, False)
        if self.on_signal is not None:  # the C-level handler writes each signal's number to this pipe at once
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (write, signal.set_wakeup_fd(write))
            threading.Thread(target=self._relay, args=(read,), name="hpctrain-signals", daemon=True).start()
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._wakeup is not None:
            write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the relay reads the end of the pipe and leaves
            self._wakeup = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def _relay(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while signums := pipe.read(64):
                for signum in signums:
                    if signum in REASONS and self.on_signal is not None:
                        self.on_signal(signum)

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
