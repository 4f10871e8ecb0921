"""A Llama 2/3 decoder that knows nothing of parallelism: RoPE, RMSNorm, SwiGLU, grouped-query attention,
untied embeddings.

It keeps GPT's module names (`tok_emb`, `layers`, `norm1`, `attn.qkv`, `attn.proj`, `norm2`, `mlp.fc`,
`mlp.proj`, `norm_f`), so the TP plan, recomputation, FSDP wrapping and pipeline cuts of hpctrain.parallel apply
unchanged; the head is a module of its own, `output`. Layout-friendly choices:
- The fused QKV projection is laid out KV group by KV group ([g0: q heads of g0, k0, v0][g1: ...]) and
  attention views it as (B, T, kv_heads, group + 2, head_dim): a colwise TP split gives each rank whole KV
  groups, the query heads with the key/value head they share.
- The SwiGLU input projection interleaves gate and up rows (row 2j gate j, row 2j + 1 up j): a colwise split
  keeps each pair on one rank.
- RoPE follows Hugging Face's Llama (rotate_half, non-interleaved halves; Llama 3 frequency scaling), so its
  weights load without permuting q/k rows. cos/sin are computed in fp32 on the fly for the sequence length
  and device: no buffer to materialise after building on the meta device, nothing to checkpoint.
- `tok_emb`, `norm_f`, `output` may be set to None on pipeline stages that do not hold them; forward skips them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.gpt import init_by_name
from hpctrain.models.params import ffn_hidden_of, kv_heads_of, padded_vocab


@dataclass(frozen=True)
class LlamaArgs:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: float = 0.0  # Llama 3 frequency scaling factor (0: none)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    init_std: float = 0.02
    padded_vocab: int = 0  # embedding and head rows (0: vocab_size); extra rows stay zero and are cut from the logits

    @property
    def embedding_rows(self) -> int:
        return max(self.padded_vocab, self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def llama_args(m: Any, tp: int = 1) -> LlamaArgs:
    """The model arguments of a config's `model` group; the embedding and head are padded for `tp`."""
    return LlamaArgs(
        n_layers=m.n_layers,
        d_model=m.d_model,
        n_heads=m.n_heads,
        n_kv_heads=kv_heads_of(m),
        vocab_size=m.vocab_size,
        ffn_hidden=ffn_hidden_of(m),
        norm_eps=m.norm_eps,
        rope_theta=m.rope.theta,
        rope_scaling=m.rope.scaling_factor,
        rope_low_freq_factor=m.rope.low_freq_factor,
        rope_high_freq_factor=m.rope.high_freq_factor,
        rope_original_context=m.rope.original_context,
        init_std=m.init_std,
        padded_vocab=padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp),
    )


def rope_frequencies(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """The head_dim / 2 rotary frequencies in fp32, with Llama 3's scaling when args.rope_scaling > 0: wavelengths
    shorter than original_context / high_freq_factor kept, longer than original_context / low_freq_factor divided
    by the factor, smoothly interpolated between (Hugging Face's `_compute_llama3_parameters`)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if args.rope_scaling <= 0:
        return inv_freq
    factor, low, high = args.rope_scaling, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_context = args.rope_original_context
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(args: LlamaArgs, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, [seq_len, head_dim] in fp32: the frequencies repeated
    for the two halves a head's vector is rotated in."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = positions[:, None] * rope_frequencies(args, device)[None, :]  # elementwise: autocast leaves it fp32
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., T, head_dim] by position: dim i pairs with dim i + head_dim / 2 (Hugging Face's rotate_half).
    cos/sin are cast to x's dtype first, as Hugging Face does."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm as Hugging Face's LlamaRMSNorm: normalised in fp32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: `group` query heads share each key/value head."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.head_dim = args.head_dim
        self.group = args.n_heads // args.n_kv_heads
        self.qkv = nn.Linear(args.d_model, (args.n_heads + 2 * args.n_kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(args.n_heads * self.head_dim, args.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # (B, T, kv heads on this rank, group + 2, head_dim): a group's query heads, then its key and value.
        qkv = self.qkv(x).view(bsz, seqlen, -1, self.group + 2, self.head_dim)
        q = qkv[..., : self.group, :].flatten(2, 3)  # query head g * group + j uses key/value head g
        k, v = qkv[..., self.group, :], qkv[..., self.group + 1, :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope_cos_sin(self.args, seqlen, x.device)
        y = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True,
                                           enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): proj(silu(gate) * up), gate and up from one interleaved projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.fc = nn.Linear(args.d_model, 2 * args.ffn_hidden, bias=False)
        self.proj = nn.Linear(args.ffn_hidden, args.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).unflatten(-1, (-1, 2))  # (..., ffn on this rank, [gate, up])
        return self.proj(F.silu(h[..., 0]) * h[..., 1])


class Block(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.d_model, args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.d_model, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    tied_embeddings = False  # the head is `output`, a weight of its own

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_emb: nn.Embedding | None = nn.Embedding(args.embedding_rows, args.d_model)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm_f: RMSNorm | None = RMSNorm(args.d_model, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.d_model, args.embedding_rows, bias=False)

    @property
    def embeds(self) -> bool:
        """Whether this part looks the tokens up (the whole model, or the first pipeline stage)."""
        return self.tok_emb is not None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (first stage) or hidden states [B, T, d] (later stages) -> logits or hidden.

        The logits cover the padded vocabulary; `logits[..., :vocab_size]` are the real ones."""
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        if self.norm_f is not None:
            h = self.output(self.norm_f(h))
        return h

    def output_weight(self) -> torch.Tensor:
        if self.output is None:
            raise RuntimeError("this stage does not hold the output head")
        return self.output.weight

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2's initialisation by parameter name (hpctrain.models.gpt.init_by_name): every layout gets the
        single-process model's weights; the head's padding rows are zero like the embedding's."""
        init_by_name(self, seed, self.args.init_std, self.args.n_layers, self.args.vocab_size)
