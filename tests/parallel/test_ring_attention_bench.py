"""The bench's ring attention and its all-gather twin with the same kernels (bench/ring_attention.py) are exact: on
2 and 4 gloo ranks, fp32, the output and the gradients of q, k and v equal one process's full causal SDPA on the
whole sequence (GQA and plain multi-head)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.ring_attention import allgather_flash_attention, ring_attention
from hpctrain.parallel.context_parallel import shard_sequence
from tests.distributed_harness import run_distributed

B, HEADS, SEQ, HEAD_DIM = 2, 4, 48, 16


def _inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=g)
    dout = torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=g)
    return q, k, v, dout


def _ring_rank(rank: int, world: int, kv_heads: int, design: str) -> list[torch.Tensor]:
    q, k, v, dout = (shard_sequence(t, world, rank, dim=2) for t in _inputs(kv_heads))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attention = ring_attention if design == "ring" else allgather_flash_attention
    out = attention(q, k, v, dist.group.WORLD)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("design", ["ring", "allgather_flash"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [2, HEADS])
def test_ring_attention_equals_full_causal_sdpa(cp: int, kv_heads: int, design: str) -> None:
    q, k, v, dout = _inputs(kv_heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != HEADS)
    out.backward(dout)
    expected = [out.detach(), q.grad, k.grad, v.grad]
    for rank, got in enumerate(run_distributed(_ring_rank, cp, kv_heads, design, timeout=60)):
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
            torch.testing.assert_close(
                g,
                shard_sequence(e, cp, rank, dim=2),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, n=name, r=rank: f"{design} cp {cp} rank {r} {n}: {m}",
            )
