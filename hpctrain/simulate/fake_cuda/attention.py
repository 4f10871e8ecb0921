"""The attention kernel a GPU runs, on fake CUDA: SDPA routed to the fused op torch 2.13 picks on an H100.

On the CPU build `scaled_dot_product_attention` asks its CUDA choice stub, which has no kernel here, and takes the
math path: [B, H, T, T] scores kept for backward. A GPU takes flash (or cuDNN, or memory-efficient) attention,
which keeps O(T) per head. The fused ops' meta functions exist in the CPU build, so routing SDPA to the one a GPU
would pick makes forward and backward allocate what a GPU allocates (a simulation's activations column).

The choice follows aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(hpctrain.models.common.attention.sdpa_expands_kv states the same rules): flash for fp16/bf16 with equal q/k/v
head sizes <= 256 (a multiple of 8) and no explicit mask, grouped-query heads included; else memory-efficient for
fp16/bf16/fp32 with equal head counts (a mask allowed); else math. cuDNN attention keeps what flash keeps (output
and log-sum-exp), so flash stands for both. A CausalBias mask (context parallelism's chunks) is not a mask to those
rules: torch's CausalBias._dispatch runs flash's or memory-efficient attention's own causal variants
(`_causal_bias`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from hpctrain.parallel.context_parallel import SIXTEEN_BIT, gpu_chunk_kernel

aten = torch.ops.aten


def gpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, enable_gqa: bool) -> str:
    """ "flash", "efficient" or "math": what SDPA runs on an H100 for these inputs."""
    d = q.shape[-1]
    same_dims = k.shape[-1] == d and v.shape[-1] == d
    if q.dtype in SIXTEEN_BIT and same_dims and d <= 256 and d % 8 == 0 and attn_mask is None:
        return "flash"
    grouped = enable_gqa and k.shape[-3] != q.shape[-3]
    if q.dtype in (*SIXTEEN_BIT, torch.float32) and same_dims and not grouped and d % (16 // q.element_size()) == 0:
        return "efficient"
    return "math"


class GpuAttention:
    """While entered, SDPA on "cuda" tensors runs the kernel `gpu_kernel` picks; `kernels` counts the choices.

    It replaces torch.nn.functional.scaled_dot_product_attention for the process (a fake-CUDA process is one
    simulation's): recomputation replays a block's forward on autograd's device thread, where a TorchFunctionMode
    of the main thread is not active, and the replay must save what the forward saved."""

    def __init__(self) -> None:
        self.kernels: Counter[str] = Counter()
        self._original: Any = None

    def __enter__(self) -> GpuAttention:
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = self._original

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if query.device.type != "cuda":
            return self._original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        if isinstance(attn_mask, CausalBias):  # torch's CausalBias._dispatch, not SDPA's rules for a mask
            return self._causal_bias(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
        kernel = gpu_kernel(query, key, value, attn_mask, enable_gqa)
        self.kernels[kernel] += 1
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
        if kernel == "efficient":
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )[0]
        # math, through torch's own function
        F.scaled_dot_product_attention = self._original
        try:
            return self._original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        finally:
            F.scaled_dot_product_attention = self._sdpa

    def _causal_bias(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: CausalBias,
        dropout_p: float,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        """What `CausalBias._dispatch` (torch/nn/attention/bias.py) runs on a GPU: a square or top-left mask is
        SDPA's is_causal without a mask; a bottom-right one the kernel context parallelism's own rule names
        (`gpu_chunk_kernel`): flash with is_causal=True (bottom-right for that kernel), memory-efficient
        attention's own lower-right variant, or math with the mask materialised."""
        if bias.seq_len_q == bias.seq_len_kv or bias.variant == CausalVariant.UPPER_LEFT:
            return self._sdpa(query, key, value, None, dropout_p, True, scale=scale, enable_gqa=enable_gqa)
        kernel = gpu_chunk_kernel(query.dtype, query.shape[-3], key.shape[-3], query.shape[-1])
        if kernel == "flash":
            self.kernels["flash"] += 1
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, True, scale=scale)[0]
        if kernel == "efficient":
            self.kernels["efficient"] += 1
            return aten._efficient_attention_forward(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                None,
                None,
                None,
                None,
                None,
                dropout_p,
                int(bias.variant),
                True,
                scale=scale,
            )[0].transpose(1, 2)
        # math: the materialised mask through SDPA (counted there)
        return self._sdpa(
            query, key, value, bias._materialize(query.device), dropout_p, False, scale=scale, enable_gqa=enable_gqa
        )
