"""Hang detection: a watchdog thread per task that ends a job whose steps stopped, instead of burning it.

The loop calls `beat()` after every step. When no step completes within the limit (`health.hang_timeout_s`,
or `health.hang_factor` x the median of recent step times if that is longer; `health.startup_timeout_s`
before the first step), the watchdog dumps the Python stacks of all threads (faulthandler) and, on GPUs,
PyTorch's NCCL flight recorder, writes a failure record and exits the process non-zero, so srun fails and
the supervisor resubmits. A rank whose main thread is blocked inside torch.distributed is recorded as a
"peer" failure: it is waiting for another rank, which is the one to blame.

A rank whose main thread is already failing (a peer went away, an error of its own) writes its own record:
the loop calls `stand_down()` first, so the watchdog cannot fire half-way and call a failing rank hung.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from hpctrain.train.failure import record_failure

log = logging.getLogger(__name__)

EXIT_HANG = 3


class Hang(RuntimeError):
    pass


class Watchdog:
    def __init__(self, run_dir: Path, job_id: str, rank: int, timeout_s: float, factor: float,
                 startup_timeout_s: float, poll_s: float = 1.0) -> None:
        self.run_dir, self.job_id, self.rank = run_dir, job_id, rank
        self.timeout_s, self.factor, self.startup_timeout_s = timeout_s, factor, startup_timeout_s
        self.poll_s = poll_s
        self.step = 0
        self.last = time.monotonic()
        self.recent: deque[float] = deque(maxlen=50)
        self._stop = threading.Event()
        self._firing = threading.Lock()  # held from the decision to fire until the process exits
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, step: int, step_time: float) -> None:
        self.step = step
        self.recent.append(step_time)
        self.last = time.monotonic()

    def limit(self) -> float:
        if not self.recent:
            return self.startup_timeout_s
        return max(self.timeout_s, self.factor * statistics.median(self.recent))

    def stop(self) -> None:
        self._stop.set()

    def stand_down(self) -> None:
        """The main thread is failing on its own: from here its record, not a hang's, says what happened.
        Blocks (until the process exits) when the watchdog has already fired."""
        with self._firing:
            self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = time.monotonic() - self.last
            if waited > self.limit():
                self._fire(waited)

    def _fire(self, waited: float) -> None:
        with self._firing:
            if not self._stop.is_set():
                self._dump_record_and_exit(waited)

    def _dump_record_and_exit(self, waited: float) -> None:
        directory = self.run_dir / "hangs" / self.job_id
        directory.mkdir(parents=True, exist_ok=True)
        dump = directory / f"rank{self.rank}.txt"
        with open(dump, "w") as f:
            f.write(f"rank {self.rank}: no step completed for {waited:.0f} s after step {self.step} "
                    f"(limit {self.limit():.0f} s)\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        _dump_flight_recorder(directory, self.rank)
        main_stack = "".join(traceback.format_stack(sys._current_frames()[self._main.ident]))
        # Blocked in a collective or in a backward that waits on one: waiting for another rank.
        in_collective = any(p in main_stack for p in ("torch/distributed", "torch/nn/parallel", "torch/autograd"))
        exc = Hang(f"no step completed in {waited:.0f} s after step {self.step} (limit {self.limit():.0f} s); "
                   + ("waiting in a collective for another rank" if in_collective else "stuck outside collectives")
                   + f"; stacks in {dump}")
        record_failure(self.run_dir, self.job_id, self.rank, self.step + 1, exc, peer=in_collective)
        log.error("%s", exc)
        logging.shutdown()
        os._exit(EXIT_HANG)


def _dump_flight_recorder(directory: Path, rank: int) -> None:
    """PyTorch's NCCL flight recorder (the last collectives of each process group), when NCCL is in use."""
    try:
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
            return
        dump = torch._C._distributed_c10d._dump_nccl_trace()
        (directory / f"rank{rank}.nccl_trace.pkl").write_bytes(dump)
    except Exception as err:  # a diagnostic must never be the reason the dump fails
        log.warning("could not dump the NCCL flight recorder: %s", err)
