"""Check rms (see tools/gpu_check.py): `F.rms_norm` on TP DTensors, as Qwen3's per-head query/key norms run it.

Under TP each rank holds some heads: the norms' input is [B, T, heads, head_dim] sharded on dim 2 (heads), the
weight [head_dim] replicated (hpctrain.parallel.tensor_parallel.block_plan, `tp_head_norms`), and
hpctrain.models.llama.model.RMSNorm computes `weight * F.rms_norm(x, (head_dim,), eps)`. On a GPU `F.rms_norm` is
torch's fused kernel (`_fused_rms_norm`), which DTensor must shard by its own rule; on the CPU the composite.

Two parts on a one-rank tp mesh (the device group: NCCL on a GPU):
- the op: that expression with x a DTensor Shard(2) and the weight Replicate(), forward and backward, in fp32 and
  bf16, against the same on plain tensors, both against an fp64 reference: the DTensor error within twice the
  plain one plus a floor;
- the model: the tiny Qwen3 (`model=qwen3_tiny`) with `apply_tp` (sequence parallel) against the plain model, same
  weights and tokens (bf16 weights on a GPU, fp32 on the CPU): logits and the norms' weight gradients equal
  within rounding.
"""

from __future__ import annotations

from typing import Any

from .common import Ctx, Outcome, compose, expect, free_port, init_world, one_rank_backend, small_overrides
from .control import synthetic_batches
from .probes import grads_of, max_rel_error, one_rank_mesh

SHAPE = {"gpu": (4, 512, 16, 128), "cpu": (2, 64, 4, 64)}  # batch, sequence, heads, head_dim
EPS = 1e-6
MODEL_BOUND = {"float32": 1e-5, "bfloat16": 2e-2}


def _norm_and_grads(x: Any, w: Any, g: Any) -> tuple[Any, Any, Any]:
    """weight * F.rms_norm(x) and the gradients of <it, g> for x and the weight: full tensors."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = w * F.rms_norm(x, (x.shape[-1],), eps=EPS)
    out.backward(g)
    return full(out).detach(), full(x.grad), full(w.grad)


def _op(ctx: Ctx, mesh: Any, dtype: Any) -> dict[str, float]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator(device=ctx.device).manual_seed(2)
    shape = SHAPE["cpu" if ctx.cpu else "gpu"]
    x, g = (torch.randn(shape, generator=gen, device=ctx.device) for _ in range(2))
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen, device=ctx.device)

    def leaves(dt: Any, dtensor: bool) -> tuple[Any, Any, Any]:
        if not dtensor:
            return x.to(dt).requires_grad_(), w.to(dt).requires_grad_(), g.to(dt)
        return (
            distribute_tensor(x.to(dt), mesh, [Shard(2)]).requires_grad_(),
            distribute_tensor(w.to(dt), mesh, [Replicate()]).requires_grad_(),
            distribute_tensor(g.to(dt), mesh, [Shard(2)]),
        )

    ref = _norm_and_grads(*leaves(torch.float64, False))
    plain = _norm_and_grads(*leaves(dtype, False))
    dt = _norm_and_grads(*leaves(dtype, True))
    floor = 1e-6 if dtype == torch.float32 else 1e-3
    out = {}
    for name, a, b, r in zip(("out", "dx", "dw"), dt, plain, ref):
        error, own = max_rel_error(a, r), max_rel_error(b, r)
        expect(
            error <= 2 * own + floor,
            f"F.rms_norm on DTensors ({str(dtype).removeprefix('torch.')}): {name} off "
            f"fp64 by {error:.2e}, plain tensors by {own:.2e}",
        )
        out[name] = error
    return out


def _model(ctx: Ctx, mesh: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    from hpctrain.config.layout import resolve_layout
    from hpctrain.models import create_model
    from hpctrain.parallel.engine import token_loss
    from hpctrain.parallel.tensor_parallel import apply_tp
    from hpctrain.train.loop import load_config

    cfg = load_config(compose(ctx, [*small_overrides(ctx, "rms", 1, 1, model="qwen3_tiny"), "checkpoint=none"]))
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    batch = synthetic_batches(cfg, resolve_layout(cfg), cfg.train.seed, 1)[0]
    x, y = batch[0, 0].to(ctx.device), batch[1, 0].to(ctx.device)
    results = {}
    for name in ("plain", "tp"):
        with torch.device("meta"):
            model = create_model(cfg.model, 1)
        if name == "tp":
            apply_tp(model, mesh, sequence_parallel=True)
        model.to_empty(device=ctx.device)
        model.init_weights(seed=cfg.train.seed)
        model = model.to(dtype)
        logits = model(x)
        token_loss(logits, y, cfg.model.vocab_size).backward()
        grads = grads_of(model)
        if isinstance(logits, DTensor):  # TP keeps the logits split by vocabulary (loss parallelism)
            logits = logits.full_tensor()
        results[name] = (logits.detach(), {n: g for n, g in grads.items() if ".norm_q." in n or ".norm_k." in n})
    (plain, plain_grads), (tp, tp_grads) = results["plain"], results["tp"]
    expect(
        bool(plain_grads) and sorted(plain_grads) == sorted(tp_grads),
        "qwen3_tiny: no per-head norm weights, or their names differ under TP",
    )
    logits_error = max_rel_error(tp, plain)
    grad_error = max(max_rel_error(tp_grads[n], g) for n, g in plain_grads.items())
    bound = MODEL_BOUND[str(dtype).removeprefix("torch.")]
    expect(
        logits_error <= bound and grad_error <= bound,
        f"qwen3_tiny with TP on one rank vs plain ({str(dtype).removeprefix('torch.')}): logits {logits_error:.2e},"
        f" q/k norm weight gradients {grad_error:.2e} (relative, bound {bound:g})",
    )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "logits_error": logits_error,
        "norm_grad_error": grad_error,
        "norms": len(plain_grads),
    }


def check_rms(ctx: Ctx) -> Outcome:
    import torch

    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    mesh = one_rank_mesh(ctx.device, ("tp",))
    ops = {str(dt).removeprefix("torch."): _op(ctx, mesh, dt) for dt in (torch.float32, torch.bfloat16)}
    model = _model(ctx, mesh)
    if not ctx.cpu:
        torch.cuda.synchronize()
    numbers = {"backend": backend, "op_errors_vs_fp64": ops, "model": model}
    op_text = ", ".join(f"{dt} {max(e.values()):.1e}" for dt, e in ops.items())
    return Outcome(
        True,
        f"weight * F.rms_norm(x Shard(2)) on a 1-rank tp mesh, out/dx/dw vs fp64: {op_text}; "
        f"qwen3_tiny TP vs plain ({model['dtype']}): logits {model['logits_error']:.0e}, "
        f"{model['norms']} q/k norm grads {model['norm_grad_error']:.0e}",
        numbers,
    )
