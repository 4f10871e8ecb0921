"""The planner's tests' models: a family and its Dims (hpctrain.models.family, the one owner of a model's shape),
spelled as a config spells them (key/value heads 0: as many as query heads; ffn_hidden 0: 4 x d_model)."""

from __future__ import annotations

from typing import Any

from hpctrain.models import registry
from hpctrain.models.family import Dims
from hpctrain.plan.types import ModelShape

GPT, LLAMA, QWEN3_MOE = registry.get("gpt"), registry.get("llama"), registry.get("qwen3_moe")


def dims(
    d_model: int,
    n_heads: int,
    *,
    n_layers: int = 1,
    vocab_size: int = 1,
    context: int = 1,
    kv_heads: int = 0,
    ffn_hidden: int = 0,
    head_dim: int = 0,
    n_experts: int = 0,
    top_k: int = 0,
    expert_hidden: int = 0,
    n_shared_experts: int = 0,
) -> Dims:
    """One block's widths (the layers, vocabulary and context only where a test counts them)."""
    return Dims(
        n_layers,
        d_model,
        n_heads,
        kv_heads or n_heads,
        ffn_hidden or 4 * d_model,
        vocab_size,
        context,
        head_dim,
        n_experts,
        top_k,
        expert_hidden,
        n_shared_experts,
    )


def shape(
    arch: str,
    n_layers: int,
    d_model: int,
    n_heads: int,
    seq_len: int,
    vocab_size: int,
    *,
    vocab_pad_multiple: int = 1,
    dropout: float = 0.0,
    context: int = 0,
    **widths: int,
) -> ModelShape:
    """A ModelShape of family `arch` trained on `seq_len` tokens; context (GPT's position table): seq_len when 0."""
    d = dims(d_model, n_heads, n_layers=n_layers, vocab_size=vocab_size, context=context or seq_len, **widths)
    return ModelShape(registry.get(arch), d, seq_len, vocab_pad_multiple, dropout)


def gpt(n_layers: int, d_model: int, n_heads: int, seq_len: int, vocab_size: int, **kw: Any) -> ModelShape:
    """A GPT (multi-head attention, an MLP of 4 x d_model unless ffn_hidden says otherwise)."""
    return shape("gpt", n_layers, d_model, n_heads, seq_len, vocab_size, **kw)
