"""Context parallelism: the sequence is split over a CP group, attention all-gathers keys and values.

Causal load balancing: the sequence is cut into 2 * cp chunks and CP rank r holds chunk r and its mirror
2 cp - 1 - r. Under the causal mask an early chunk attends to few keys and a late one to many, so each rank gets
one of each and every rank does the same work (a plain split would leave rank 0 nearly idle and the last rank
with the most). Attention gathers every rank's keys and values (what Llama 3 did, simpler than a ring and
cheap with grouped-query attention's few KV heads), puts them back in global order and computes each local
chunk against the keys up to and including its own chunk.

This module owns the chunking (positions a rank holds, sharding a batch) and the attention; model code only calls
its attention core (hpctrain.models.attention), which `apply_context_parallel` replaces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from hpctrain.models.attention import CausalAttention, grouped_kv, set_attention


def chunk_size(seq_len: int, cp: int) -> int:
    """The length of one of the 2 * cp chunks; refuses a sequence that does not cut evenly."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(f"context parallelism cuts the sequence into 2 * cp chunks: seq_len {seq_len} is not "
                         f"divisible by 2 * cp = {2 * cp}")
    return seq_len // (2 * cp)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks CP rank `rank` holds, in its local order: chunk r, then its mirror 2 cp - 1 - r."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a CP group of {cp}")
    return rank, 2 * cp - 1 - rank


def chunk_order(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions CP rank `rank` holds, in its local order ([seq_len / cp], int64)."""
    c = chunk_size(seq_len, cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def gathered_to_global(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The index that puts a rank-major gather of every rank's local sequence back in global order:
    `gathered[..., index, :]` is position 0, 1, ..., seq_len - 1."""
    held = torch.cat([chunk_order(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of a batch tensor (tokens, labels, positions: [b, s, ...]) CP rank `rank` holds, along `dim`."""
    return t.index_select(dim, chunk_order(t.shape[dim], cp, rank, t.device))


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's chunks against the whole sequence's keys and values.

    q [B, Hq, L, D], k and v [B, Hkv, L, D] hold this rank's two chunks (L = seq_len / cp, chunk_order's order).
    Keys and values are all-gathered over `group` with autograd (the backward reduce-scatters each rank's
    key/value gradients back to their owner) and restored to global order. The gathers are functional collectives
    (`_c10d_functional.all_gather_into_tensor` + `wait_tensor`): the ops the selective recomputation policy saves
    (so backward does not gather again) and torch.compile traces. Chunk i attends to the keys of chunks 0..i,
    with the causal diagonal aligned bottom-right (`causal_lower_right`): SDPA's is_causal with fewer queries
    than keys aligns top-left, which would be wrong here. Grouped-query attention gathers the few key/value heads
    and only then repeats them where SDPA needs that (`grouped_kv`). Returns [B, Hq, L, D] like SDPA.
    """
    cp = dist.get_world_size(group)
    order = gathered_to_global(q.shape[2] * cp, cp, q.device)
    keys = all_gather_single_autograd(k.contiguous(), 2, group).index_select(2, order)
    values = all_gather_single_autograd(v.contiguous(), 2, group).index_select(2, order)
    return chunk_attention(q, keys, values, cp, dist.get_rank(group))


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """CP rank `rank`'s two query chunks (q [B, Hq, s / cp, D], chunk_order's order) against the whole sequence's
    keys and values in global order ([B, Hkv, s, D]): chunk i against keys [0, end of chunk i), one SDPA call each
    with the causal diagonal aligned bottom-right. The part of `cp_attention` after the gathers (tools/gpu_check's
    CP check runs it on one GPU, every rank's part in turn)."""
    c = chunk_size(keys.shape[2], cp)
    keys, values, gqa = grouped_kv(q, keys, values)
    outs = []
    for local, chunk in enumerate(chunk_ids(cp, rank)):
        end = (chunk + 1) * c
        outs.append(F.scaled_dot_product_attention(
            q[:, :, local * c:(local + 1) * c], keys[:, :, :end], values[:, :, :end],
            attn_mask=_lower_right(c, end), enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def _lower_right(queries: int, keys: int) -> CausalBias:
    """The causal mask aligned bottom-right, made outside any dispatch mode: CausalBias is a tensor subclass, and
    creating one under selective recomputation's mode (torch's SAC) fails in torch 2.13 ("the raw Tensor object
    is already associated to a python object"). It holds no data; SDPA reads its variant and sizes."""
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


class ContextParallelAttention(CausalAttention):
    """The attention core of a model whose tokens are this CP rank's two chunks: their global positions (position
    embeddings, RoPE) and `cp_attention` over `group`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def full_length(self, local: int) -> int:
        return local * self.cp

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        return chunk_order(local * self.cp, self.cp, self.rank, device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0) -> torch.Tensor:
        if dropout_p:
            raise ValueError("context parallelism does not take attention dropout: set model.dropout: 0")
        return cp_attention(q, k, v, self.group)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make `model` (whole, or a pipeline stage) take this CP rank's chunks (`shard_sequence`) of every sequence."""
    set_attention(model, ContextParallelAttention(group))
