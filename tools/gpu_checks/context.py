"""Check cp (see tools/gpu_check.py): context parallelism's attention kernel on this device.

A CP rank computes each of its two chunks of queries against the key prefix up to the end of that chunk, with the
causal diagonal aligned bottom-right (`hpctrain.parallel.context_parallel.chunk_attention`, the part of the CP
attention after the all-gathers). On a GPU in bf16 that must run flash attention: the check allows SDPA's flash
backend only, so a fall back to the materialised mask (an s x s boolean per chunk, 512 MB at Llama 3's 131,072
tokens) fails instead of passing slowly. Every rank's part of a CP 4 layout is computed in turn on this one
device, gathered keys given whole, and compared with full causal attention; the time of the eight chunks against
one full causal call is reported (the same causal work: near 1 when the kernel skips masked blocks).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from .common import Ctx, Outcome, expect

CP = 4
SHAPES = {"gpu": (1, 16, 2, 8192, 128), "cpu": (1, 4, 2, 512, 32)}  # batch, query heads, key/value heads, seq, dim


def _timed(fn: Any, sync: Any, repeats: int = 3) -> tuple[Any, float]:
    out = fn()  # warm-up (kernel selection, allocator)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync()
    return out, (time.perf_counter() - start) / repeats


def check_cp(ctx: Ctx) -> Outcome:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hpctrain.parallel.context_parallel import chunk_attention, shard_sequence

    device = ctx.device
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    b, hq, hkv, s, d = SHAPES["cpu" if ctx.cpu else "gpu"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    only_flash = contextlib.nullcontext() if ctx.cpu else sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    with torch.no_grad(), only_flash:
        full, full_s = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), sync)
        parts, chunks_s = _timed(
            lambda: [chunk_attention(shard_sequence(q, CP, r, dim=2), k, v, CP, r) for r in range(CP)], sync
        )
    error = max(float((part - shard_sequence(full, CP, r, dim=2)).abs().max()) for r, part in enumerate(parts))
    bound = 1e-5 if ctx.cpu else 2e-2  # bf16: the kernels' block order differs between the calls
    expect(error <= bound, f"CP {CP} chunks differ from full causal attention by {error:.2e} (bound {bound:g})")
    ratio = chunks_s / full_s
    numbers = {
        "cp": CP,
        "seq": s,
        "heads": hq,
        "kv_heads": hkv,
        "dtype": str(dtype),
        "max_abs_error": error,
        "chunks_over_full_time": ratio,
    }
    kernel = "flash only" if not ctx.cpu else "CPU SDPA"
    return Outcome(
        True,
        f"CP {CP}, seq {s}, GQA {hq}/{hkv}, {kernel}: max error {error:.1e}; the {2 * CP} chunks "
        f"take {ratio:.2f}x one full causal call",
        numbers,
    )


# ---------------------------------------------------------------------------------------------------------
# cpb. CP's backward against full causal attention; cp_attention on a one-rank device group

GRAD_SHAPES = {"gpu": (1, 16, 2, 4096, 128), "cpu": (1, 4, 2, 256, 32)}  # batch, query heads, kv heads, seq, dim


def _attention_grads(fn: Any, q: Any, k: Any, v: Any, g: Any) -> tuple[Any, ...]:
    """fn(q, k, v) and the gradients of <fn(q, k, v), g> with respect to q, k, v (fresh leaves)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def check_cp_backward(ctx: Ctx) -> Outcome:
    """CP's backward: every rank's two query chunks of a CP 4 layout (`chunk_attention`, gathered keys given whole),
    in turn on this device, their output gradients summed into q, k and v as CP's reduce-scatter of the key/value
    gradients sums them; against full causal SDPA. Then `cp_attention` itself over a one-rank group of this world
    ("cpu:gloo,cuda:nccl": its key/value all-gather and, backward, reduce-scatter on NCCL), forward and backward.
    Both against a reference in higher precision (fp32 for bf16 on a GPU, fp64 for fp32 on the CPU): the CP
    errors must stay within twice full SDPA's own error in the same dtype, plus a floor."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hpctrain.parallel.context_parallel import chunk_attention, cp_attention, shard_sequence

    from .common import free_port, init_world, one_rank_backend
    from .probes import max_rel_error

    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    device = ctx.device
    dtype, ref_dtype = (torch.float32, torch.float64) if ctx.cpu else (torch.bfloat16, torch.float32)
    b, hq, hkv, s, d = GRAD_SHAPES["cpu" if ctx.cpu else "gpu"]
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, g = (torch.randn(b, h, s, d, generator=gen, device=device, dtype=dtype) for h in (hq, hkv, hkv, hq))

    def full(q: Any, k: Any, v: Any) -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def cp_chunks(q: Any, k: Any, v: Any) -> Any:  # every rank's part, put back in sequence order
        parts = [chunk_attention(shard_sequence(q, CP, r, dim=2), k, v, CP, r) for r in range(CP)]
        out = torch.empty_like(q)
        return out.index_copy(2, torch.cat([_positions(s, r, device) for r in range(CP)]), torch.cat(parts, dim=2))

    def one_rank(q: Any, k: Any, v: Any) -> Any:
        return cp_attention(q, k, v, dist.group.WORLD)

    with sdpa_kernel([SDPBackend.MATH]):  # the reference: math in higher precision
        ref = _attention_grads(full, *(t.to(ref_dtype) for t in (q, k, v, g)))
    fused = (
        contextlib.nullcontext()
        if ctx.cpu
        else sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    )
    with fused:
        runs = {
            name: _attention_grads(fn, q, k, v, g)
            for name, fn in (("full", full), ("cp4", cp_chunks), ("cp_attention", one_rank))
        }
    names = ("out", "dq", "dk", "dv")
    errors = {name: {n: max_rel_error(t, r) for n, t, r in zip(names, got, ref)} for name, got in runs.items()}
    floor = 1e-6 if ctx.cpu else 1e-3
    for name in ("cp4", "cp_attention"):
        for n in names:
            bound = 2 * errors["full"][n] + floor
            expect(
                errors[name][n] <= bound,
                f"{name}: {n} off the {str(ref_dtype).removeprefix('torch.')} reference "
                f"by {errors[name][n]:.2e} (relative), full causal SDPA by {errors['full'][n]:.2e}: bound "
                f"{bound:.2e}",
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    worst = {name: max(e.values()) for name, e in errors.items()}
    numbers = {
        "backend": backend,
        "cp": CP,
        "seq": s,
        "heads": hq,
        "kv_heads": hkv,
        "dtype": str(dtype),
        "errors": errors,
    }
    group = backend.split(",")[-1]
    return Outcome(
        True,
        f"seq {s}, GQA {hq}/{hkv}, {str(dtype).removeprefix('torch.')}: worst relative error of "
        f"out/dq/dk/dv vs {str(ref_dtype).removeprefix('torch.')}: CP {CP} chunks "
        f"{worst['cp4']:.1e}, cp_attention on a 1-rank {group} group {worst['cp_attention']:.1e}, "
        f"full SDPA {worst['full']:.1e}",
        numbers,
    )


def _positions(seq_len: int, rank: int, device: Any) -> Any:
    from hpctrain.parallel.context_parallel import chunk_order

    return chunk_order(seq_len, CP, rank, device)
