"""Checks a, b, d and e (see tools/gpu_check.py): train() on a one-rank world, MFU and peak memory against the
plan, TP + SP + FSDP2 with CPU offload (and NVMe offload, bitwise the same), and DDP against ZeRO-1 on two ranks."""

from __future__ import annotations

import math
import statistics
import traceback
from pathlib import Path
from typing import Any

from .common import (
    Ctx,
    Outcome,
    common_overrides,
    compose,
    destroy_world,
    expect,
    finite,
    first_line,
    free_port,
    init_world,
    one_rank_backend,
    read_metrics,
    run_train,
    small_overrides,
    write_json,
)
from .runner import run_ranks

# ---------------------------------------------------------------------------------------------------------
# a. one-rank world through train()


def check_a(ctx: Ctx) -> Outcome:
    steps = 4 if ctx.cpu else 6
    tier = "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 2, keep_last: 2}]"
    config = compose(
        ctx,
        [
            *small_overrides(ctx, "a_one_rank", 1, steps),
            "checkpoint=default",
            tier,
            "health.straggler_every=2",
            "health.preflight=warn",
        ],
    )
    run_dir = ctx.workdir / "a_one_rank"
    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    result = run_train(config, run_dir)  # destroys the group when it ends
    metrics = read_metrics(run_dir)
    from hpctrain.checkpoint.storage import committed_in

    saved = [c.step for c in committed_in(run_dir / "checkpoints")]
    losses = [m["loss"] for m in metrics]
    expect(finite(result.get("final_loss")), f"final loss {result.get('final_loss')}")
    expect([m["step"] for m in metrics] == list(range(1, steps + 1)), f"metrics steps {[m['step'] for m in metrics]}")
    expect(saved and saved[-1] == steps, f"committed checkpoints at steps {saved}, expected the last at {steps}")
    s_per_step = statistics.median(m["step_time_s"] for m in metrics[1:]) if len(metrics) > 1 else 0.0
    numbers = {
        "backend": backend,
        "steps": steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "checkpoint_steps": saved,
        "step_time_s": s_per_step,
    }
    return Outcome(
        True,
        f"{backend}, {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"checkpoints at {saved}, {s_per_step * 1e3:.0f} ms/step",
        numbers,
    )


# ---------------------------------------------------------------------------------------------------------
# b. GPT-3 1.3B: MFU and peak memory against the plan


def check_b(ctx: Ctx, recompute: str) -> Outcome:
    import torch

    from hpctrain.config.layout import resolve_layout
    from hpctrain.plan.estimate import estimate
    from hpctrain.train.loop import load_config

    name = f"b_{recompute}"
    if ctx.cpu:  # the tiny model: the script's own logic; MFU is only reported
        steps = 8
        overrides = [*small_overrides(ctx, name, 1, steps)]
    else:
        steps, mb = ctx.steps, ctx.micro_batch
        overrides = [
            *common_overrides(ctx, name, 1),
            "model=gpt3_1.3b",
            "data=synthetic",
            "precision=bf16",
            "train.seq_len=2048",
            f"train.micro_batch={mb}",
            f"train.global_batch={2 * mb}",
            f"train.max_steps={steps}",
            "optim.lr=3e-4",
            "optim.warmup_steps=5",
            "health.straggler_every=0",
        ]
    overrides += ["checkpoint=none", f"parallel.recompute={recompute}", "health.preflight=off"]
    config = compose(ctx, overrides)
    cfg = load_config(config)  # the typed config, composed as the loop does from the same dict
    planned = estimate(cfg, resolve_layout(cfg)).memory
    if not ctx.cpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    result = run_train(config, ctx.workdir / name)
    torch_peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if not ctx.cpu else None
    metrics = read_metrics(ctx.workdir / name)
    expect(len(metrics) == steps, f"{len(metrics)} steps recorded, expected {steps}")
    expect(finite(result.get("final_loss")), f"final loss {result.get('final_loss')}")
    later = [m for m in metrics if m["step"] > 5] or metrics[1:] or metrics  # after the warm-up steps
    mfu = statistics.median(m["mfu"] for m in later)
    step_s = statistics.median(m["step_time_s"] for m in later)
    measured = max(m["peak_mem_gb"] for m in metrics)  # GiB: CUDA max allocated (max RSS on CPU)
    planned_gib = planned.total / 2**30
    tokens = cfg.train.global_batch * cfg.train.seq_len
    numbers = {
        "model": cfg.model.name,
        "recompute": recompute,
        "micro_batch": cfg.train.micro_batch,
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
        "steps": steps,
        "gpu_type": cfg.cluster.gpu_type,
        "mfu_median": mfu,
        "mfu_goal": None if ctx.cpu else ctx.mfu_goal,
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "final_loss": result.get("final_loss"),
        "peak_mem_gib_measured": measured,
        "peak_mem_gib_torch": torch_peak,
        "peak_mem_gib_planned": planned_gib,
        "planned_usable_gib": planned.usable / 2**30,
        "measured_over_planned": measured / planned_gib if planned_gib else None,
    }
    ok = ctx.cpu or mfu >= ctx.mfu_goal
    summary = (
        f"{cfg.model.name} {cfg.train.micro_batch}x{cfg.train.seq_len}: MFU {mfu:.1%}"
        + ("" if ctx.cpu else f" (goal {ctx.mfu_goal:.0%})")
        + f", {tokens / step_s:,.0f} tok/s, peak {measured:.2f} GiB measured / {planned_gib:.2f} GiB "
        f"planned = {measured / planned_gib:.2f}"
    )
    if ctx.cpu:
        summary += " (CPU: max RSS)"
    return Outcome(ok, summary, numbers)


# ---------------------------------------------------------------------------------------------------------
# d. TP + SP + FSDP2 with CPU offload on a one-rank mesh, the engine's norm and clipping


def grad_norm_and_clip(params: list[Any], max_norm: float, device: Any) -> float:
    """The engine's global gradient norm, then its clipping; returns the norm before clipping.

    As the engine does it: Partial TP gradients reduced, this rank's share of the squared norm moved to the
    engine's device (the gradients are CPU DTensors under offload, the groups NCCL), one all-reduce."""
    import torch.distributed as dist

    from hpctrain.parallel import clipping

    clipping.reduce_partial_grads_(params)
    share = clipping.squared_norm_share(params, dist.get_world_size(), device)
    dist.all_reduce(share)
    norm = float(share.sqrt())
    clipping.clip_grads_(params, max_norm, share)  # the squared norm, on its device
    return norm


def _offload_steps(ctx: Ctx, cfg: Any, mesh: Any, max_norm: float) -> dict[str, Any]:
    """The tiny GPT with TP + SP + FSDP2 and the optimizer of cfg.zero (CPU or NVMe offload), 3 steps on one
    batch with the engine's norm and clipping: losses, norms, where parameters and gradients lived, the weights."""
    import torch
    from torch.distributed.tensor import DTensor

    from hpctrain.models.gpt.model import GPT, gpt_args
    from hpctrain.parallel.data_parallel import apply_fsdp
    from hpctrain.parallel.engine import build_optimizer, token_loss
    from hpctrain.parallel.tensor_parallel import apply_tp

    device = ctx.device
    with torch.device("meta"):
        gpt = GPT(gpt_args(cfg.model, cfg.parallel.tp))
    # as the engine without recomputation: SP keeps its gathered inputs as shards, re-gathered in backward (NCCL)
    apply_tp(gpt, mesh["tp"], sequence_parallel=True, keep_shards=True)
    apply_fsdp(gpt, mesh["dp_shard"], cfg.zero, cfg.precision, zero_stage=3)
    gpt.to_empty(device="cpu")  # offload: FSDP2 keeps the sharded parameters on the CPU
    gpt.init_weights(seed=cfg.train.seed)
    optimizer = build_optimizer(gpt.parameters(), cfg.optim, cfg.zero)
    params = list(gpt.parameters())
    expect(all(isinstance(p, DTensor) for p in params), "some parameters are not DTensors after TP + FSDP2")
    where = sorted({p.to_local().device.type for p in params})
    expect(where == ["cpu"], f"parameters live on {where}, expected the CPU (offload)")
    vocab, seq = cfg.model.vocab_size, cfg.train.seq_len
    tokens = torch.randint(0, vocab, (4, seq + 1), generator=torch.Generator().manual_seed(cfg.train.seed))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # one batch, three times: the loss must fall
    losses, norms, after = [], [], []
    grad_devices: set[str] = set()
    for _ in range(3):
        logits = gpt(x)
        loss = token_loss(logits, y, vocab)  # the engine's loss: on the vocabulary shards under TP
        loss.backward()
        grad_devices |= {
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).device.type
            for p in params
            if p.grad is not None
        }
        norm = grad_norm_and_clip(params, max_norm, device)
        after.append(grad_norm_and_clip(params, 0.0, device))  # max_norm 0: measures, does not clip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm)
    direct = getattr(getattr(optimizer, "file", None), "direct", None)
    return {
        "losses": losses,
        "norms": norms,
        "after": after,
        "where": where,
        "grad_devices": grad_devices,
        "weights": [p.to_local().detach().clone() for p in params],
        "optimizer": type(optimizer).__name__,
        "o_direct": direct,
    }


def check_d(ctx: Ctx) -> Outcome:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpctrain.train.loop import load_config

    max_norm = 0.01  # far below the tiny model's gradient norm: every step really scales the CPU gradients
    base = [*small_overrides(ctx, "d_tp_fsdp_offload", 1, 3), f"optim.grad_clip={max_norm}"]
    cfg = load_config(compose(ctx, [*base, "zero=stage2_offload"]))
    expect(bool(cfg.zero.offload_optimizer), "zero.offload_optimizer is not set")
    nvme_cfg = load_config(
        compose(
            ctx,
            [
                *base,
                "zero=stage2_offload",
                "zero.offload_optimizer_device=nvme",
                f"zero.nvme_path={ctx.workdir / 'nvme'}",
            ],
        )
    )
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    device = ctx.device
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp_shard", "tp"))
    cpu = _offload_steps(ctx, cfg, mesh, max_norm)
    nvme = _offload_steps(ctx, nvme_cfg, mesh, max_norm)
    losses, norms, after, grad_devices = cpu["losses"], cpu["norms"], cpu["after"], cpu["grad_devices"]
    expect(all(math.isfinite(v) for v in losses + norms), f"losses {losses}, gradient norms {norms}")
    expect("cpu" in grad_devices, f"gradients on {sorted(grad_devices)}: the offload path was not exercised")
    for n, a in zip(norms, after):
        if n > max_norm:
            expect(abs(a - max_norm) <= 1e-3 * max_norm + 1e-7, f"norm {n:.4g} clipped to {a:.6g}, expected {max_norm}")
    expect(nvme["optimizer"] == "NvmeAdamW", f"zero.offload_optimizer_device=nvme built {nvme['optimizer']}")
    same = nvme["losses"] == losses and all(torch.equal(a, b) for a, b in zip(cpu["weights"], nvme["weights"]))
    expect(same, f"NVMe offload differs from CPU offload: losses {nvme['losses']} vs {losses}")
    decreased = losses[-1] < losses[0]
    numbers = {
        "losses": losses,
        "grad_norms": norms,
        "clipped_norms": after,
        "max_norm": max_norm,
        "loss_decreased": decreased,
        "param_device": cpu["where"],
        "grad_devices": sorted(grad_devices),
        "mesh_device": device.type,
        "nvme_bitwise_equal": same,
        "nvme_o_direct": nvme["o_direct"],
    }
    return Outcome(
        True,
        f"3 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        f"{'' if decreased else ' (did not decrease)'}, grad norm {norms[0]:.3g} clipped to "
        f"{after[0]:.3g} on {'/'.join(sorted(grad_devices))} gradients; NVMe offload bitwise equal"
        f" ({'O_DIRECT' if nvme['o_direct'] else 'buffered'})",
        numbers,
    )


# ---------------------------------------------------------------------------------------------------------
# e. two processes on one device, gloo for CUDA tensors: DDP and ZeRO-1 agree


def _e_worker(ctx: Ctx, rank: int, configs: dict[int, dict[str, Any]], ports: dict[int, int], out: Path) -> None:
    """One rank: DDP then ZeRO-1 through train(), each in a process group of its own."""
    import torch

    record: dict[str, Any] = {"rank": rank, "final_loss": {}}
    try:
        backend = "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo"  # NCCL refuses two ranks on one GPU
        for stage, config in configs.items():
            init_world(ctx, rank, 2, ports[stage], backend)
            record["device"] = "cpu" if ctx.cpu else torch.cuda.get_device_name()
            result = run_train(config, ctx.workdir / f"e_zero{stage}")
            record["final_loss"][str(stage)] = result.get("final_loss")
            destroy_world()
        record["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        traceback.print_exc()
        record.update(ok=False, error=first_line(exc))
    write_json(out, record)


def check_e(ctx: Ctx) -> Outcome:
    steps = 4
    # gpu_type=cpu: the local executor's check (one task per GPU) forbids 2 tasks on 1 GPU, which is the point
    # here; train() takes the GPU whatever gpu_type says (it only sets the MFU peak, unused here).
    configs = {
        stage: compose(
            ctx,
            [
                *small_overrides(ctx, f"e_zero{stage}", 2, steps, "cpu"),
                f"zero=stage{stage}",
                "checkpoint=none",
                "health.straggler_every=2",
            ],
        )
        for stage in (0, 1)
    }
    ports = {0: free_port(), 1: free_port()}
    while ports[1] == ports[0]:
        ports[1] = free_port()
    records = run_ranks(ctx, "e", lambda r, out: _e_worker(ctx, r, configs, ports, out))
    losses = {int(k): v for k, v in records[0]["final_loss"].items()}
    expect(all(finite(v) for v in losses.values()), f"final losses {losses}")
    expect(
        records[1]["final_loss"] == records[0]["final_loss"],
        f"ranks disagree on the final loss: {records[0]['final_loss']} vs {records[1]['final_loss']}",
    )
    gap = abs(losses[0] - losses[1])
    expect(gap <= 1e-3, f"DDP final loss {losses[0]:.6f} vs ZeRO-1 {losses[1]:.6f}: differ by {gap:.2e} > 1e-3")
    backend = "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo"
    ctx.device_name = records[0].get("device", ctx.device_name)
    numbers = {
        "backend": backend,
        "device": ctx.device_name,
        "steps": steps,
        "final_loss_ddp": losses[0],
        "final_loss_zero1": losses[1],
        "difference": gap,
    }
    return Outcome(
        True,
        f"2 ranks, {backend}, {steps} steps: DDP loss {losses[0]:.5f}, ZeRO-1 {losses[1]:.5f}, |diff| {gap:.1e}",
        numbers,
    )
