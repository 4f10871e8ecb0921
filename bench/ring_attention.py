"""Ring attention for hpctrain's load-balanced CP layout: bench-only, the alternative to cp_attention's all-gather.

Same layout and contract as hpctrain.parallel.context_parallel.cp_attention: CP rank r holds chunk r and chunk
2 cp - 1 - r of 2 cp chunks (q [B, Hq, L, D], k and v [B, Hkv, L, D], L = seq_len / cp, chunk_order's order) and
gets causal attention of its queries against the whole sequence's keys, [B, Hq, L, D].

Forward: cp steps. At step s this rank holds the key/value block of CP rank (r - s) mod cp (its two chunks); it
posts the block's send to rank r + 1 and the next block's receive from rank r - 1 (one stacked K/V tensor,
`dist.batch_isend_irecv`: 1 send + 1 receive a step, cp - 1 steps), computes each local query chunk against the
block while the message travels, and waits. Per (query chunk, key chunk) pair the mask is by chunk ids: key chunk
before the query chunk -> no mask, the same chunk -> causal (square, so top-left = bottom-right), after -> skipped.
Each piece is the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the output
and its log-sum-exp and takes GQA's fewer key/value heads as they are); the pieces are merged with their
log-sum-exps in fp32.

Backward (an autograd.Function, since the P2P ops are not autograd-aware): the flash backward kernel per piece,
given the merged output and log-sum-exp, yields exactly that piece's share of dq, dk, dv. The blocks received in
forward are kept (the same memory as the all-gather's gathered K/V; a memory-frugal ring would pass K/V round again
in backward). dK/dV accumulators travel the ring: at step s this rank adds its contribution for block (r - s) to
the accumulator received from r - 1 and sends it on, the next block's contribution computed while it travels;
after cp - 1 steps one more send brings each accumulator home: cp sends in backward.

`allgather_flash_attention` is the all-gather design with exactly these kernels (one functional all-gather of the
stacked K/V, a reduce-scatter backward), so that the bench can tell the communication pattern from the kernel choice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd

from hpctrain.parallel.context_parallel import chunk_ids, chunk_size

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _shift(t: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Post the send of t to the next CP rank and the receive of the previous rank's; (buffer, works)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    buf = torch.empty_like(t)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, buf, prv, group)])
    return buf, works


def _pieces(q_chunk: int, owner: int, cp: int, c: int) -> list[tuple[int, int, bool]]:
    """(key start, key end, causal) within the block of CP rank `owner` that query chunk `q_chunk` attends to."""
    out = []
    for local, k_chunk in enumerate(chunk_ids(cp, owner)):
        if k_chunk < q_chunk:
            if out and not out[-1][2] and out[-1][1] == local * c:  # merge neighbouring unmasked chunks
                out[-1] = (out[-1][0], (local + 1) * c, False)
            else:
                out.append((local * c, (local + 1) * c, False))
        elif k_chunk == q_chunk:
            out.append((local * c, (local + 1) * c, True))
    return out


def _forward_block(qs, outs, lses, kv, owner, rank, cp, c) -> None:
    """Merge the block of CP rank `owner` (stacked K/V) into each local query chunk's output and log-sum-exp."""
    for a, q_chunk in enumerate(chunk_ids(cp, rank)):
        for start, end, causal in _pieces(q_chunk, owner, cp, c):
            o, lse = _flash(qs[a], kv[0, :, :, start:end], kv[1, :, :, start:end], 0.0, causal)
            if outs[a] is None:
                outs[a], lses[a] = o.float(), lse
            else:
                new = torch.logaddexp(lses[a], lse)
                outs[a] = outs[a] * (lses[a] - new).exp().unsqueeze(-1) + o.float() * (lse - new).exp().unsqueeze(-1)
                lses[a] = new


def _backward_block(grads, qs, outs, lses, dqs, kv, owner, rank, cp, c) -> torch.Tensor:
    """The block of CP rank `owner`'s dK/dV (stacked, fp32) from the local query chunks; adds their dq to dqs."""
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    for a, q_chunk in enumerate(chunk_ids(cp, rank)):
        for start, end, causal in _pieces(q_chunk, owner, cp, c):
            dq, dk, dv = _flash_bwd(
                grads[a], qs[a], kv[0, :, :, start:end], kv[1, :, :, start:end], outs[a], lses[a], 0.0, causal
            )
            dqs[a] += dq
            dkv[0, :, :, start:end] += dk
            dkv[1, :, :, start:end] += dv
    return dkv


def _split(q: torch.Tensor, c: int) -> list[torch.Tensor]:
    return [q[:, :, a * c : (a + 1) * c].contiguous() for a in range(2)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):  # type: ignore[override]
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c = chunk_size(q.shape[2] * cp, cp)
        qs, outs, lses = _split(q, c), [None, None], [None, None]
        kv = torch.stack([k, v]).contiguous()
        blocks = []
        for s in range(cp):
            blocks.append(kv)
            nxt, works = _shift(kv, group) if s < cp - 1 else (None, [])
            _forward_block(qs, outs, lses, kv, (rank - s) % cp, rank, cp, c)  # while the next block travels
            for w in works:
                w.wait()
            kv = nxt
        outs = [o.to(q.dtype) for o in outs]
        ctx.group, ctx.c = group, c
        ctx.save_for_backward(*qs, *outs, *lses, *blocks)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group, c = ctx.group, ctx.c
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        saved = ctx.saved_tensors
        qs, outs, lses, blocks = saved[0:2], saved[2:4], saved[4:6], saved[6:]
        grads = _split(grad, c)
        dqs = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
        acc = _backward_block(grads, qs, outs, lses, dqs, blocks[0], rank, rank, cp, c)
        for s in range(1, cp):
            received, works = _shift(acc, group)
            contribution = _backward_block(grads, qs, outs, lses, dqs, blocks[s], (rank - s) % cp, rank, cp, c)
            for w in works:  # the contribution was computed while the accumulator travelled
                w.wait()
            acc = received + contribution
        if cp > 1:
            acc, works = _shift(acc, group)
            for w in works:
                w.wait()
        return torch.cat(dqs, dim=2).to(grad.dtype), acc[0].to(grad.dtype), acc[1].to(grad.dtype), None


class _GatheredBlocks(torch.autograd.Function):
    """The ring's computation on K/V already all-gathered (rank-major blocks along dim 3 of stacked K/V)."""

    @staticmethod
    def forward(ctx, q, kv_all, cp, rank):  # type: ignore[override]
        c = chunk_size(q.shape[2] * cp, cp)
        qs, outs, lses = _split(q, c), [None, None], [None, None]
        length = 2 * c
        for owner in range(cp):
            _forward_block(qs, outs, lses, kv_all[:, :, :, owner * length : (owner + 1) * length], owner, rank, cp, c)
        outs = [o.to(q.dtype) for o in outs]
        ctx.cp, ctx.rank, ctx.c = cp, rank, c
        ctx.save_for_backward(*qs, *outs, *lses, kv_all)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        cp, rank, c = ctx.cp, ctx.rank, ctx.c
        q0, q1, o0, o1, l0, l1, kv_all = ctx.saved_tensors
        qs, outs, lses, grads = (q0, q1), (o0, o1), (l0, l1), _split(grad, c)
        dqs = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
        length = 2 * c
        dkv = torch.cat(
            [
                _backward_block(
                    grads, qs, outs, lses, dqs, kv_all[:, :, :, j * length : (j + 1) * length], j, rank, cp, c
                )
                for j in range(cp)
            ],
            dim=3,
        )
        return torch.cat(dqs, dim=2).to(grad.dtype), dkv.to(grad.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this CP rank's two chunks against the whole sequence, K/V passed round a ring."""
    return _RingAttention.apply(q, k, v, group)


def allgather_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The all-gather design with the ring's kernels: one functional all-gather of stacked K/V (autograd: a
    reduce-scatter backward), then the same unmasked / causal flash pieces merged by log-sum-exp. Isolates the
    communication pattern from cp_attention's masked SDPA."""
    kv_all = all_gather_single_autograd(torch.stack([k, v]).contiguous(), 3, group)
    return _GatheredBlocks.apply(q, kv_all, dist.get_world_size(group), dist.get_rank(group))
