"""Check fp8x (see tools/gpu_check.py): FP8 (torchao Float8Linear) with TP + sequence parallelism and FSDP2 on a
one-rank (dp_shard, tp) mesh, eager and compiled.

The engine's own layout functions, in the engine's order (hpctrain.parallel.engine._apply_layout), applied to
the tiny Llama on the meta device: `apply_float8` (FP8 Linears; with FSDP2 and the tensorwise recipe, FP8
all-gathers of the weights), `apply_tp` on the mesh's tp dim (torchao's float8 TP styles for tensorwise),
`apply_fsdp` (ZeRO-2, bf16 mixed precision) on its dp_shard dim, then `apply_compile` for the compiled run, the
weights, `build_optimizer` and `register_scale_precompute` (the FP8 weight scales after each step). The engine
itself takes FSDP2 and TP only on more than one rank; this builds the same model on one.

Runs, 4 steps each on two fixed batches: bf16 (no FP8), tensorwise eager, rowwise eager, tensorwise compiled.
On a GPU the compiled run uses Inductor (what parallel.compile=true runs); with --cpu torchao emulates the FP8
GEMMs and the compiled run uses the "aot_eager" backend (dynamo and AOTAutograd trace the DTensor/FSDP2/FP8
block as Inductor would get it, without Inductor's C++ code generation: 30 s alone on 2 idle cores, several
minutes on the loaded test machine; check comp runs Inductor on the CPU): the row says so.
"""

from __future__ import annotations

from typing import Any

from .common import Ctx, Outcome, compose, expect, finite, free_port, init_world, one_rank_backend, small_overrides
from .control import synthetic_batches
from .probes import one_rank_mesh

STEPS = 4
RUNS = (
    ("bf16", "none", False),
    ("tensorwise", "tensorwise", False),
    ("rowwise", "rowwise", False),
    ("tensorwise compiled", "tensorwise", True),
)
FP8_LOSS_GAP = 0.05  # an FP8 run's mean loss against bf16's (relative), as check f8
COMPILED_GAP = {"gpu": 2e-2, "cpu": 1e-3}  # compiled against eager FP8, each step (relative)


def _run(ctx: Ctx, recipe: str, compiled: bool, mesh: Any) -> dict[str, Any]:
    import torch

    from hpctrain.config.layout import resolve_layout
    from hpctrain.models import create_model
    from hpctrain.parallel.compile import apply_compile, compile_seconds
    from hpctrain.parallel.data_parallel import apply_fsdp
    from hpctrain.parallel.engine import token_loss
    from hpctrain.parallel.float8 import apply_float8, float8_linears, register_scale_precompute
    from hpctrain.parallel.optimizer import build_optimizer
    from hpctrain.parallel.tensor_parallel import apply_tp
    from hpctrain.train.loop import load_config

    name = f"fp8x_{recipe}{'_compiled' if compiled else ''}"
    cfg = load_config(
        compose(
            ctx,
            [
                *small_overrides(ctx, name, 1, STEPS, model="llama_tiny", precision_name="bf16"),
                f"precision.fp8={recipe}",
                "zero=stage2",
                "train.seq_len=64",
                "checkpoint=none",
                "health.preflight=off",
            ],
        )
    )
    layout = resolve_layout(cfg)
    with torch.device("meta"):
        model = create_model(cfg.model, 1)
    apply_float8(model, cfg.precision, layout, ctx.device, fsdp=True)
    apply_tp(model, mesh["tp"], sequence_parallel=True)
    apply_fsdp(model, mesh["dp_shard"], cfg.zero, cfg.precision, zero_stage=2)
    if compiled:
        apply_compile(model, "none", 1, backend="aot_eager" if ctx.cpu else "inductor")
    model.to_empty(device=ctx.device)
    model.init_weights(seed=cfg.train.seed)
    optimizer = build_optimizer(model.parameters(), cfg.optim, cfg.zero)
    register_scale_precompute([optimizer], [model])
    fp8 = float8_linears(model)
    batches = synthetic_batches(cfg, layout, cfg.train.seed, 2)
    losses = []
    compile_started = compile_seconds()
    for i in range(STEPS):
        x, y = batches[i % 2][0, 0].to(ctx.device), batches[i % 2][1, 0].to(ctx.device)
        loss = token_loss(model(x), y, cfg.model.vocab_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    expect(all(finite(v) for v in losses), f"{name}: losses {losses}")
    compile_s = compile_seconds() - compile_started
    expect(compile_s > 0 or not compiled, f"{name}: torch.compile compiled nothing")
    return {
        "losses": losses,
        "float8_linears": len(fp8),
        "compile_s": compile_s,
        "fp8_all_gather": any(m.config.enable_fsdp_float8_all_gather for m in fp8),
    }


def check_fp8x(ctx: Ctx) -> Outcome:
    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    mesh = one_rank_mesh(ctx.device, ("dp_shard", "tp"))
    runs = {label: _run(ctx, recipe, compiled, mesh) for label, recipe, compiled in RUNS}
    base = runs["bf16"]
    expect(base["float8_linears"] == 0, f"the bf16 run holds {base['float8_linears']} Float8Linear modules")
    mean = sum(base["losses"]) / STEPS
    for label, r in runs.items():
        if label == "bf16":
            continue
        expect(r["float8_linears"] > 0, f"{label}: no Linear was converted to Float8Linear")
        gap = abs(sum(r["losses"]) / STEPS - mean) / mean
        expect(
            gap <= FP8_LOSS_GAP,
            f"{label}: mean loss {sum(r['losses']) / STEPS:.4f} vs bf16 {mean:.4f} "
            f"(relative {gap:.3f} > {FP8_LOSS_GAP})",
        )
        r["loss_gap"] = gap
    expect(runs["tensorwise"]["fp8_all_gather"], "tensorwise with FSDP2: the FP8 all-gather of the weights is off")
    eager, compiled = runs["tensorwise"]["losses"], runs["tensorwise compiled"]["losses"]
    bound = COMPILED_GAP["cpu" if ctx.cpu else "gpu"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    expect(
        worst <= bound, f"tensorwise compiled vs eager: losses {compiled} vs {eager} (relative {worst:.2e} > {bound:g})"
    )
    numbers = {
        "backend": backend,
        "steps": STEPS,
        "compile_backend": "aot_eager" if ctx.cpu else "inductor",
        "compiled_vs_eager": worst,
        **runs,
    }
    how = "emulated FP8; compiled with aot_eager, not Inductor, on the CPU" if ctx.cpu else "Inductor"
    parts = "; ".join(f"{label} {' '.join(f'{v:.3f}' for v in r['losses'])}" for label, r in runs.items())
    return Outcome(
        True,
        f"(dp_shard 1, tp 1) mesh, TP+SP+FSDP2 ZeRO-2, FP8 all-gather: {parts}; compiled vs eager "
        f"{worst:.1e} ({how}, compiling {runs['tensorwise compiled']['compile_s']:.0f} s)",
        numbers,
    )
