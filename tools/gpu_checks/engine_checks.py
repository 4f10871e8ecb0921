"""Checks sync, comp and mem (see tools/gpu_check.py): host syncs per engine step (CUDA's sync debug mode), the
dense model compiled (parallel.compile=true) against eager, and reserved memory and allocator retries against the
plan's per-GPU memory."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .common import (
    Ctx,
    Outcome,
    common_overrides,
    compose,
    expect,
    finite,
    free_port,
    init_world,
    one_rank_backend,
    read_metrics,
    run_train,
    small_overrides,
)
from .control import synthetic_batches
from .probes import cuda_sync_warnings, host_reads

# Host syncs an engine step of a dense model may make: the control plane's one read of the reduced
# [loss, squared norm, *control] vector (hpctrain/parallel/engine.py Engine._read). The test suite pins the same
# number (tests/gpu_rules.py SYNCS_PER_STEP, tests/parallel/test_host_syncs.py); tests/tools/test_gpu_check.py
# holds the two equal.
SYNCS_PER_STEP = 1
SYNC_STEPS = 4


def _engine(ctx: Ctx, overrides: list[str]) -> tuple[Any, Any, Any]:
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.train.loop import load_config

    cfg = load_config(compose(ctx, overrides))
    layout = resolve_layout(cfg)
    return cfg, layout, build_engine(cfg, layout, ctx.device)


# ---------------------------------------------------------------------------------------------------------
# sync. host syncs per step


def check_sync(ctx: Ctx) -> Outcome:
    """The tiny GPT through the engine on a one-rank world (bf16 on a GPU), SYNC_STEPS steps with control values,
    each under `torch.cuda.set_sync_debug_mode("warn")` with its warnings counted (a GPU), and under a dispatch
    mode counting the host's reads of tensor values and the ops whose output size depends on values (both: the
    CPU's stand-in). Every step, the first included, may sync at most SYNCS_PER_STEP times."""
    import torch

    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    cfg, layout, engine = _engine(
        ctx, [*small_overrides(ctx, "sync", 1, SYNC_STEPS), "checkpoint=none", "health.preflight=off"]
    )
    batches = synthetic_batches(cfg, layout, cfg.train.seed, SYNC_STEPS)
    if not ctx.cpu:
        torch.cuda.synchronize()
    warnings_per_step: list[int] = []
    reads_per_step: list[int] = []
    seen: list[str] = []
    for batch in batches:
        reads: list[str] = []
        found: list[str] = []
        with cuda_sync_warnings(found) if not ctx.cpu else contextlib.nullcontext(), host_reads(reads):
            stats = engine.step(batch, cfg.optim.lr, [1.0, 0.0])
        expect(finite(stats.loss), f"loss {stats.loss}")
        warnings_per_step.append(len(found))
        reads_per_step.append(len(reads))
        seen += [r for r in reads if r not in seen]
    if not ctx.cpu:
        torch.cuda.synchronize()
    counted = reads_per_step if ctx.cpu else warnings_per_step
    over = [i + 1 for i, n in enumerate(counted) if n > SYNCS_PER_STEP]
    numbers = {
        "backend": backend,
        "steps": SYNC_STEPS,
        "budget": SYNCS_PER_STEP,
        "cuda_sync_warnings_per_step": None if ctx.cpu else warnings_per_step,
        "host_reads_per_step": reads_per_step,
        "host_reads": seen,
    }
    what = "host reads (dispatch mode; CPU: no sync debug mode)" if ctx.cpu else "sync warnings"
    summary = (
        f"{what} per step {counted} (budget {SYNCS_PER_STEP})"
        + ("" if ctx.cpu else f"; dispatch-mode host reads {reads_per_step}")
        + f": {'; '.join(seen) or 'none'}"
    )
    if over:
        return Outcome(False, f"steps {over} above the budget; " + summary, numbers)
    return Outcome(True, summary, numbers)


# ---------------------------------------------------------------------------------------------------------
# comp. parallel.compile=true against eager

COMP_STEPS = 4
COMP_GAP = {"gpu": 1e-2, "cpu": 1e-3}  # each step's loss, compiled against eager (relative)


def check_comp(ctx: Ctx) -> Outcome:
    """The tiny GPT through the engine on a one-rank world, eager and then with parallel.compile=true (each block
    compiled with Inductor, hpctrain.parallel.compile), COMP_STEPS steps each on the same batches: losses close,
    and torch.compile really compiled (its own clock)."""
    from hpctrain.parallel.compile import compile_seconds

    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    runs: dict[str, Any] = {}
    for name, extra in (("eager", []), ("compiled", ["parallel.compile=true"])):
        cfg, layout, engine = _engine(
            ctx,
            [*small_overrides(ctx, f"comp_{name}", 1, COMP_STEPS), "checkpoint=none", "health.preflight=off", *extra],
        )
        batches = synthetic_batches(cfg, layout, cfg.train.seed, 2)
        started = compile_seconds()
        stats = [engine.step(batches[i % 2], cfg.optim.lr) for i in range(COMP_STEPS)]
        runs[name] = {
            "losses": [s.loss for s in stats],
            "norms": [s.grad_norm for s in stats],
            "compile_s": compile_seconds() - started,
        }
        del engine
    eager, compiled = runs["eager"], runs["compiled"]
    expect(
        all(finite(v) for v in eager["losses"] + compiled["losses"]), f"losses {eager['losses']} / {compiled['losses']}"
    )
    expect(compiled["compile_s"] > 0, "parallel.compile=true: torch.compile compiled nothing")
    expect(eager["compile_s"] == 0, f"the eager run compiled for {eager['compile_s']:.1f} s")
    bound = COMP_GAP["cpu" if ctx.cpu else "gpu"]
    gap = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"]))
    norm_gap = max(abs(a - b) / abs(b) for a, b in zip(compiled["norms"], eager["norms"]))
    expect(
        gap <= bound,
        f"compiled losses {compiled['losses']} vs eager {eager['losses']} (relative {gap:.2e} > {bound:g})",
    )
    numbers = {"backend": backend, "steps": COMP_STEPS, **runs, "loss_gap": gap, "norm_gap": norm_gap}
    return Outcome(
        True,
        f"tiny GPT, {COMP_STEPS} steps: eager {' '.join(f'{v:.4f}' for v in eager['losses'])}, "
        f"compiled {' '.join(f'{v:.4f}' for v in compiled['losses'])} (loss {gap:.1e}, grad norm "
        f"{norm_gap:.1e} relative; {compiled['compile_s']:.0f} s compiling)",
        numbers,
    )


# ---------------------------------------------------------------------------------------------------------
# mem. reserved memory and allocator retries against the plan

MEM_STEPS = 6


def mem_overrides(ctx: Ctx) -> list[str]:
    """GPT-3 125M, bf16, 4 x 2048 tokens a micro-batch, 2 micro-batches a step, on one GPU: a few GiB; the tiny
    GPT with --cpu (only planned)."""
    if ctx.cpu:
        return [*small_overrides(ctx, "mem", 1, MEM_STEPS), "checkpoint=none", "health.preflight=off"]
    return [
        *common_overrides(ctx, "mem", 1),
        "model=gpt3_125m",
        "data=synthetic",
        "precision=bf16",
        "train.seq_len=2048",
        "train.micro_batch=4",
        "train.global_batch=8",
        f"train.max_steps={MEM_STEPS}",
        "optim.lr=3e-4",
        "optim.warmup_steps=2",
        "checkpoint=none",
        "health.preflight=off",
        "health.straggler_every=0",
    ]


def check_mem(ctx: Ctx) -> Outcome:
    """The plan's per-GPU memory for the config (hpctrain.plan.estimate.estimate, what the dry run and the config
    checks compute), then on a GPU the run through train() on a one-rank world: the caching allocator's peak
    allocated and reserved memory and its retries (a cudaMalloc that failed, freed the cache and tried again:
    fragmentation or a near miss), against the plan. Fails on an allocator retry or OOM, or when the peak
    reserved memory exceeds the plan's usable memory; the ratios are reported, not judged."""
    import torch

    from hpctrain.config.layout import resolve_layout
    from hpctrain.plan.estimate import estimate
    from hpctrain.train.loop import load_config

    config = compose(ctx, mem_overrides(ctx))
    cfg = load_config(config)
    planned = estimate(cfg, resolve_layout(cfg)).memory
    gib = 2.0**30
    plan = {
        "planned_gib": planned.total / gib,
        "usable_gib": planned.usable / gib,
        "activations_gib": planned.activations / gib,
    }
    if ctx.cpu:
        return Outcome(
            True,
            f"{cfg.model.name} {cfg.train.micro_batch}x{cfg.train.seq_len}: planned "
            f"{plan['planned_gib']:.3f} GiB per GPU (activations {plan['activations_gib']:.3f}), "
            f"usable {plan['usable_gib']:.0f} GiB ({cfg.cluster.gpu_type}); no allocator on CPU",
            {"model": cfg.model.name, **plan},
        )
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    torch.cuda.reset_peak_memory_stats(ctx.device)
    result = run_train(config, ctx.workdir / "mem")
    stats = torch.cuda.memory_stats(ctx.device)
    steps = [m["step"] for m in read_metrics(ctx.workdir / "mem")]
    expect(
        steps == list(range(1, MEM_STEPS + 1)) and finite(result.get("final_loss")),
        f"the run recorded steps {steps}, final loss {result.get('final_loss')}",
    )
    measured = {
        "max_allocated_gib": torch.cuda.max_memory_allocated(ctx.device) / gib,
        "max_reserved_gib": torch.cuda.max_memory_reserved(ctx.device) / gib,
        "reserved_gib": torch.cuda.memory_reserved(ctx.device) / gib,
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "",
    }
    ratios = {
        "allocated_over_planned": measured["max_allocated_gib"] / plan["planned_gib"],
        "reserved_over_planned": measured["max_reserved_gib"] / plan["planned_gib"],
    }
    numbers = {"model": cfg.model.name, **plan, **measured, **ratios}
    summary = (
        f"{cfg.model.name} {cfg.train.micro_batch}x{cfg.train.seq_len} bf16: peak allocated "
        f"{measured['max_allocated_gib']:.2f} / reserved {measured['max_reserved_gib']:.2f} GiB vs planned "
        f"{plan['planned_gib']:.2f} GiB ({ratios['allocated_over_planned']:.2f}x / "
        f"{ratios['reserved_over_planned']:.2f}x), allocator retries {measured['num_alloc_retries']}, OOMs "
        f"{measured['num_ooms']}, alloc conf '{measured['alloc_conf'] or 'default'}'"
    )
    problems = []
    if measured["num_alloc_retries"] or measured["num_ooms"]:
        problems.append("the caching allocator retried or ran out of memory")
    if measured["max_reserved_gib"] > plan["usable_gib"]:
        problems.append(f"reserved memory above the plan's usable {plan['usable_gib']:.1f} GiB")
    return Outcome(not problems, summary + ("; " + "; ".join(problems) if problems else ""), numbers)
