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
        parts, chunks_s = _timed(lambda: [chunk_attention(shard_sequence(q, CP, r, dim=2), k, v, CP, r)
                                          for r in range(CP)], sync)
    error = max(float((part - shard_sequence(full, CP, r, dim=2)).abs().max()) for r, part in enumerate(parts))
    bound = 1e-5 if ctx.cpu else 2e-2  # bf16: the kernels' block order differs between the calls
    expect(error <= bound, f"CP {CP} chunks differ from full causal attention by {error:.2e} (bound {bound:g})")
    ratio = chunks_s / full_s
    numbers = {"cp": CP, "seq": s, "heads": hq, "kv_heads": hkv, "dtype": str(dtype), "max_abs_error": error,
               "chunks_over_full_time": ratio}
    kernel = "flash only" if not ctx.cpu else "CPU SDPA"
    return Outcome(True, f"CP {CP}, seq {s}, GQA {hq}/{hkv}, {kernel}: max error {error:.1e}; the {2 * CP} chunks "
                         f"take {ratio:.2f}x one full causal call", numbers)
