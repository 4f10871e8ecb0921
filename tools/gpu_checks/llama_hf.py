"""Checks llama and hf (see tools/gpu_check.py): Llama through the engine in bf16 and fp32 with only the fused
SDPA kernels allowed, Engine.evaluate; a checkpoint exported as a Hugging Face directory and a run started from
it (model.init_from).

Only the public model and engine are used (config, build_engine, step, evaluate; the loop's train()): the
model's own code may change underneath (a fused RMSNorm, a RoPE cache, how grouped-query attention calls SDPA).
"""

from __future__ import annotations

from typing import Any

from .common import (
    CheckFailed,
    Ctx,
    Outcome,
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

# The step's loss and Engine.evaluate's on the same batch, same weights: the same forward (no dropout in
# llama_tiny), so equal up to the kernels' rounding.
EVAL_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-3}
NO_KERNEL = ("No available kernel", "No viable backend")  # torch's words, CUDA and CPU, when none qualifies


def fused_backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def _qualifies(engine: Any, batch: Any, backend: Any) -> bool:
    """Whether a forward (Engine.evaluate) runs with only this SDPA kernel allowed."""
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel([backend]):
            engine.evaluate([batch])
        return True
    except RuntimeError as exc:
        print(f"{backend}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", flush=True)
        return False


def _llama_in(ctx: Ctx, precision_name: str) -> dict[str, Any]:
    """The tiny Llama through the engine in one precision: which fused SDPA kernels run it alone, then
    Engine.evaluate and 3 steps with only flash, cuDNN and memory-efficient attention allowed."""
    import torch
    from torch.nn.attention import sdpa_kernel

    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.train.loop import load_config

    cfg = load_config(
        compose(
            ctx,
            [
                *small_overrides(
                    ctx, f"llama_{precision_name}", 1, 3, model="llama_tiny", precision_name=precision_name
                ),
                "checkpoint=none",
            ],
        )
    )
    layout = resolve_layout(cfg)
    engine = build_engine(cfg, layout, ctx.device)
    batches = synthetic_batches(cfg, layout, cfg.train.seed, 2)
    backends = fused_backends()
    alone = [name for name, b in backends.items() if _qualifies(engine, batches[0], b)]
    try:
        with sdpa_kernel(list(backends.values())):
            before = engine.evaluate([batches[0]])
            stats = [engine.step(b, cfg.optim.lr) for b in (batches[0], batches[1], batches[0])]
            after = engine.evaluate(batches)
    except RuntimeError as exc:
        if any(m in str(exc) for m in NO_KERNEL):
            raise CheckFailed(
                f"{precision_name}: no fused SDPA kernel ({', '.join(backends)}) runs the Llama's "
                "attention: only the math kernel qualifies"
            ) from exc
        raise
    losses = [s.loss for s in stats]
    norms = [s.grad_norm for s in stats]
    expect(
        all(finite(v) for v in [before, after, *losses, *norms]),
        f"{precision_name}: evaluate {before} / {after}, losses {losses}, norms {norms}",
    )
    expect(all(n > 0 for n in norms), f"{precision_name}: gradient norms {norms}: no gradient reached the weights")
    gap = abs(losses[0] - before) / abs(before)
    expect(
        gap <= EVAL_TOLERANCE[precision_name],
        f"{precision_name}: Engine.evaluate {before:.6f} vs the step's loss {losses[0]:.6f} on the same batch "
        f"(relative {gap:.1e} > {EVAL_TOLERANCE[precision_name]:.0e})",
    )
    del engine
    if not ctx.cpu:
        torch.cuda.empty_cache()
    return {
        "kernels_alone": alone,
        "eval_before": before,
        "eval_after": after,
        "losses": losses,
        "grad_norms": norms,
        "eval_vs_step": gap,
        "loss_fell": after < before,
    }


def check_llama(ctx: Ctx) -> Outcome:
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))  # Engine.evaluate's all-reduce on the device group
    results = {p: _llama_in(ctx, p) for p in ("bf16", "fp32")}
    numbers: dict[str, Any] = {f"{p}_{k}": v for p, r in results.items() for k, v in r.items()}
    numbers["device"] = ctx.device.type
    parts = [
        f"{p}: kernels {'/'.join(r['kernels_alone']) or 'none alone'}, eval {r['eval_before']:.3f} -> "
        f"{r['eval_after']:.3f}"
        for p, r in results.items()
    ]
    note = " (CPU: flash is torch's CPU kernel; cuDNN and memory-efficient exist on GPUs only)" if ctx.cpu else ""
    return Outcome(True, "; ".join(parts) + note, numbers)


# ---------------------------------------------------------------------------------------------------------
# hf. a checkpoint exported as a Hugging Face directory, a new run started from it


def check_hf(ctx: Ctx) -> Outcome:
    """Run A trains the tiny Llama 3 steps through train() and saves; `tools/checkpoint.py export --format hf`
    (its main(), in this process) writes the HF directory; run B starts from it (model.init_from) and trains
    2 steps. The weights B's engine holds after the loop loaded the directory must be A's checkpoint's, bit for
    bit (fp32 both ways)."""
    import torch
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpctrain.checkpoint.inspect import consolidated_model, find
    from hpctrain.records.paths import RunPaths
    from hpctrain.train import loop
    from tools.checkpoint import main as checkpoint_tool

    source_dir, started_dir, out = ctx.workdir / "hf_source", ctx.workdir / "hf_init_from", ctx.workdir / "hf_export"
    source = compose(
        ctx,
        [
            *small_overrides(ctx, "hf_source", 1, 3, model="llama_tiny"),
            "checkpoint=default",
            "checkpoint.tiers.0.interval_steps=3",
        ],
    )
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    run_train(source, source_dir)
    RunPaths(source_dir).config.write_text(OmegaConf.to_yaml(OmegaConf.create(source)))  # as the launcher does
    code = checkpoint_tool(["export", str(source_dir), str(out), "--format", "hf"])
    expect(code == 0, f"tools/checkpoint.py export --format hf exited {code}")
    files = sorted(p.name for p in out.iterdir())
    expect("config.json" in files and any(f.endswith(".safetensors") for f in files), f"the export holds {files}")
    exported = consolidated_model(find(source_dir))

    loaded: list[dict[str, Any]] = []
    fresh: list[dict[str, Any]] = []
    original = loop.load_hf

    def weights_of(parts: Any) -> dict[str, Any]:
        full: dict[str, Any] = {}
        for part in parts:
            state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            full.update({k: v.detach().to("cpu", copy=True) for k, v in state.items()})
        return full

    def observed_load_hf(parts: Any, path: Any, m: Any) -> None:  # the loop's own call, observed
        fresh.append(weights_of(parts))
        original(parts, path, m)
        loaded.append(weights_of(parts))

    started = compose(
        ctx,
        [*small_overrides(ctx, "hf_init_from", 1, 2, model="llama_tiny"), "checkpoint=none", f"model.init_from={out}"],
    )
    loop.load_hf = observed_load_hf
    try:
        init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
        result = run_train(started, started_dir)
    finally:
        loop.load_hf = original
    expect(len(loaded) == 1, f"the loop loaded the HF directory {len(loaded)} times, expected once")
    weights = loaded[0]
    expect(
        sorted(weights) == sorted(exported),
        f"the run's weights {sorted(set(weights) ^ set(exported))[:4]} differ in name from the checkpoint's",
    )
    differ = []
    for name, value in weights.items():
        rows = exported[name].shape[0]
        same = (
            value.dtype == exported[name].dtype and torch.equal(value[:rows], exported[name]) and not value[rows:].any()
        )  # the layout's vocabulary padding rows start at zero
        if not same:
            differ.append(name)
    expect(
        not differ, f"{len(differ)} of {len(weights)} tensors differ from the exported checkpoint, e.g. {differ[:3]}"
    )
    changed = sum(
        1 for k, v in fresh[0].items() if k in exported and not torch.equal(v[: exported[k].shape[0]], exported[k])
    )
    expect(changed > 0, "the run's fresh weights already equal the checkpoint's: the comparison would prove nothing")
    metrics = read_metrics(started_dir)
    losses = [m["loss"] for m in metrics]
    expect(
        [m["step"] for m in metrics] == [1, 2] and all(finite(v) for v in losses),
        f"the run from the HF directory: steps {[m['step'] for m in metrics]}, losses {losses}",
    )
    expect(finite(result.get("final_loss")), f"final loss {result.get('final_loss')}")
    source_losses = [m["loss"] for m in read_metrics(source_dir)]
    n_bytes = sum(v.numel() * v.element_size() for v in weights.values())
    numbers = {
        "files": files,
        "tensors": len(weights),
        "bytes": n_bytes,
        "source_losses": source_losses,
        "init_from_losses": losses,
        "bitwise_equal": True,
        "changed_by_training": changed,
    }
    return Outcome(
        True,
        f"3-step Llama checkpoint exported ({', '.join(files)}); model.init_from run loaded "
        f"{len(weights)} tensors ({n_bytes / 1e6:.1f} MB) bitwise, steps 1-2 loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f} (source run ended at {source_losses[-1]:.3f})",
        numbers,
    )
