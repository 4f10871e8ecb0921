"""Hang detection: a watchdog thread per task that ends a job whose steps stopped, instead of burning it.

The loop calls `beat()` after every step. When no step completes within the limit (`health.hang_timeout_s`,
or `health.hang_factor` x the median of recent step times if that is longer; `health.startup_timeout_s`
before the first step), the watchdog dumps the Python stacks of all threads (faulthandler) and torch's
flight recorder, writes a failure record and exits the process non-zero, so srun fails and the supervisor
resubmits. The limit stays below the collective timeout (`ceiling_s`): NCCL's own watchdog would otherwise
end the process first, and leave no record.

Who is to blame (`decide`): a rank waiting for another one is recorded as a "peer" failure. Under NCCL the
stack cannot tell: collectives are asynchronous, so a rank waiting for a peer blocks in `.item()` or a CUDA
sync with no torch.distributed frame on its stack. The flight recorder can: a collective of this rank that
is enqueued but not finished ("scheduled"/"started", not retired) means some peer has not joined it yet; a
rank with nothing in flight while its step is overdue is stuck itself. Under gloo collectives block the
caller, so the main thread's stack still counts there (as it does when the recorder is off).

A stop signal (SIGTERM, SIGUSR2) shortens the limit: the loop acts on it at the next step boundary, so the step
in progress must end within a few step times (`stop_signalled`). One that does not is waiting for peers that are
gone: torch's elastic agent sends SIGTERM to every worker when it restarts the group, and a worker blocked in a
collective that will never finish would otherwise hold the restart up until the agent's SIGKILL, 30 s later.

A rank whose main thread is already failing (a peer went away, an error of its own) writes its own record:
the loop calls `stand_down()` first, so the watchdog cannot fire half-way and call a failing rank hung.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import pickle
import re
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.records.failures import record_failure
from hpctrain.records.paths import RunPaths

log = logging.getLogger(__name__)

EXIT_HANG = 3
# After a stop signal the step in progress must end within this many typical steps (at least the minimum).
STOP_GRACE_STEPS = 3
STOP_GRACE_MIN_S = 3.0
FLIGHT_RECORDER_WAIT_S = 30.0  # a dump that queries a wedged GPU's events must not stop the record
RECORDERS = {"nccl": "_dump_nccl_trace", "gloo": "_dump_fr_trace"}  # backend -> torch's dump function
# hangs/<job>/nccl_trace_rank_<r> (and gloo_...): `python -m torch.distributed.flight_recorder.fr_trace
# hangs/<job> -p nccl_trace_rank_` matches the collectives of all ranks.
TRACE_SUFFIX = "_trace_rank_"
PENDING = ("scheduled", "started")
# Blocking calls on the main stack that mean "waiting for other ranks": every gloo collective and DDP's
# reducer block the caller; under NCCL only c10d's host-side waits do (store barriers, object collectives).
BLOCKING_FRAMES = ("torch/distributed", "torch/nn/parallel", "torch/autograd")
NCCL_BLOCKING_FRAMES = ("torch/distributed/distributed_c10d.py",)


class Hang(RuntimeError):
    pass


@dataclass(frozen=True)
class Verdict:
    peer: bool  # waiting for another rank: that rank is the one to blame
    reason: str


def pending_collectives(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """This rank's collectives that were enqueued and have not finished. gloo leaves finished entries in
    state "scheduled" but retired; NCCL marks them "completed"."""
    return [e for e in trace.get("entries") or [] if e.get("state") in PENDING and not e.get("retired")]


def recorder_on(trace: dict[str, Any] | None) -> bool:
    """The recorder saw collectives (with TORCH_FR_BUFFER_SIZE=0 it has no status and no entries)."""
    return bool(trace and (trace.get("pg_status") or trace.get("entries")))


def _describe(entry: dict[str, Any], now_ns: int) -> str:
    name, desc = (list(entry.get("process_group") or ("?", "?")) + ["?"])[:2]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    age = (now_ns - int(entry.get("time_created_ns") or now_ns)) / 1e9
    return f"{entry.get('profiling_name')} #{seq} of group {name} ({desc}), enqueued {age:.0f} s ago"


def _inner_frames(stack: str) -> list[str]:
    """The files of the frames hpctrain's innermost frame called (all of them without an hpctrain frame).

    What called the training code does not say where it waits: a worker forked by torch's elastic agent has
    torch/distributed/elastic frames at the bottom of every stack, a rank asleep in Python included."""
    files = re.findall(r'File "([^"]+)"', stack)
    ours = [i for i, f in enumerate(files) if "/hpctrain/" in f]
    return files[ours[-1] + 1 :] if ours else files


def decide(trace: dict[str, Any] | None, main_stack: str, backend: str | None, now_ns: int) -> Verdict:
    """Waiting for a peer, or stuck itself, from this rank's flight recorder (parsed `_dump_*_trace` pickle,
    onlyActive or not) and its main thread's stack (rules in the module docstring)."""
    if recorder_on(trace):
        pending = pending_collectives(trace or {})
        if pending:
            oldest = min(pending, key=lambda e: int(e.get("time_created_ns") or 0))
            return Verdict(
                True,
                f"waiting for another rank in {_describe(oldest, now_ns)}; "
                f"{len(pending)} collective(s) in flight (flight recorder)",
            )
    nccl = "nccl" in (backend or "")
    if any(
        b in frame for frame in _inner_frames(main_stack) for b in (NCCL_BLOCKING_FRAMES if nccl else BLOCKING_FRAMES)
    ):
        return Verdict(True, "waiting for another rank in torch.distributed (main thread's stack)")
    source = "flight recorder and main thread's stack" if recorder_on(trace) else "main thread's stack"
    return Verdict(False, f"stuck outside collectives: nothing in flight ({source})")


# A poll this much later than due means the process was stopped (SIGSTOP: `scontrol suspend`), not hung: the
# monotonic clock runs on through a suspension, so without this a suspension longer than the hang limit fired
# the watchdog on every rank the moment the job was resumed.
STOPPED_S = 5.0


class Watchdog:
    def __init__(
        self,
        run_dir: Path,
        job_id: str,
        rank: int,
        timeout_s: float,
        factor: float,
        startup_timeout_s: float,
        poll_s: float = 1.0,
        ceiling_s: float = 0.0,
    ) -> None:
        self.run_dir, self.job_id, self.rank = run_dir, job_id, rank
        self.timeout_s, self.factor, self.startup_timeout_s = timeout_s, factor, startup_timeout_s
        self.poll_s = poll_s
        self.ceiling_s = ceiling_s  # collective timeout - TIMEOUT_MARGIN_S; 0: none
        self.step = 0
        self.last = time.monotonic()
        self.recent: deque[float] = deque(maxlen=50)
        self.boundary_due: float | None = None  # monotonic: a stop signal came, the next step must end by then
        self.leaving = False  # the loop is saving for a stop and leaving (`leave`)
        self._stop = threading.Event()
        self._firing = threading.Lock()  # held from the decision to fire until the process exits
        self._main = threading.main_thread()
        self._device = _current_cuda_device()  # for the flight recorder's reads on a thread of their own
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, step: int, step_time: float) -> None:
        self.step = step
        self.recent.append(step_time)
        self.last = time.monotonic()
        self.boundary_due = None

    def touch(self) -> None:
        """Progress that is not a step (a validation pass): the clock restarts, no step time is recorded."""
        self.last = time.monotonic()

    def stop_signalled(self) -> None:
        """A stop signal came (called from its handler: sets state only). The loop acts on it at the next step
        boundary, all ranks together; a rank that does not reach it within a few step times is waiting for
        peers that are gone (an agent tearing the group down for a restart sends exactly this), and waiting
        out its hang limit would hold up the restart: it fires now."""
        if self.boundary_due is None and not self.leaving:
            typical = statistics.median(self.recent) if self.recent else 0.0
            self.boundary_due = time.monotonic() + max(STOP_GRACE_MIN_S, STOP_GRACE_STEPS * typical)

    def limit(self) -> float:
        if not self.recent:
            limit = self.startup_timeout_s
        else:
            limit = max(self.timeout_s, self.factor * statistics.median(self.recent))
        return min(limit, self.ceiling_s) if self.ceiling_s > 0 else limit

    def leave(self) -> None:
        """The loop took a stop at the step boundary: it saves, then leaves. Signals from here on are the
        scheduler ending the job it requeued (SIGTERM to every task), not a teardown around a rank stuck in a
        collective: only the hang limit still applies, to the save. Without this, a requeue's SIGTERM fired
        the watchdog during the save or the wait to be ended, and its Hang records named healthy nodes."""
        self.leaving = True
        self.boundary_due = None
        self.touch()

    def stop(self) -> None:
        self._stop.set()

    def _why(self) -> str:
        if self.boundary_due is not None and time.monotonic() > self.boundary_due:
            return "a stop signal came and the step did not end"
        return f"limit {self.limit():.0f} s"

    def stand_down(self) -> None:
        """The main thread is failing on its own: from here its record, not a hang's, says what happened.
        Blocks (until the process exits) when the watchdog has already fired."""
        with self._firing:
            self._stop.set()

    def _watch(self) -> None:
        polled = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            stopped, polled = now - polled - self.poll_s, now
            if stopped > STOPPED_S:  # this process itself was stopped (a Slurm suspension): no one's hang
                self.last += stopped
                if self.boundary_due is not None:
                    self.boundary_due += stopped
                log.warning(
                    "rank %d: this process was stopped for %.0f s (suspended?): the hang limit starts again",
                    self.rank,
                    stopped,
                )
                continue
            due = self.boundary_due
            if now - self.last > self.limit() or (due is not None and now > due):
                self._fire(now - self.last)

    def _fire(self, waited: float) -> None:
        with self._firing:
            if not self._stop.is_set():
                self._dump_record_and_exit(waited)

    def _dump_record_and_exit(self, waited: float) -> None:
        directory = RunPaths(self.run_dir).hangs(self.job_id)
        directory.mkdir(parents=True, exist_ok=True)
        dump = directory / f"rank{self.rank}.txt"
        with open(dump, "w") as f:
            f.write(f"rank {self.rank}: no step completed for {waited:.0f} s after step {self.step} ({self._why()})\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        main = self._main.ident
        assert main is not None  # the main thread has started
        main_stack = "".join(traceback.format_stack(sys._current_frames()[main]))
        backend = _backend()
        active = _bounded(lambda: _active_trace(backend), self._device)
        verdict = decide(active, main_stack, backend, time.time_ns())
        with open(dump, "a") as f:
            f.write(f"\nverdict: {verdict.reason}\n")
        exc = Hang(
            f"no step completed in {waited:.0f} s after step {self.step} ({self._why()}); "
            f"{verdict.reason}; stacks in {dump}"
        )
        record_failure(self.run_dir, self.job_id, self.rank, self.step + 1, exc, peer=verdict.peer)
        log.error("%s", exc)
        _save_full_traces(directory, self.rank, backend, self._device)
        logging.shutdown()
        os._exit(EXIT_HANG)


def _backend() -> str | None:
    """The default group's backend: "nccl", "gloo", or both ("cpu:gloo,cuda:nccl")."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend()) if dist.is_initialized() else None
    except Exception:  # a diagnostic must never be the reason the dump fails
        return None


def _flight_recorder(kind: str, full: bool) -> bytes | None:
    """One of this process's flight recorders as torch pickles it: NCCL's (a CUDA build) or the generic one
    that gloo records into. `full`: every entry with its stack, for post-mortems; else only the collectives
    not yet completed, without stacks (cheap)."""
    import torch

    dump = getattr(torch._C._distributed_c10d, RECORDERS[kind], None)
    if dump is None:
        return None
    if full:
        return dump()
    return dump(includeCollectives=True, includeStackTraces=False, onlyActive=True)


def _kinds(backend: str | None) -> list[str]:
    return [kind for kind in RECORDERS if kind in (backend or "")]


def merge_traces(traces: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One trace from the NCCL and the gloo recorder of a "cpu:gloo,cuda:nccl" group."""
    if not traces:
        return None
    status = {f"{i}/{k}": v for i, t in enumerate(traces) for k, v in (t.get("pg_status") or {}).items()}
    return {"entries": [e for t in traces for e in t.get("entries") or []], "pg_status": status}


def _active_trace(backend: str | None) -> dict[str, Any] | None:
    raws = [_flight_recorder(kind, full=False) for kind in _kinds(backend)]
    return merge_traces([pickle.loads(raw) for raw in raws if raw])  # torch's own pickles of this process


def _save_full_traces(directory: Path, rank: int, backend: str | None, device: int | None) -> None:
    for kind in _kinds(backend):
        full = _bounded(functools.partial(_flight_recorder, kind, full=True), device)
        if full:
            (directory / f"{kind}{TRACE_SUFFIX}{rank}").write_bytes(full)


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, where this process uses CUDA."""
    torch = sys.modules.get("torch")
    return torch.cuda.current_device() if torch is not None and torch.cuda.is_initialized() else None


def _bounded(fn: Callable[[], Any], device: int | None = None, timeout_s: float = FLIGHT_RECORDER_WAIT_S) -> Any:
    """fn() on a helper thread, or None when it fails or does not return in time. The thread works on this
    rank's GPU: a new thread starts on GPU 0, where reading NCCL's CUDA events would create a context (or
    wait on GPU 0 when that is the hung one)."""
    box: list[Any] = []

    def run() -> None:
        try:
            if device is not None:
                sys.modules["torch"].cuda.set_device(device)
            box.append(fn())
        except Exception as err:  # a diagnostic must never be the reason the dump fails
            log.warning("could not read the flight recorder: %s", err)

    helper = threading.Thread(target=run, name="hpctrain-flight-recorder", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        log.warning("the flight recorder did not answer within %.0f s", timeout_s)
    return box[0] if box else None
