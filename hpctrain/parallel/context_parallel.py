"""Context parallelism: the sequence is split over a CP group, attention all-gathers keys and values.

Causal load balancing: the sequence is cut into 2 * cp chunks and CP rank r holds chunk r and its mirror
2 cp - 1 - r. Under the causal mask an early chunk attends to few keys and a late one to many, so each rank gets
one of each and every rank does the same work (a plain split would leave rank 0 nearly idle and the last rank
with the most). Attention gathers every rank's keys and values (what Llama 3 did, simpler than a ring and
cheap with grouped-query attention's few KV heads), puts them back in global order and computes each local
chunk against the keys up to and including its own chunk.

This module owns the chunking (positions a rank holds, sharding a batch) and the attention; model code only calls
its attention core (hpctrain.models.common.attention), which `apply_context_parallel` replaces.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from hpctrain.models.common.attention import CausalAttention, grouped_kv, sdpa_expands_kv, set_attention


def chunk_size(seq_len: int, cp: int) -> int:
    """The length of one of the 2 * cp chunks; refuses a sequence that does not cut evenly."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism cuts the sequence into 2 * cp chunks: seq_len {seq_len} is not "
            f"divisible by 2 * cp = {2 * cp}"
        )
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


class Indices(NamedTuple):
    """The index tensors and masks of one (sequence length, cp, rank, device): what CP's attention and the model's
    positions need in every layer."""

    positions: torch.Tensor  # chunk_order: the global positions this rank holds, in its local order
    to_global: torch.Tensor  # gathered_to_global: puts a rank-major gather back in global order
    masks: tuple[CausalBias, CausalBias]  # each local chunk's bottom-right causal mask against its key prefix


def build_indices(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Indices:
    """`Indices` for a sequence of `seq_len` over `cp` ranks, as CP rank `rank` needs them on `device`."""
    c = chunk_size(seq_len, cp)
    with torch.inference_mode(False):  # normal tensors even if built in an evaluation: training saves them
        positions = chunk_order(seq_len, cp, rank, device)
        to_global = gathered_to_global(seq_len, cp, device)
    masks = tuple(_lower_right(c, (chunk + 1) * c) for chunk in chunk_ids(cp, rank))
    return Indices(positions, to_global, masks)  # type: ignore[arg-type]


class IndexCache:
    """`build_indices`, once per (sequence length, cp, rank, device): every layer of every step reuses them instead
    of building (on a GPU: launching arange, cat and argsort kernels for) the same few index tensors each call.
    Small (LRU, `size` entries: training uses one length, evaluation perhaps another). Nothing is kept where the
    tensors would belong to a trace or a fake tensor mode (torch.compile, fake CUDA's simulation, meta
    estimates): those build per call as before (the same rule as hpctrain.models.llama.model's RoPE tables)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[int, int, int, torch.device], Indices] = OrderedDict()

    def __call__(self, seq_len: int, cp: int, rank: int, device: torch.device) -> Indices:
        if (
            torch.compiler.is_compiling()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
        ):
            return build_indices(seq_len, cp, rank, device)
        key = (seq_len, cp, rank, torch.device(device))
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            return found
        found = self._entries[key] = build_indices(seq_len, cp, rank, device)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return found


def cp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, indices: IndexCache | None = None
) -> torch.Tensor:
    """Causal attention of this rank's chunks against the whole sequence's keys and values.

    q [B, Hq, L, D], k and v [B, Hkv, L, D] hold this rank's two chunks (L = seq_len / cp, chunk_order's order).
    Keys and values are all-gathered over `group` with autograd (the backward reduce-scatters each rank's
    key/value gradients back to their owner) and restored to global order. The gathers are functional collectives
    (`_c10d_functional.all_gather_into_tensor` + `wait_tensor`): the ops the selective recomputation policy saves
    (so backward does not gather again) and torch.compile traces. Chunk i attends to the keys of chunks 0..i,
    with the causal diagonal aligned bottom-right (`causal_lower_right`): SDPA's is_causal with fewer queries
    than keys aligns top-left, which would be wrong here. Grouped-query attention gathers the few key/value heads
    and only then repeats them where SDPA needs that (`grouped_kv`). Returns [B, Hq, L, D] like SDPA.
    The index tensors and masks come from `indices` (a model's `ContextParallelAttention` holds one cache for all
    its layers); without one they are built for this call.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[2] * cp
    built = (indices or build_indices)(seq_len, cp, rank, q.device)
    keys = all_gather_single_autograd(k.contiguous(), 2, group).index_select(2, built.to_global)
    values = all_gather_single_autograd(v.contiguous(), 2, group).index_select(2, built.to_global)
    return chunk_attention(q, keys, values, cp, rank, masks=built.masks)


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cp: int,
    rank: int,
    masks: tuple[CausalBias, CausalBias] | None = None,
) -> torch.Tensor:
    """CP rank `rank`'s two query chunks (q [B, Hq, s / cp, D], chunk_order's order) against the whole sequence's
    keys and values in global order ([B, Hkv, s, D]): chunk i against keys [0, end of chunk i), one SDPA call each
    with the causal diagonal aligned bottom-right (`masks`, `Indices.masks`; made here when not given). The part of
    `cp_attention` after the gathers (tools/gpu_check's CP check runs it on one GPU, every rank's part in turn).

    The kernel (`gpu_chunk_kernel`): SDPA hands a `CausalBias` mask to `CausalBias._dispatch`, which does not give
    SDPA's kernels a mask at all: it asks flash's rules about the call WITHOUT a mask (grouped-query heads
    included: flash takes them) and calls `_scaled_dot_product_flash_attention(is_causal=True)` directly, whose
    causal diagonal is bottom-right; failing that the memory-efficient kernel with its own lower-right mask
    variant (`_efficient_attention_forward(custom_mask_type=2)`, equal head counts only); only then math with the
    materialised mask. So bf16/fp16 chunks with grouped-query heads run flash with the heads grouped, and fp32
    runs memory-efficient attention on the heads `grouped_kv` repeats: a fused kernel, O(L) memory, in every
    dtype a GPU trains in. Two alternatives were weighed and not taken: repeating the key/value heads whenever a
    mask is passed changes nothing in the kernel on sm80+ (flash runs either way) and keeps Hq / Hkv times the
    gathered keys and values for backward (Llama 3 405B at TP 8 x CP 16: 1 GiB a layer); splitting each chunk
    into an unmasked prefix and a square causal block merged by log-sum-exp needs the kernels' log-sum-exp, which
    SDPA does not return and whose aten outputs are not differentiable: a custom autograd function around the
    private kernels, to reach the same flash kernel. (On CPU the mask is materialised, [c, end] booleans a chunk,
    and the CPU flash kernel computes the masked blocks too: a CPU cost only, docs/context_parallel.md.)
    """
    c = chunk_size(keys.shape[2], cp)
    keys, values, gqa = grouped_kv(q, keys, values)
    outs = []
    for local, chunk in enumerate(chunk_ids(cp, rank)):
        end = (chunk + 1) * c
        mask = masks[local] if masks is not None else _lower_right(c, end)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, local * c : (local + 1) * c],
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=mask,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, dim=2)


SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def gpu_chunk_kernel(dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
    """ "flash", "efficient" or "math": the kernel `chunk_attention` runs on an sm80+ GPU (A100, H100/H200) under
    torch 2.13, for q of `dtype` with `n_heads` heads against `n_kv_heads` gathered key/value heads of `head_dim`.

    `grouped_kv` first (`sdpa_expands_kv`: repeat the key/value heads in fp32, or in 16 bits past head_dim 256),
    then `CausalBias._dispatch` of a bottom-right mask with fewer queries than keys (torch/nn/attention/bias.py):
      flash      fp16/bf16, head_dim <= 256 (padded to a multiple of 8 by CausalBias itself), grouped heads
                 accepted (flash's check_batch_size_and_num_heads_dense<supports_gqa = true>); no mask reaches
                 the kernel's rules, so the "no attn_mask" rule does not refuse it;
      efficient  fp16/bf16/fp32 with equal head counts (no GQA in 2.13) and head_dim a multiple of 8 in 16 bits,
                 4 in fp32 (minimum_gemm_alignment): the kernel's own lower-right variant;
      math       anything else (fp64; 16-bit grouped heads past 256 are repeated, so efficient): the
                 materialised mask and [B, H, c, end] scores.
    Pure: a dtype and ints (what fake CUDA's attention routing needs for a CausalBias mask)."""
    if sdpa_expands_kv(dtype, "cuda", n_heads, n_kv_heads, head_dim):
        n_kv_heads = n_heads
    if dtype in SIXTEEN_BIT and head_dim <= 256:
        return "flash"
    alignment = 8 if dtype in SIXTEEN_BIT else 4
    if dtype in (*SIXTEEN_BIT, torch.float32) and n_heads == n_kv_heads and head_dim % alignment == 0:
        return "efficient"
    return "math"


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
        self.indices = IndexCache()  # one per model: every layer's positions, gather order and masks

    def full_length(self, local: int) -> int:
        return local * self.cp

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        return self.indices(local * self.cp, self.cp, self.rank, device).positions

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0) -> torch.Tensor:
        if dropout_p:
            raise ValueError("context parallelism does not take attention dropout: set model.dropout: 0")
        return cp_attention(q, k, v, self.group, self.indices)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Make `model` (whole, or a pipeline stage) take this CP rank's chunks (`shard_sequence`) of every sequence."""
    set_attention(model, ContextParallelAttention(group))
