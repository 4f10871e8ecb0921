"""Checks ctl and fr (see tools/gpu_check.py): the per-step control all-reduce on a one-rank device (NCCL) group,
and the hang watchdog's flight-recorder dump, as it fires."""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import (
    CheckFailed,
    Ctx,
    Outcome,
    compose,
    expect,
    finite,
    first_line,
    free_port,
    init_world,
    one_rank_backend,
    read_json,
    small_overrides,
    write_json,
)
from .runner import EXIT_HANG, describe_exit, fork_call, wait_all

# ---------------------------------------------------------------------------------------------------------
# ctl. the step's control all-reduce on a one-rank device group


def synthetic_batches(cfg: Any, layout: Any, seed: int, count: int) -> list[Any]:
    """`count` step batches as the engine takes them: [2 (inputs, targets), microbatches, micro_batch, seq]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (layout.grad_accum, layout.micro_batch, cfg.train.seq_len + 1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append(torch.stack([tokens[..., :-1], tokens[..., 1:]]))
    return out


class CollectiveSpy:
    """torch.distributed.all_reduce, recorded: each call's tensor (device, dtype, size) and the group and backend
    that took it. hpctrain calls it as `dist.all_reduce` (the module attribute), so replacing that sees it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._original: Callable[..., Any] | None = None

    def __enter__(self) -> CollectiveSpy:
        import torch.distributed as dist

        self._original = original = dist.all_reduce

        def spy(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            self.calls.append(describe_collective(tensor, group))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._original


def describe_collective(tensor: Any, group: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    try:  # the backend object serving this tensor's device in the group: ProcessGroupNCCL for CUDA tensors
        backend = type(pg._get_backend(tensor.device)).__name__
    except Exception as exc:  # noqa: BLE001 - recorded, judged by the check
        backend = f"none ({first_line(exc)})"
    return {
        "device": tensor.device.type,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "numel": tensor.numel(),
        "default_group": group is None or pg is c10d._get_default_group(),
        "group_backend": str(dist.get_backend(pg)),
        "backend": backend,
    }


def expected_backend(ctx: Ctx) -> str:
    return "ProcessGroupGloo" if ctx.cpu else "ProcessGroupNCCL"


def check_ctl(ctx: Ctx) -> Outcome:
    """A one-rank world on the default group hpctrain makes ("cpu:gloo,cuda:nccl"), the engine's steps with
    control values: each step's [loss, norm share, control...] must be all-reduced as a float64 tensor on the
    engine's device, on the default group's device backend (NCCL), and come back as the sum over the one rank."""
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.train.loop import load_config

    steps = 3
    cfg = load_config(compose(ctx, [*small_overrides(ctx, "ctl", 1, steps), "checkpoint=none"]))
    layout = resolve_layout(cfg)
    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    engine = build_engine(cfg, layout, ctx.device)
    batches = synthetic_batches(cfg, layout, cfg.train.seed, steps)
    per_step: list[list[dict[str, Any]]] = []
    losses = []
    for i, batch in enumerate(batches, 1):
        control = [float(i), 2.0, 0.5, 0.0]  # a stop count, checkpoint flags, a probe slot: any floats
        with CollectiveSpy() as spy:
            stats = engine.step(batch, cfg.optim.lr, control)
        per_step.append(spy.calls)
        losses.append(stats.loss)
        expect(list(stats.control) == control, f"step {i}: control {control} came back as {list(stats.control)}")
        expect(finite(stats.loss) and finite(stats.grad_norm), f"step {i}: loss {stats.loss}, norm {stats.grad_norm}")
        width = 2 + len(control)
        carrying = [c for c in spy.calls if c["numel"] == width and c["dtype"] == "float64"]
        expect(
            bool(spy.calls),
            f"step {i}: no all-reduce ran: a one-rank world skipped the step's control "
            "all-reduce (hpctrain/parallel/engine.py Engine._reduce)",
        )
        expect(
            len(carrying) == 1,
            f"step {i}: {len(carrying)} all-reduces of the {width} control values "
            f"(float64), expected 1; saw {spy.calls}",
        )
        call = carrying[0]
        expect(
            call["device"] == ctx.device.type,
            f"step {i}: the control tensor was on {call['device']}, expected the engine's device {ctx.device.type}",
        )
        expect(call["default_group"], f"step {i}: the control all-reduce ran on a subgroup, not the default group")
        expect(
            call["backend"] == expected_backend(ctx),
            f"step {i}: the control all-reduce ran on {call['backend']}, expected {expected_backend(ctx)}",
        )
    call = per_step[-1][0]
    counts = [len(c) for c in per_step]
    numbers = {
        "backend": backend,
        "steps": steps,
        "all_reduces_per_step": counts,
        "control_tensor": call,
        "losses": losses,
    }
    return Outcome(
        True,
        f"{backend}: {steps} steps, all-reduces per step {counts}, control {call['numel']} x "
        f"{call['dtype']} on {call['device']} via {call['backend']}, summed back exactly",
        numbers,
    )


# ---------------------------------------------------------------------------------------------------------
# fr. the hang watchdog fires: stacks, the flight recorder's dumps, a failure record


FR_JOB = "fr"
FR_ELEMENTS = 1000  # the collectives' size: how the check finds them in the dumps


def _fr_worker(ctx: Ctx, run_dir: Path, out: Path) -> None:
    """A one-rank world with the flight recorder on as every task has it, a few collectives on the device and on
    the CPU, then the real Watchdog with a 1 s limit while this thread sleeps: it dumps and exits EXIT_HANG."""
    import torch
    import torch.distributed as dist

    from hpctrain.distributed.task_env import flight_recorder_environment
    from hpctrain.health.watchdog import Watchdog

    record: dict[str, Any] = {"ok": False}
    try:
        os.environ.update(flight_recorder_environment())  # before the group exists, as train() sets it
        backend = one_rank_backend(ctx)
        init_world(ctx, 0, 1, free_port(), backend)
        device = ctx.device
        for _ in range(2):
            dist.all_reduce(torch.ones(FR_ELEMENTS, device=device))  # the device backend (NCCL on a GPU)
        dist.all_reduce(torch.ones(FR_ELEMENTS, dtype=torch.float64))  # a CPU tensor: gloo
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record.update(ok=True, backend=backend, device="cpu" if ctx.cpu else torch.cuda.get_device_name(device))
        write_json(out, record)
        watchdog = Watchdog(run_dir, FR_JOB, 0, timeout_s=1.0, factor=1.0, startup_timeout_s=1.0, poll_s=0.1)
        watchdog.start()
        watchdog.beat(1, 0.01)
        time.sleep(max(5.0, ctx.timeout_s))  # the watchdog ends the process long before
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        traceback.print_exc()
        record.update(ok=False, error=first_line(exc))
        write_json(out, record)


def check_fr(ctx: Ctx) -> Outcome:
    """Forks the rank (this process must not touch CUDA: a forked child could not use it after that)."""
    from hpctrain.health.watchdog import TRACE_SUFFIX
    from hpctrain.records.failures import read_failures
    from hpctrain.records.paths import RunPaths

    run_dir = ctx.workdir / "fr_watchdog"
    run_dir.mkdir(parents=True, exist_ok=True)
    out = ctx.workdir / "fr_rank0.json"
    log = ctx.workdir / "fr_rank0.log"
    pid = fork_call(lambda: _fr_worker(ctx, run_dir, out), log, new_group=False)
    status = wait_all([pid], time.monotonic() + ctx.timeout_s - 5)[0]
    record = read_json(out) or {}
    if not record.get("ok"):
        raise CheckFailed(f"the rank failed before the watchdog: {record.get('error') or describe_exit(status, log)}")
    ctx.device_name = record.get("device", ctx.device_name)
    expect(
        status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_HANG,
        f"the watchdog did not end the rank with exit code {EXIT_HANG}: {describe_exit(status, log)}",
    )
    hangs = RunPaths(run_dir).hangs(FR_JOB)
    stacks = hangs / "rank0.txt"
    expect(stacks.is_file(), f"no stack dump {stacks}")
    text = stacks.read_text(errors="replace")
    verdict = next((s.removeprefix("verdict: ") for s in text.splitlines() if s.startswith("verdict: ")), "")
    expect("Thread" in text and "_fr_worker" in text, f"{stacks} holds no stack of the sleeping main thread")
    expect("flight recorder" in verdict, f"verdict {verdict!r}: the watchdog did not read the flight recorder")
    expect("stuck" in verdict, f"verdict {verdict!r}: one rank with nothing in flight is stuck itself")
    kinds = ["gloo"] if ctx.cpu else ["nccl", "gloo"]  # the default group's backends: one recorder each
    found: dict[str, Any] = {}
    for kind in kinds:
        path = hangs / f"{kind}{TRACE_SUFFIX}0"
        expect(path.is_file(), f"no {kind} flight-recorder dump {path.name} in {hangs}")
        trace = pickle.loads(path.read_bytes())  # torch's own pickle of builtins, written by this check's rank
        ours = [
            e
            for e in trace.get("entries") or []
            if "all_reduce" in str(e.get("profiling_name")) and [FR_ELEMENTS] in (e.get("input_sizes") or [])
        ]
        expect(
            bool(ours),
            f"the {kind} dump holds {len(trace.get('entries') or [])} entries, none of this check's "
            f"all-reduces of {FR_ELEMENTS} elements",
        )
        found[kind] = {
            "entries": len(trace.get("entries") or []),
            "all_reduces": len(ours),
            "states": sorted({str(e.get("state")) for e in ours}),
            "with_stacks": any(e.get("frames") for e in ours),
        }
    if not ctx.cpu:
        expect(
            found["nccl"]["all_reduces"] >= 2,
            f"the NCCL dump holds {found['nccl']['all_reduces']} of the 2 device all-reduces",
        )
    failures = read_failures(run_dir, FR_JOB)
    expect(
        len(failures) == 1 and failures[0].get("type") == "Hang" and not failures[0].get("peer"),
        f"failure records {[(f.get('type'), f.get('peer')) for f in failures]}, expected one Hang, not a peer's",
    )
    numbers = {"backend": record.get("backend"), "exit_code": EXIT_HANG, "verdict": verdict, "dumps": found}
    dumps = ", ".join(f"{k} {v['all_reduces']}/{v['entries']} ({'/'.join(v['states'])})" for k, v in found.items())
    return Outcome(
        True,
        f"{record.get('backend')}: watchdog fired, exit {EXIT_HANG}, stacks + failure record; "
        f"flight-recorder dumps (our all-reduces/entries): {dumps}",
        numbers,
    )
