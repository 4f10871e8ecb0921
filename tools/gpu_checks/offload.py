"""Check off (see tools/gpu_check.py): the engine's own step with FSDP2's CPU offload against the same step without
offload, on the same batches.

The engine takes FSDP2 only with more than one data-parallel rank (one rank trains unsharded), so the check runs
two ranks on the one device, over a "cpu:gloo,cuda:gloo" group as check e does (NCCL refuses two ranks on one
GPU). Each rank builds the engine (`build_engine`) four times, on the same seed and batches, in fp32:
`zero=stage3` (no offload, the reference) twice (how far two identical runs drift on this device, atomics in the
backward: the bounds widen to 10 times that), `zero=stage2_offload` (the optimizer on the CPU) and
`zero=stage3_offload` (parameters and optimizer on the CPU), and runs 3 steps with `optim.grad_clip` far below
the gradient norm, so the clip factor, computed on the device from the step's reduced norm, scales every offloaded
CPU gradient. The reduced loss and gradient norm of every step and each rank's updated weights must agree with
the reference's.

On a GPU this is where a device-to-host copy read before it lands shows (issue 45, W1): the clip factor and the
`found_inf` verdict handed to the CPU's fused AdamW are copied with non_blocking=True; read early they are stale
or garbage, and the offloaded run's weights leave the reference's (a skipped step, a wrongly scaled one).
AdamW divides by the gradient's own scale, so the check sets optim.eps=1e-3, far above the clipped gradients'
size: the update is then proportional to the clipped gradient, and a wrong clip factor moves the weights.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from .common import (
    Ctx,
    Outcome,
    compose,
    destroy_world,
    expect,
    finite,
    first_line,
    free_port,
    init_world,
    small_overrides,
    write_json,
)
from .runner import run_ranks

STEPS = 3
MAX_NORM = 0.01  # far below the tiny model's gradient norm: every step scales the gradients
# The reference twice: the second run measures how far two identical runs drift on this device (attention's and
# the embedding's backward accumulate with atomics on a GPU), and the bounds below widen to 10 times that.
RUNS = {
    "reference": "zero=stage3",
    "repeat": "zero=stage3",
    "optimizer": "zero=stage2_offload",
    "params": "zero=stage3_offload",
}
OFFLOADED = ("optimizer", "params")
LOSS_RTOL = 1e-4  # relative: the CPU's fused AdamW against the device's (the same formula, other rounding)
UPDATE_RTOL = 1e-3  # each rank's weight change over the steps, relative to the reference's largest change
NOISE_FACTOR = 10


def _run(ctx: Ctx, config: dict[str, Any]) -> dict[str, Any]:
    """One engine on this rank: STEPS steps on this rank's fixed batches; losses, norms, where the parameters
    live, and this rank's shards before and after (float64, CPU)."""
    import torch
    from torch.distributed.tensor import DTensor

    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.train.loop import load_config

    from .control import synthetic_batches

    cfg = load_config(config)
    layout = resolve_layout(cfg)
    engine = build_engine(cfg, layout, ctx.device)

    def shards(model_parts: list[Any]) -> list[Any]:
        return [
            (p.to_local() if isinstance(p, DTensor) else p).detach().double().cpu()
            for part in model_parts
            for p in part.parameters()
        ]

    where = sorted(
        {
            (p.to_local() if isinstance(p, DTensor) else p).device.type
            for part in engine.model_parts
            for p in part.parameters()
        }
    )
    before = shards(engine.model_parts)
    batches = synthetic_batches(cfg, layout, cfg.train.seed * 1000 + engine.dp_rank, STEPS)
    stats = [engine.step(b, cfg.optim.lr) for b in batches]
    after = shards(engine.model_parts)
    del engine
    if not ctx.cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return {
        "losses": [s.loss for s in stats],
        "norms": [s.grad_norm for s in stats],
        "skipped": [s.skipped for s in stats],
        "where": where,
        "before": before,
        "after": after,
        "fsdp": bool(layout.zero_stage) and layout.dp > 1,
    }


def _worker(ctx: Ctx, rank: int, configs: dict[str, dict[str, Any]], port: int, out: Path) -> None:
    record: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        import torch

        init_world(ctx, rank, 2, port, "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo")
        record["device"] = "cpu" if ctx.cpu else torch.cuda.get_device_name()
        runs = {name: _run(ctx, config) for name, config in configs.items()}
        ref = runs["reference"]
        ref_update = max(float((a - b).abs().max()) for a, b in zip(ref["after"], ref["before"]))
        for name, r in runs.items():
            loss_gap = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            norm_gap = max(abs(a - b) / abs(b) for a, b in zip(r["norms"], ref["norms"]))
            start = max(float((a - b).abs().max()) for a, b in zip(r["before"], ref["before"]))
            update = (
                max(
                    float(((a1 - a0) - (b1 - b0)).abs().max())
                    for a0, a1, b0, b1 in zip(r["before"], r["after"], ref["before"], ref["after"])
                )
                / ref_update
            )
            record[name] = {
                "losses": r["losses"],
                "norms": r["norms"],
                "skipped": r["skipped"],
                "where": r["where"],
                "loss_gap": loss_gap,
                "norm_gap": norm_gap,
                "start_gap": start,
                "update_gap": update,
            }
        record.update(ok=True, reference_update=ref_update)
        destroy_world()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        traceback.print_exc()
        record.update(ok=False, error=first_line(exc))
    write_json(out, record)


def check_off(ctx: Ctx) -> Outcome:
    # fp32 on a GPU too: bf16's rounding would turn run-to-run noise into differences as large as a stale clip
    # factor's; the race is in the copies, whatever the dtype.
    base = [
        *small_overrides(ctx, "off", 2, STEPS, "cpu", precision_name="fp32"),
        "checkpoint=none",
        "health.preflight=off",
        f"optim.grad_clip={MAX_NORM}",
        "optim.eps=1e-3",
        "optim.decay=constant",
    ]
    configs = {name: compose(ctx, [*base, zero]) for name, zero in RUNS.items()}
    port = free_port()
    records = run_ranks(ctx, "off", lambda r, out: _worker(ctx, r, configs, port, out))
    ctx.device_name = records[0].get("device", ctx.device_name)
    ref = records[0]["reference"]
    expect(
        all(finite(v) for v in ref["losses"] + ref["norms"]), f"reference losses {ref['losses']}, norms {ref['norms']}"
    )
    expect(
        min(ref["norms"]) > MAX_NORM,
        f"gradient norms {ref['norms']} not above grad_clip {MAX_NORM}: the clip factor would not be exercised",
    )
    noise = {k: max(rec["repeat"][k] for rec in records) for k in ("loss_gap", "norm_gap", "update_gap")}
    loss_bound = max(LOSS_RTOL, NOISE_FACTOR * max(noise["loss_gap"], noise["norm_gap"]))
    update_bound = max(UPDATE_RTOL, NOISE_FACTOR * noise["update_gap"])
    for rec in records:
        for name in RUNS:
            r = rec[name]
            expect(not any(r["skipped"]), f"rank {rec['rank']}, {name}: steps skipped {r['skipped']}")
            if name in OFFLOADED:
                expect(r["where"] == ["cpu"], f"{name}: parameters on {r['where']}, expected the CPU (offload)")
            expect(
                r["start_gap"] == 0.0,
                f"rank {rec['rank']}, {name}: the initial weights differ from the reference's by {r['start_gap']:.2e}",
            )
            expect(
                r["loss_gap"] <= loss_bound and r["norm_gap"] <= loss_bound,
                f"rank {rec['rank']}, {name}: losses {r['losses']} / norms {r['norms']} vs the unoffloaded "
                f"{ref['losses']} / {ref['norms']} (relative {max(r['loss_gap'], r['norm_gap']):.2e} > "
                f"{loss_bound:.1e})",
            )
            expect(
                r["update_gap"] <= update_bound,
                f"rank {rec['rank']}, {name}: the weights' change over {STEPS} steps differs from the "
                f"unoffloaded step's by {r['update_gap']:.2e} of its size (> {update_bound:.1e}): the offloaded "
                "step clipped or skipped differently (a non_blocking copy read before it landed?)",
            )
    numbers = {
        "backend": "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo",
        "steps": STEPS,
        "max_norm": MAX_NORM,
        "reference_losses": ref["losses"],
        "reference_norms": ref["norms"],
        "noise": noise,
        "loss_bound": loss_bound,
        "update_bound": update_bound,
        **{
            name: {k: max(rec[name][k] for rec in records) for k in ("loss_gap", "norm_gap", "update_gap")}
            for name in OFFLOADED
        },
    }
    gaps = "; ".join(
        f"{name} offload: loss/norm {max(numbers[name]['loss_gap'], numbers[name]['norm_gap']):.0e}, "
        f"update {numbers[name]['update_gap']:.0e}"
        for name in OFFLOADED
    )
    return Outcome(
        True,
        f"2 ranks on 1 device ({numbers['backend']}), fp32, {STEPS} steps, norm "
        f"{ref['norms'][0]:.3g} clipped to {MAX_NORM}; vs no offload: {gaps} (bounds "
        f"{loss_bound:.0e}, {update_bound:.0e}; two unoffloaded runs differ by "
        f"{max(noise.values()):.0e})",
        numbers,
    )
