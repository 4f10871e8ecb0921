"""The attention core the models call, replaceable from outside so that model code stays free of parallelism.

A model's attention modules and the model itself (for its positions) hold a `CausalAttention` in `attention`.
The default sees the whole sequence on this process. hpctrain.parallel.context_parallel swaps in one whose
tokens are chunks of a longer sequence (`set_attention`): it says the true global positions of the local tokens
(learned position embeddings, RoPE) and computes causal attention against the keys of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sdpa_expands_kv(dtype: torch.dtype, device_type: str, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether grouped-query attention should repeat its key/value heads before SDPA (instead of enable_gqa=True),
    because on this device and dtype no fused kernel accepts fewer key/value heads than query heads, while the
    memory-efficient one accepts the repeated heads. Otherwise SDPA would pick its math kernel, which repeats the
    heads itself and materialises the [B, heads, T, T] scores (fp32 softmax) for backward.

    torch 2.13's rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; sdp_utils_cpp.h for
    check_batch_size_and_num_heads_dense, which only admits Hq != Hkv for a backend compiled with supports_gqa):
      flash      sm80-sm121 (A100, H100/H200): fp16/bf16 only (check_dtypes_flash_attention; FA3 adds fp8), q/k/v
                 head_dim equal and <= 256, no attn_mask; dense constraints supports_gqa = true.
      cuDNN      fp16/bf16 only (check_dtypes_low_precision); head_dim <= 128 (256 on sm90/sm10x with a recent
                 cuDNN), a multiple of 8; GQA accepted (supports_gqa, requires_same_num_heads = false).
      efficient  fp16/fp32/bf16 on sm80+, but check_batch_size_and_num_heads_dense<false> (no GQA): Hq must equal
                 Hkv. (GQA for this kernel came later, pytorch PR #191085: the installed 2.13's meta kernel for
                 _scaled_dot_product_efficient_attention_backward still shapes grad_k by the query heads, and its
                 dispatcher still rejects the implicit MQA broadcast that PR added.)
      math       anything (repeat_interleave of K/V, then the explicit scores).
    So on CUDA: bf16/fp16 with head_dim <= 256 -> flash (or cuDNN, first on sm90 with a recent cuDNN) runs GQA:
    keep enable_gqa. fp32 -> neither flash nor cuDNN take the dtype and efficient rejects GQA, only math would:
    repeat the heads (what Hugging Face's repeat_kv does) so efficient attention runs. Same for 16-bit with
    head_dim > 256. fp64 has no fused CUDA kernel either way: nothing gained by repeating.
    CPU: torch 2.13's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu) takes enable_gqa in every
    dtype (checked on the installed build), so never. Other devices (meta, fake tensors' "meta"): never.
    Under autocast, q is already in the autocast dtype (the QKV projection autocasts), so callers pass q.dtype.
    Pure: dtype, device type and ints, nothing read from a tensor (fine on meta/fake tensors, under compile).
    """
    if n_heads == n_kv_heads or device_type != "cuda":
        return False
    if dtype == torch.float32:
        return True
    return dtype in (torch.float16, torch.bfloat16) and head_dim > 256


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """k and v as SDPA should take them for q's heads, and whether to pass enable_gqa: with fewer key/value heads
    than query heads, repeated (query head g * group + j reads key/value head g, SDPA's enable_gqa order) where
    `sdpa_expands_kv` says no fused kernel takes them grouped, else kept grouped."""
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_heads == n_kv_heads:
        return k, v, False
    if sdpa_expands_kv(q.dtype, q.device.type, n_heads, n_kv_heads, q.shape[-1]):
        group = n_heads // n_kv_heads
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return k, v, True


class CausalAttention:
    """Causal self-attention over the whole sequence held by this process."""

    def full_length(self, local: int) -> int:
        """The length of the sequence `local` tokens are part of (positions are below it)."""
        return local

    def positions(self, local: int, device: torch.device) -> torch.Tensor | None:
        """The global positions of the `local` tokens, or None when they are 0 .. local - 1 (nothing to index)."""
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0) -> torch.Tensor:
        """q [B, Hq, T, D], k and v [B, Hkv, T, D] (Hkv divides Hq) -> [B, Hq, T, D]: SDPA with the causal mask."""
        k, v, gqa = grouped_kv(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)


def set_attention(model: nn.Module, core: CausalAttention) -> None:
    """Make every module of `model` that holds an attention core (the attention modules, the model for its
    positions) use `core`."""
    for module in model.modules():
        if isinstance(getattr(module, "attention", None), CausalAttention):
            # a plain attribute: nn.Module's __setattr__ is typed for tensors and submodules only
            module.attention = core  # type: ignore[assignment]
