"""The GPT family's torch module: a GPT decoder that knows nothing of parallelism, its builder and its Hugging
Face tensor table (the entry, torch-free, is hpctrain.models.gpt.entry).

Layouts (DDP, FSDP2, TP, PP) are applied from outside by `hpctrain.parallel`, as torchtitan does, so
this file has no process groups, no DTensor and no rank logic. Choices that keep it layout friendly:
- `layers` is a ModuleDict keyed by the global layer index: a pipeline stage deletes the layers it does
  not own and the remaining parameter names stay the same, so checkpoints load into any layout.
- `tok_emb`, `pos_emb`, `norm_f` may be set to None on stages that do not hold them; forward skips them.
  The stage that embeds (`embeds`) is the one holding `pos_emb`: the last pipeline stage keeps `tok_emb` only
  as the tied output head.
- The fused QKV projection's output is laid out head by head ([h0: q k v][h1: q k v]...) and attention
  reshapes with `view(B, T, -1, 3, head_dim)`, so a colwise TP split gives each rank whole heads.
- Weights are created by `init_weights()`, so a model built on the meta device is materialised per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.common.attention import CausalAttention
from hpctrain.models.common.init import init_by_name
from hpctrain.models.common.recipes import Recipe, same, transposed, vocab
from hpctrain.models.params import ffn_hidden_of, padded_vocab


@dataclass(frozen=True)
class GPTArgs:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    ffn_hidden: int
    dropout: float = 0.0
    init_std: float = 0.02
    norm_eps: float = 1e-5  # LayerNorm's (GPT-2's layer_norm_epsilon)
    padded_vocab: int = 0  # embedding rows (0: vocab_size); extra rows stay zero and are cut from the logits

    @property
    def embedding_rows(self) -> int:
        return max(self.padded_vocab, self.vocab_size)


def gpt_args(m: Any, tp: int = 1) -> GPTArgs:
    """The model arguments of a config's `model` group (the sequence table covers model.context); the
    embedding is padded for `tp` (parallel.tp)."""
    return GPTArgs(
        n_layers=m.n_layers,
        d_model=m.d_model,
        n_heads=m.n_heads,
        vocab_size=m.vocab_size,
        seq_len=m.context,
        ffn_hidden=ffn_hidden_of(m),
        dropout=m.dropout,
        init_std=m.init_std,
        norm_eps=m.norm_eps,
        padded_vocab=padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp),
    )


class Attention(nn.Module):
    def __init__(self, args: GPTArgs) -> None:
        super().__init__()
        self.head_dim = args.d_model // args.n_heads
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model)
        self.proj = nn.Linear(args.d_model, args.d_model)
        self.dropout = args.dropout
        self.attention = CausalAttention()  # replaced by hpctrain.parallel for context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.qkv(x).view(bsz, seqlen, -1, 3, self.head_dim).unbind(3)
        y = self.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=self.dropout if self.training else 0.0
        )
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))
        return out


class MLP(nn.Module):
    def __init__(self, args: GPTArgs) -> None:
        super().__init__()
        self.fc = nn.Linear(args.d_model, args.ffn_hidden)
        self.proj = nn.Linear(args.ffn_hidden, args.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return out


class Block(nn.Module):
    def __init__(self, args: GPTArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.mlp = MLP(args)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.norm2(x)))
        return out


class GPT(nn.Module):
    family = "gpt"  # its entry in hpctrain.models.registry
    tied_embeddings = True  # the head is the token embedding

    def __init__(self, args: GPTArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_emb: nn.Embedding | None = nn.Embedding(args.embedding_rows, args.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(args.seq_len, args.d_model)
        self.drop = nn.Dropout(args.dropout)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm_f: nn.LayerNorm | None = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.attention = CausalAttention()  # where the tokens sit in the sequence (context parallelism)

    @property
    def embeds(self) -> bool:
        """Whether this part looks the tokens up (the whole model, or the first pipeline stage)."""
        return self.pos_emb is not None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (first stage) or hidden states [B, T, d] (later stages) -> logits or hidden.

        The logits cover the padded vocabulary; `logits[..., :vocab_size]` are the real ones (the loss leaves
        the rest out; under TP on each rank's vocabulary shard, hpctrain.parallel.tensor_parallel)."""
        h = tokens
        if self.embeds:  # the first stage: it holds both embeddings (the family entry's stage_modules)
            assert self.tok_emb is not None and self.pos_emb is not None
            positions = self.attention.positions(tokens.shape[1], tokens.device)
            if positions is None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for layer in self.layers.values():
            h = layer(h)
        if self.norm_f is not None:
            h = self.norm_f(h)
            h = F.linear(h, self.output_weight())
        return h

    def output_weight(self) -> torch.Tensor:
        """The head is tied to the token embedding (GPT-2/3)."""
        if self.tok_emb is None:
            raise RuntimeError("this stage holds the head but not the embedding it is tied to")
        return self.tok_emb.weight

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2 initialisation (init_by_name)."""
        init_by_name(self, seed, self.args.init_std, self.args.n_layers, self.args.vocab_size)


def build(m: Any, tp: int = 1) -> GPT:
    """The family's builder (`Family.builder`): the GPT of a config's `model` section, embedding padded for `tp`,
    on the current device context (`with torch.device("meta")` allocates nothing; init_weights() fills it)."""
    return GPT(gpt_args(m, tp))


# ---------------------------------------------------------------- Hugging Face (GPT2LMHeadModel)


def _gpt2_qkv(name: str, n_heads: int, head_dim: int, bias: bool) -> Recipe:
    """c_attn's [q | k | v] columns <-> hpctrain's head-major rows."""
    tail = () if bias else (-1,)

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0] if bias else ts[0].t()  # [3d(, d)]: blocks q, k, v, each heads x head_dim
        return w.reshape(3, n_heads, head_dim, *tail).transpose(0, 1).reshape(w.shape).contiguous()

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        w = t.reshape(n_heads, 3, head_dim, *tail).transpose(0, 1).reshape(t.shape)
        return [w.contiguous() if bias else w.t().contiguous()]

    return Recipe((name,), join, split)


def hf_recipes(m: Any) -> dict[str, Recipe]:
    """Every weight of the config's GPT with the GPT2LMHeadModel tensors it is made of (the family's
    `hf.recipes`): Conv1D weights transposed, c_attn's [q | k | v] columns to head-major rows."""
    head_dim = m.d_model // m.n_heads
    out: dict[str, Recipe] = {}
    out["tok_emb.weight"] = vocab("transformer.wte.weight", m.vocab_size)
    out["pos_emb.weight"] = same("transformer.wpe.weight")
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{ours}{norm}.weight"] = same(f"{hf}{ln}.weight")
            out[f"{ours}{norm}.bias"] = same(f"{hf}{ln}.bias")
        out[f"{ours}attn.qkv.weight"] = _gpt2_qkv(f"{hf}attn.c_attn.weight", m.n_heads, head_dim, bias=False)
        out[f"{ours}attn.qkv.bias"] = _gpt2_qkv(f"{hf}attn.c_attn.bias", m.n_heads, head_dim, bias=True)
        for module, hf_module in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[f"{ours}{module}.weight"] = transposed(f"{hf}{hf_module}.weight")
            out[f"{ours}{module}.bias"] = same(f"{hf}{hf_module}.bias")
    out["norm_f.weight"] = same("transformer.ln_f.weight")
    out["norm_f.bias"] = same("transformer.ln_f.bias")
    return out
