"""One check in a forked process of its own, under a time limit: a crash, a hang or a CUDA error in it becomes
a FAIL row with the first line of its error, never a missing table."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import CheckFailed, Ctx, Outcome, destroy_world, first_line, read_json, write_json

EXIT_HANG = 3  # hpctrain.health.watchdog.EXIT_HANG: the watchdog saw no step completing


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    fn: Callable[[Ctx], Outcome]
    timeout_gpu_s: float
    timeout_cpu_s: float
    # False: the check forks processes that use the GPU, so it must not initialise CUDA itself (a forked
    # child cannot use CUDA after its parent did); its ranks find the device.
    uses_cuda: bool = True
    cpu_title: str = ""  # the title with --cpu, where it differs
    quick: bool = False  # the first block: what a user runs; `--quick` runs these alone

    def title_for(self, cpu: bool) -> str:
        return self.cpu_title if cpu and self.cpu_title else self.title


def fork_call(fn: Callable[[], None], log_path: Path, new_group: bool = True) -> int:
    """fn() in a forked child whose stdout and stderr go to log_path; the child's pid (its own process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            if new_group:
                os.setpgid(0, 0)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            # Python's streams onto the log too, whatever they were (pytest's capture, for one).
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            fn()
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    if new_group:
        try:
            os.setpgid(pid, pid)  # also from the parent: no race with a kill right after the fork
        except OSError:
            pass
    return pid


def wait_all(pids: list[int], deadline: float, grace_s: float = 0.0, group: bool = False) -> list[int | None]:
    """Exit statuses (os.waitpid's) of our own children; the ones still running at the deadline, or `grace_s`
    after another one failed, are killed (by pid; with `group`, with the process group they lead) and get None."""
    status: list[int | None] = [None] * len(pids)
    running = set(range(len(pids)))
    while running and time.monotonic() < deadline:
        for i in list(running):
            done, st = os.waitpid(pids[i], os.WNOHANG)
            if done:
                status[i] = st
                running.discard(i)
                if st != 0 and grace_s:
                    deadline = min(deadline, time.monotonic() + grace_s)
        if running:
            time.sleep(0.05)
    for i in running:
        _kill(pids[i], group=group)
    return status


def _kill(pid: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)  # the child and what it started (check e's two ranks)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def describe_exit(status: int | None, log_path: Path) -> str:
    if status is None:
        what = "timed out and was killed"
    elif os.WIFSIGNALED(status):
        what = f"died of signal {os.WTERMSIG(status)}"
    elif os.WEXITSTATUS(status) == EXIT_HANG:
        what = "was stopped by hpctrain's hang watchdog (stacks under <run dir>/hangs/)"
    else:
        what = f"exited with code {os.WEXITSTATUS(status)} without a result"
    try:
        lines = [s for s in log_path.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        lines = []
    return f"the check process {what}" + (f"; last log line: {lines[-1].strip()[:200]}" if lines else "")


def run_ranks(ctx: Ctx, name: str, worker: Callable[[int, Path], None], ranks: int = 2) -> list[Any]:
    """`worker(rank, out)` in a forked process per rank, each writing its JSON record to `out`; the records, once
    every rank has reported (CheckFailed naming the first rank that did not, with its exit and last log line)."""
    deadline = time.monotonic() + ctx.timeout_s - 10
    outs = [ctx.workdir / f"{name}_rank{r}.json" for r in range(ranks)]
    logs = [ctx.workdir / f"{name}_rank{r}.log" for r in range(ranks)]
    pids = [fork_call(lambda r=r: worker(r, outs[r]), logs[r], new_group=False) for r in range(ranks)]
    status = wait_all(pids, deadline, grace_s=10)
    records = [read_json(p) for p in outs]
    for r, (rec, st) in enumerate(zip(records, status)):
        if rec is None or not rec.get("ok"):
            raise CheckFailed(f"rank {r}: {rec.get('error') if rec else describe_exit(st, logs[r])}")
    return records


def resolve_gpu_type(ctx: Ctx) -> None:
    """Fill in the device name and, with --gpu-type auto, the config's gpu_type for the MFU peak."""
    import torch

    if ctx.cpu:
        ctx.device_name, ctx.gpu_type = "cpu", "cpu"
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: run on a GPU node, or use --cpu")
    props = torch.cuda.get_device_properties(0)
    ctx.device_name = props.name
    if ctx.gpu_type == "auto":
        name = props.name.upper()
        if "H200" in name:
            ctx.gpu_type = "h200"
        elif "H100" in name:
            ctx.gpu_type = "h100_80gb"
        elif "A100" in name:
            ctx.gpu_type = "a100_80gb" if props.total_memory > 50 * 2**30 else "a100_40gb"
        else:
            ctx.gpu_type = "h200"
            print(f"unknown GPU {props.name!r}: MFU is computed against the H200's peak (use --gpu-type)", flush=True)


def _child(check: Check, ctx: Ctx, result_path: Path) -> None:
    """Inside the forked process: run one check, write its result."""
    import logging

    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    record: dict[str, Any] = {"ok": False, "summary": "", "numbers": {}, "error": None}
    try:
        if ctx.cpu:
            # One intra-op thread, as hpctrain's CPU tasks have (train.threads_per_rank=1): torch's default, a
            # thread per core, makes the tiny models' steps 5-40x slower on a busy 2-core machine (threads
            # waiting for each other), which is how check d ran past its limit under load.
            import torch

            torch.set_num_threads(1)
        if check.uses_cuda or ctx.cpu:
            resolve_gpu_type(ctx)
        else:
            ctx.device_name = "?"
            ctx.gpu_type = "cpu"  # its ranks report the device; see check_e
        record["device"] = ctx.device_name
        outcome = check.fn(ctx)
        record.update(ok=bool(outcome.ok), summary=outcome.summary, numbers=outcome.numbers)
    except BaseException as exc:  # noqa: BLE001 - the table must always print
        traceback.print_exc()
        record.update(error=first_line(exc), traceback=traceback.format_exc())
    finally:
        try:
            destroy_world()
        except Exception:  # noqa: BLE001
            pass
    record["device"] = ctx.device_name
    write_json(result_path, record)


def run_check(check: Check, ctx: Ctx, deadline: float) -> dict[str, Any]:
    started = time.monotonic()
    remaining = deadline - started
    limit = min(check.timeout_cpu_s if ctx.cpu else check.timeout_gpu_s, remaining)
    log_path = ctx.workdir / f"{check.key}.log"
    row: dict[str, Any] = {
        "check": check.key,
        "title": check.title_for(ctx.cpu),
        "result": "FAIL",
        "seconds": 0.0,
        "summary": "",
        "numbers": {},
        "error": None,
        "log": str(log_path),
    }
    if remaining < 5:
        row["error"] = "skipped: the time budget (--budget) is spent"
        return row
    child_ctx = copy.copy(ctx)
    child_ctx.timeout_s = limit
    result_path = ctx.workdir / f"{check.key}.result.json"
    result_path.unlink(missing_ok=True)
    pid = fork_call(lambda: _child(check, child_ctx, result_path), log_path)
    status = wait_all([pid], started + limit, group=True)[0]  # a check that overran: killed with its ranks
    row["seconds"] = time.monotonic() - started
    record = read_json(result_path)
    if record is None:
        row["error"] = describe_exit(status, log_path)
        return row
    row.update(
        result="PASS" if record["ok"] and not record.get("error") else "FAIL",
        summary=record.get("summary", ""),
        numbers=record.get("numbers", {}),
        error=record.get("error"),
        device=record.get("device"),
    )
    if record.get("traceback"):
        row["traceback"] = record["traceback"]
    return row
