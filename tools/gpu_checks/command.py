"""Check cmd (see tools/gpu_check.py): the user's own command, `python -m hpctrain`, in the default launch mode.

`launcher.in_allocation` is on by default: the local executor runs one task, the node's elastic agent, which
forks the worker that trains (hpctrain/distributed/elastic.py). Anything the agent does to CUDA before it
forks (torch.cuda.is_available() initialises it) makes every worker die at its first CUDA call ("Cannot
re-initialize CUDA in forked subprocess"): only this path shows it, the other checks call train() in their own
processes. Two invocations, as a user would type them: 3 steps with a checkpoint at step 3, then
`run.resume=<id> train.max_steps=5`, which must go on from step 3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.records.paths import RunPaths

from .common import CheckFailed, Ctx, Outcome, expect, finite, precision, read_metrics

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "cmd"
FIRST_STEPS, SAVE_AT, RESUMED_STEPS = 3, 3, 5
# Not passed on to the command: a user's shell has none of them. PYTORCH_NVML_BASED_CUDA_CHECK above all: this
# tool sets it for itself, and with it torch.cuda.is_available() does not initialise CUDA, which would hide
# exactly the fault this check is for.
STRIPPED = (
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
STRIPPED_PREFIXES = ("TORCHELASTIC_", "SUBMITIT_")
# How the task logs show why a worker died: a CUDA or NCCL error first ("Cannot re-initialize CUDA in forked
# subprocess" when the agent initialised CUDA before it forked), else the first exception that is not one of
# the wrappers the agent, submitit and the task raise around it.
CUDA_FAULT = re.compile(r"(Cannot re-initialize CUDA|CUDA error|NCCL error|CUDA out of memory|cudaError|ncclError)")
EXCEPTION = re.compile(r"^([\w.]+\.)?\w*(Error|Exception|Fault|Failed|Exit)\w*: \S")
WRAPPERS = (
    "ProcessExitedException",
    "ChildFailedError",
    "RunStopped",
    "FailedJobError",
    "UncompletedJobError",
    "LeaveAllocation",
    "CheckFailed",
)


def command_overrides(ctx: Ctx, root: Path) -> list[str]:
    """The command line a user types on a one-GPU machine (the local executor, the default launch mode: no
    launcher.in_allocation here), with the tiny GPT on synthetic tokens and a checkpoint at step 3."""
    return [
        f"run.root={root}",
        "run.name=gpu_check",
        "cluster=local",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        f"cluster.gpu_type={ctx.gpu_type}",
        "model=tiny",
        "data=synthetic",
        "data.vocab_size=256",
        f"precision={precision(ctx)}",
        "train.seq_len=128",
        "train.global_batch=8",
        "train.micro_batch=4",
        "train.log_every=1",
        "optim.lr=2e-3",
        "optim.warmup_steps=1",
        "checkpoint=default",
        f"checkpoint.tiers.0.interval_steps={SAVE_AT}",
        "tracking=disabled",
    ]


def command_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED and not k.startswith(STRIPPED_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("WANDB_MODE", "disabled")
    return env


def run_command(args: list[str], cwd: Path, log_stem: Path, timeout_s: float) -> tuple[int | None, str]:
    """`python -m hpctrain ARGS` in a session of its own (the local executor's task and the agent's worker with
    it), killed whole at the timeout; (exit code or None on timeout, stdout). Output in log_stem.out/.err."""
    cmd = [sys.executable, "-m", "hpctrain", *args]
    print("$ " + " ".join(cmd), flush=True)
    with open(log_stem.with_suffix(".out"), "w") as out, open(log_stem.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=command_environment(), stdout=out, stderr=err, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, 9)  # what it left behind (a task, a worker), or everything at the timeout
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    return code, log_stem.with_suffix(".out").read_text(errors="replace")


def task_logs(run_dir: Path) -> list[Path]:
    folder = RunPaths(run_dir).submitit
    return sorted(folder.glob("*_log.*"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []


def log_tail(run_dir: Path, lines: int = 40) -> str:
    """The last lines of every task log (the agent's and the worker's stdout and stderr)."""
    parts = []
    for path in task_logs(run_dir):
        text = [s for s in path.read_text(errors="replace").splitlines() if s.strip()]
        parts.append(f"--- {path.name} (last {min(lines, len(text))} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


def first_fault(run_dir: Path, stem: Path) -> str:
    """The most telling line of a failed invocation: from the task logs (a worker's CUDA error is there), else
    from the command's own stderr (a config error)."""
    texts = []
    for path in [*task_logs(run_dir), stem.with_suffix(".err")]:
        try:
            texts.append([s.strip() for s in path.read_text(errors="replace").splitlines() if s.strip()])
        except OSError:
            continue
    lines = [s for text in texts for s in text]
    exceptions = [s for s in lines if EXCEPTION.match(s)]
    chosen = (
        next((s for s in lines if CUDA_FAULT.search(s)), None)
        or next((s for s in exceptions if not any(w in s.split(":")[0] for w in WRAPPERS)), None)
        or next(iter(exceptions), None)
        or (texts[-1][-1] if texts and texts[-1] else "")
    )
    return chosen[:300]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = RunPaths(run_dir).events
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.is_file() else []


def check_cmd(ctx: Ctx) -> Outcome:
    from hpctrain.checkpoint.storage import committed_in

    root = ctx.workdir / "cmd_runs"
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / "gpu_check" / RUN_ID
    base = command_overrides(ctx, root)
    deadline = time.monotonic() + ctx.timeout_s - 5
    codes: list[int | None] = []
    seconds: list[float] = []
    invocations = [
        ("first", [*base, f"run.id={RUN_ID}", f"train.max_steps={FIRST_STEPS}"], 0.55),
        ("resume", [*base, f"run.resume={RUN_ID}", f"train.max_steps={RESUMED_STEPS}"], 1.0),
    ]
    for name, args, share in invocations:
        stem = ctx.workdir / f"cmd_{name}"
        started = time.monotonic()
        code, stdout = run_command(args, ctx.workdir, stem, share * (deadline - started))
        codes.append(code)
        seconds.append(time.monotonic() - started)
        print(f"{name}: exit code {code} in {seconds[-1]:.1f} s", flush=True)
        if code != 0:
            tail = log_tail(run_dir)
            print(f"task logs:\n{tail}", flush=True)
            what = "timed out" if code is None else f"exited with {code}"
            fault = first_fault(run_dir, stem)
            where = f"task log: {fault}" if fault else f"see {stem}.err and {RunPaths(run_dir).submitit}"
            raise CheckFailed(f"`python -m hpctrain` ({name} run) {what} after {seconds[-1]:.0f} s; {where}")
        last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
        expect(
            last == f"run directory: {run_dir}",
            f"the {name} run ended with {last!r}, expected 'run directory: {run_dir}'",
        )
        if name == "first":
            in_allocation = _check_first(ctx, run_dir)
    # The resumed invocation: steps 4 and 5 after a resume from step 3, through the agent again.
    metrics = read_metrics(run_dir)
    steps = [m["step"] for m in metrics]
    expect(
        steps == list(range(1, RESUMED_STEPS + 1)),
        f"metrics.jsonl steps {steps}, expected 1..{RESUMED_STEPS} (steps 4, 5 after the resume from step {SAVE_AT})",
    )
    events = _events(run_dir)
    resumes = [e for e in events if e.get("event") == "resume"]
    attempts = [e.get("from_step") for e in events if e.get("event") == "attempt"]
    expect(
        len(resumes) == 1 and resumes[0].get("step") == SAVE_AT,
        f"resume events {resumes}, expected one from step {SAVE_AT}",
    )
    expect(attempts == [0, SAVE_AT], f"attempts started from steps {attempts}, expected [0, {SAVE_AT}]")
    losses = [m["loss"] for m in metrics]
    expect(all(finite(v) for v in losses), f"losses {losses}")
    saved = [c.step for c in committed_in(run_dir / "checkpoints")]
    expect(RESUMED_STEPS in saved, f"committed checkpoints {saved}: no final one at step {RESUMED_STEPS}")
    agents = _agent_lines(run_dir)
    expect(len(agents) == 2, f"{len(agents)} elastic agent start lines in the task logs, expected one per invocation")
    streams = committed_in(run_dir / "checkpoints")[-1].manifest.get("rng_streams", [])
    expect(
        ctx.cpu or "cuda" in streams,
        f"the resumed run's checkpoint has RNG streams {streams}: it trained on the CPU, not the GPU",
    )
    numbers = {
        "exit_codes": codes,
        "seconds": seconds,
        "steps": steps,
        "losses": losses,
        "resumed_from": resumes[0].get("step"),
        "checkpoint_steps": saved,
        "rng_streams": streams,
        "gpu_type": ctx.gpu_type,
        "in_allocation": in_allocation,
        "run_dir": str(run_dir),
    }
    device = "GPU" if "cuda" in streams else "CPU"
    return Outcome(
        True,
        f"agent + forked worker on the {device}: exit {codes[0]}, {codes[1]}; steps 1-{SAVE_AT}, "
        f"resumed from {SAVE_AT} to {RESUMED_STEPS}, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"({seconds[0]:.0f} + {seconds[1]:.0f} s)",
        numbers,
    )


def _agent_lines(run_dir: Path) -> list[str]:
    """The elastic agent's start line in each task log: the proof the run went through the agent."""
    found = []
    for path in task_logs(run_dir):
        found += [s for s in path.read_text(errors="replace").splitlines() if re.search(r"agent for \d+ worker", s)]
    return found


def _check_first(ctx: Ctx, run_dir: Path) -> bool:
    """After the first invocation: the default launch mode (an agent that forked the worker), 3 steps, the
    checkpoint at step 3, on the GPU when there is one (the CUDA generator is in the checkpoint). Returns the
    run's launcher.in_allocation (True)."""
    import yaml

    from hpctrain.checkpoint.storage import committed_in

    config = yaml.safe_load(RunPaths(run_dir).config.read_text())
    expect(
        config["launcher"]["in_allocation"] is True,
        f"launcher.in_allocation={config['launcher']['in_allocation']}: not the default launch mode",
    )
    expect(
        len(_agent_lines(run_dir)) == 1,
        "no elastic agent started (no 'agent for 1 worker(s)' in "
        f"{RunPaths(run_dir).submitit}): the run did not take the default path",
    )
    steps = [m["step"] for m in read_metrics(run_dir)]
    expect(steps == list(range(1, FIRST_STEPS + 1)), f"metrics.jsonl steps {steps}, expected 1..{FIRST_STEPS}")
    saved = committed_in(run_dir / "checkpoints")
    expect(
        [c.step for c in saved] == [SAVE_AT],
        f"committed checkpoints at {[c.step for c in saved]}, expected [{SAVE_AT}]",
    )
    streams = saved[-1].manifest.get("rng_streams", [])
    if not ctx.cpu:
        expect(
            "cuda" in streams,
            f"the checkpoint's RNG streams are {streams}: the worker trained on the CPU, "
            f"not the GPU (cluster.gpu_type={ctx.gpu_type})",
        )
    return bool(config["launcher"]["in_allocation"])
