"""Run a function on N gloo ranks, forked from the test process: no torchrun, no ports, no re-import of torch.

Each torchrun launch costs 8-24 s on 2 cores (every process imports torch); forking the already-imported
pytest process costs ~0.2 s for 8 ranks. Ranks meet through a `dist.FileStore` in a fresh temporary
directory, run `fn(rank, world_size, *args)` and send back its (picklable) result or their traceback.

With HPCTRAIN_GPU_RULES=1 (the `gpu_rules` fixture) each rank runs under tests/gpu_rules.py: what would fail
on GPUs with NCCL fails here, naming the rule.

Usage from any test:

    from tests.distributed_harness import run_distributed
    results = run_distributed(my_fn, 4, arg1, arg2, timeout=120)   # one result per rank

`fn` must be a module-level function (it is called in the child after fork, so closures work too, but
results must pickle). Children exit with os._exit after destroying the process group: force-killing
finished children was seen to break the next launch's connectFullMesh, so they are only killed (by pid,
our own children only) when the timeout expires.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests import gpu_rules


class DistributedTestError(RuntimeError):
    """A rank raised, died or timed out; the message carries the child's traceback (and the ranks' stderr)."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed  # a rank crashed in native code (SIGABRT, SIGSEGV, SIGBUS), not by a Python error


class CrashedRankRetried(UserWarning):
    """A rank crashed in native code and the run was repeated once: the first run's logs, for the CI log."""


# Native crashes, retried once. Not SIGKILL: tests kill ranks on purpose with it (a node dying mid-save), and so
# does the kernel's OOM killer.
CRASHES = {-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS}


def _init_process_group(store_path: str, rank: int, world_size: int, attempt: int, backend: str) -> None:
    store = dist.FileStore(store_path, world_size)
    prefixed = dist.PrefixStore(f"attempt_{attempt}/", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_dir: str,
    results: Any,
    args: tuple[Any, ...],
    backend: str,
) -> None:
    # The rank's stderr goes to a file the parent reads back: a rank killed by a signal (a C++ abort in gloo)
    # leaves its last words there and, through faulthandler, every thread's Python stack.
    log = open(_log_path(store_dir, rank), "w")
    os.dup2(log.fileno(), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # not pytest's capture, which the parent owns
    faulthandler.enable(file=2, all_threads=True)
    torch.set_num_threads(1)
    if os.environ.get(gpu_rules.ENV) == "1":
        gpu_rules.install()
        gpu_rules.launched_by_test()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    code = 0
    try:
        for attempt in range(2):  # a rare connectFullMesh failure on a busy machine: retry once
            try:
                _init_process_group(os.path.join(store_dir, f"store{attempt}"), rank, world_size, attempt, backend)
                break
            except Exception:
                if attempt == 1:
                    raise
                time.sleep(0.5)
        # Pickled here, by value: the queue's own pickler would share tensors through file descriptors that
        # vanish when this process exits.
        payload = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        payload = (rank, False, pickle.dumps(traceback.format_exc()))
        code = 1
    try:
        results.put(payload)
        results.close()
        results.join_thread()  # flush before os._exit, which skips the queue's atexit flush
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size forked gloo ranks; return the results by rank.

    `backend` is the default group's backend string: "cuda:gloo" makes a group that, like NCCL's, has no
    backend for CPU tensors; "cpu:gloo,cuda:gloo" is the GPU path's "cpu:gloo,cuda:nccl" on this machine.

    Raises DistributedTestError with the first failing rank's traceback, or on timeout (after killing
    the children still alive). A rank that crashes in native code (`CRASHES`: a SIGABRT from a C++ abort in gloo
    was seen once in a CI run of the CP layouts, and not in 79 repeats of that test here) repeats the run once,
    with a CrashedRankRetried warning carrying the first run's stderr and stacks; a second crash, a rank killed
    (SIGKILL), a Python error or a timeout fails at once.
    """
    try:
        return _run_once(fn, world_size, args, timeout, backend)
    except DistributedTestError as err:
        if not err.crashed:
            raise
        warnings.warn(
            CrashedRankRetried(f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks: {err}"), stacklevel=2
        )
    return _run_once(fn, world_size, args, timeout, backend)


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, backend: str
) -> list[Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hpctrain-dist-") as store_dir:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, store_dir, results, args, backend), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, tuple[bool, Any]] = {}
        try:
            _collect(procs, results, collected, time.monotonic() + timeout, timeout, store_dir)
            for p in procs:
                p.join(timeout=30)
            sys.stderr.write(_logs(store_dir, world_size))  # what the ranks logged, for pytest's capture
            return [collected[r][1] for r in range(world_size)]
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=2)
                if p.is_alive() and p.pid is not None:
                    p.kill()
                    p.join(timeout=5)
            results.close()


def _collect(
    procs: list[Any],
    results: Any,
    collected: dict[int, tuple[bool, Any]],
    deadline: float,
    timeout: float,
    store_dir: str,
) -> None:
    """Wait for every rank's result; raise on a failure, a death or the deadline, with the ranks' logs."""
    world_size = len(procs)
    while len(collected) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTestError(
                f"timed out after {timeout:.0f} s; ranks that reported: "
                f"{sorted(collected)}" + _failures(collected) + _logs(store_dir, world_size)
            )
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            collected[rank] = (ok, pickle.loads(value))
            if not ok:  # one rank failed: the others may wait for it forever, give them a moment
                deadline = min(deadline, time.monotonic() + 10.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in collected]
            if dead:
                time.sleep(0.5)  # the survivors' errors, if any, are on their way
                codes = [procs[i].exitcode for i in dead]
                raise DistributedTestError(
                    f"rank(s) {dead} died with exit codes {codes}"
                    + _failures(collected)
                    + _logs(store_dir, world_size),
                    crashed=any(c in CRASHES for c in codes),
                ) from None
    failed = _failures(collected)
    if failed:
        raise DistributedTestError(failed + _logs(store_dir, world_size))


def _log_path(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"rank{rank}.stderr")


def _logs(store_dir: str, world_size: int, head: int = 4000, tail: int = 12000) -> str:
    """Each rank's stderr (its first `head` and last `tail` characters: the last words before a signal come ahead
    of faulthandler's stacks and module list), for an error message or the test's captured output."""
    out = []
    for r in range(world_size):
        try:
            with open(_log_path(store_dir, r), errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            continue
        if len(text) > head + tail:
            text = f"{text[:head]}\n[... {len(text) - head - tail} characters ...]\n{text[-tail:]}"
        if text.strip():
            out.append(f"\n--- rank {r} stderr ---\n{text}")
    return "".join(out)


def _failures(collected: dict[int, tuple[bool, Any]]) -> str:
    return "".join(f"\n--- rank {r} ---\n{v}" for r, (ok, v) in sorted(collected.items()) if not ok)
