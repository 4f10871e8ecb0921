"""Check gfree (see tools/gpu_check.py): a restart inside the allocation, so that a restarted worker runs
`hpctrain.health.gpu_free.wait_for_free_gpu` before its first CUDA allocation.

The user's command as check cmd runs it (the default launch mode: the local executor's task is the node's elastic
agent, which forks the worker), with a checkpoint every 2 steps and hpctrain's fault injection killing the worker
(SIGKILL, as the OOM killer would) at step 5 of the first attempt (`HPCTRAIN_INJECT_FAULT=kill:step=5:rank=0:once`).
The agent starts restart 1 in the same job, which resumes from the newest checkpoint committed at the kill (step
4 or 2: the saves are asynchronous) and ends at step 6.

`wait_for_free_gpu` asks `nvidia-smi --query-compute-apps=...` which processes hold the worker's GPU (restarts
only: a first attempt returns at once). To see that it ran, the command gets a PATH whose first `nvidia-smi` is a
shim that logs each call (the caller's TORCHELASTIC_RESTART_COUNT and its arguments) and runs the real one. On a
GPU the restarted worker's query must be logged, with the real nvidia-smi's exit code 0, and the run must go on
(the killed worker is gone, so nothing is waited for). With --cpu the worker's device is the CPU, for which
`wait_for_free_gpu` returns at once: the restart runs, and no query may be logged.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from hpctrain.records.paths import RunPaths

from .command import command_overrides, first_fault, log_tail, run_command
from .common import CheckFailed, Ctx, Outcome, expect, finite, read_metrics

RUN_ID = "gfree"
KILL_AT, SAVE_EVERY, STEPS = 5, 2, 6
QUERY = "--query-compute-apps"

SHIM = """#!/bin/sh
# tools/gpu_check.py check gfree: logs each call, then runs the real nvidia-smi (exit 127 where there is none).
echo "pid=$$ restart=${{TORCHELASTIC_RESTART_COUNT:-none}} run=${{TORCHELASTIC_RUN_ID:-none}} args=$*" >> {log}
if [ -x "{real}" ]; then
  "{real}" "$@"
  code=$?
else
  code=127
fi
echo "exit=$code" >> {log}
exit $code
"""


def _shim(ctx: Ctx) -> tuple[Path, Path, str | None]:
    """The nvidia-smi shim's folder and log, and the real nvidia-smi (None: not on this machine)."""
    real = shutil.which("nvidia-smi")
    folder, log = ctx.workdir / "gfree_bin", ctx.workdir / "gfree_nvidia_smi.log"
    folder.mkdir(parents=True, exist_ok=True)
    log.touch()
    shim = folder / "nvidia-smi"
    shim.write_text(SHIM.format(log=log, real=real or "/nonexistent/nvidia-smi"))
    shim.chmod(0o755)
    return folder, log, real


def _calls(log: Path) -> list[dict[str, Any]]:
    """The shim's log: one record per call (restart, args, the real one's exit code)."""
    calls: list[dict[str, Any]] = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("pid="):
            fields = dict(part.split("=", 1) for part in line.split(" args=")[0].split())
            calls.append({**fields, "args": line.split(" args=", 1)[1] if " args=" in line else "", "exit": None})
        elif line.startswith("exit=") and calls:
            calls[-1]["exit"] = int(line.removeprefix("exit="))
    return calls


def check_gfree(ctx: Ctx) -> Outcome:
    root = ctx.workdir / "gfree_runs"
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / "gpu_check" / RUN_ID
    folder, log, real = _shim(ctx)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"  # this check process: its command
    args = [
        *command_overrides(ctx, root),
        f"run.id={RUN_ID}",
        f"train.max_steps={STEPS}",
        f"checkpoint.tiers.0.interval_steps={SAVE_EVERY}",
        "health.preflight=off",
        f"+cluster.env.HPCTRAIN_INJECT_FAULT='kill:step={KILL_AT}:rank=0:once'",
    ]
    stem = ctx.workdir / "gfree_run"
    started = time.monotonic()
    code, stdout = run_command(args, ctx.workdir, stem, ctx.timeout_s - 10)
    seconds = time.monotonic() - started
    if code != 0:
        print(f"task logs:\n{log_tail(run_dir)}", flush=True)
        what = "timed out" if code is None else f"exited with {code}"
        raise CheckFailed(
            f"`python -m hpctrain` with a worker killed at step {KILL_AT} {what} after {seconds:.0f} s; "
            f"task log: {first_fault(run_dir, stem)}"
        )
    jobs = RunPaths(run_dir).jobs.read_text().splitlines() if RunPaths(run_dir).jobs.is_file() else []
    events = [json.loads(s) for s in RunPaths(run_dir).events.read_text().splitlines() if s.strip()]
    attempts = [e.get("from_step") for e in events if e.get("event") == "attempt"]
    restarts = [e.get("restart") for e in events if e.get("event") == "attempt"]
    metrics = read_metrics(run_dir)
    steps = [m["step"] for m in metrics]
    expect(len(jobs) == 1, f"{len(jobs)} jobs in jobs.jsonl: the restart was not inside the allocation")
    # The restart resumes from the newest checkpoint whose asynchronous save committed before the kill (step 4 or
    # 2; or none: from the start): either way restart 1 ran, which is what this check is for.
    expect(
        restarts == [0, 1] and attempts[0] == 0 and attempts[1] in range(0, KILL_AT, SAVE_EVERY),
        f"attempts of restarts {restarts} from steps {attempts}, expected restarts [0, 1] (the worker killed at "
        f"step {KILL_AT}, restarted in the allocation)",
    )
    expect(
        steps and steps[-1] == STEPS and all(finite(m["loss"]) for m in metrics),
        f"metrics.jsonl steps {steps}: the restarted worker did not train to step {STEPS}",
    )
    calls = _calls(log)
    queries = [c for c in calls if QUERY in c["args"]]
    resumed = f"from step {attempts[1]}" if attempts[1] else "from the start (no save had committed)"
    numbers = {
        "seconds": seconds,
        "attempts": attempts,
        "restarts": restarts,
        "steps": steps,
        "nvidia_smi": real,
        "compute_app_queries": queries,
        "nvidia_smi_calls": len(calls),
    }
    if ctx.cpu:
        expect(not queries, f"a CPU worker queried nvidia-smi's compute apps: {queries}")
        return Outcome(
            True,
            f"worker killed at step {KILL_AT}, restart 1 in the same job {resumed} to step "
            f"{STEPS} ({seconds:.0f} s); CPU: gpu_free returns at once for a CPU device (no "
            "nvidia-smi query, as expected)",
            numbers,
        )
    by_restart = sorted({c.get("restart") for c in queries})
    expect(
        any(c.get("restart") == "1" for c in queries),
        f"the restarted worker did not ask nvidia-smi which processes hold its GPU (queries by restart "
        f"{by_restart}, {len(calls)} nvidia-smi calls): hpctrain.health.gpu_free.wait_for_free_gpu did not run",
    )
    expect(
        all(c.get("restart") != "0" for c in queries),
        "the first attempt's worker queried nvidia-smi: wait_for_free_gpu should return at once on restart 0",
    )
    failed = [c for c in queries if c["exit"] != 0]
    expect(not failed, f"nvidia-smi {QUERY} exited {[c['exit'] for c in failed]} (real: {real})")
    return Outcome(
        True,
        f"worker killed at step {KILL_AT}, restart 1 in the same job {resumed} to step "
        f"{STEPS} ({seconds:.0f} s); gpu_free queried nvidia-smi {len(queries)}x on restart 1 "
        "(exit 0), no earlier worker held the GPU",
        numbers,
    )
