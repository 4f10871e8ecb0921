"""The Llama family's torch module (Qwen3's and the Mixture-of-Experts families' too, with their options): a
Llama 2/3 decoder that knows nothing of parallelism (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied
embeddings), its builder and its Hugging Face tensor table (the entry, torch-free, is hpctrain.models.llama.entry).

It keeps GPT's module names where the two agree (`tok_emb`, `layers`, `norm1`, `attn.qkv`, `attn.proj`, `norm2`,
`mlp.proj`, `norm_f`), so recomputation, FSDP wrapping and pipeline cuts of hpctrain.parallel apply unchanged;
the head is a module of its own, `output`, and the SwiGLU input is two, `mlp.gate` and `mlp.up`.
Layout-friendly choices:
- The fused QKV projection is laid out KV group by KV group ([g0: q heads of g0, k0, v0][g1: ...]) and
  attention views it as (B, T, kv_heads, group + 2, head_dim): a colwise TP split gives each rank whole KV
  groups, the query heads with the key/value head they share.
- SwiGLU's gate and up are separate weights (torchtitan's w1 and w3; see `MLP`), both split by columns.
- RoPE follows Hugging Face's Llama (rotate_half, non-interleaved halves; Llama 3 frequency scaling), so its
  weights load without permuting q/k rows. cos/sin come from a small module-level cache (`rope_tables`), per
  (length, device, dtype): no buffer to materialise after building on the meta device, nothing in the checkpoint.
- `tok_emb`, `norm_f`, `output` may be set to None on pipeline stages that do not hold them; forward skips them.
- A block is called as GPT's is, `block(h)`: one positional input is what TP's PrepareModuleInput
  (input_layouts of length 1), FSDP2's input cast, activation checkpointing and regional compile see.

Checkpoints written before gate and up were separate (one `mlp.fc.weight`, rows interleaved 2j gate j, 2j + 1
up j) load through `legacy_source`, which hpctrain.checkpoint.reshard applies to the weights and their Adam moments.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.common.attention import CausalAttention
from hpctrain.models.common.init import init_by_name
from hpctrain.models.common.recipes import Recipe, same, vocab
from hpctrain.models.family import Dims
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
    head_dim: int = 0  # each head's width (0: d_model / n_heads)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    family: str = "llama"  # the name of the family entry it is built for (hpctrain.models.registry)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_dim", self.head_dim or self.d_model // self.n_heads)

    @property
    def embedding_rows(self) -> int:
        return max(self.padded_vocab, self.vocab_size)


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
        head_dim=m.head_dim,
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


ROPE_CACHE_SIZE = 16  # (length, device, dtype) entries kept: training uses one or two, evaluation a few more
_ROPE_CACHE: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def rope_tables(args: LlamaArgs, like: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin for the positions of `like` ([..., T, head_dim]: its length unless `seq_len` is given, as under
    context parallelism, where T tokens are chunks of a longer sequence; its device and dtype, to which they are
    cast as Hugging Face casts them to the activations'), built once per (RoPE arguments, length, device, dtype)
    and reused by every layer, micro-batch and recomputation.

    A module-level cache rather than a buffer: nothing to materialise after building on the meta device or to
    keep out of the state dict, and every layout (TP/SP, FSDP2, a pipeline stage) asks for what it sees, since
    attention always sees the full sequence. Only plain tensors are cached, none made in inference mode (they
    could not be saved for a later backward), and the cache is bypassed where tensors are not real: under fake
    tensors (hpctrain.simulate) a real table must not enter the trace nor a fake one the cache, and under
    torch.compile the few ops are traced into the graph instead. The tables are never written to once made.
    """
    seq_len, device, dtype = like.shape[-2] if seq_len is None else seq_len, like.device, like.dtype
    if (
        type(like) is not torch.Tensor
        or torch.compiler.is_compiling()
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    ):
        cos, sin = rope_cos_sin(args, seq_len, device)
        return cos.to(dtype), sin.to(dtype)
    key = (
        args.head_dim,
        args.rope_theta,
        args.rope_scaling,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_context,
        int(seq_len),
        device,
        dtype,
    )
    tables = _ROPE_CACHE.get(key)
    if tables is not None:
        _ROPE_CACHE.move_to_end(key)
        return tables
    cos, sin = rope_cos_sin(args, seq_len, device)
    tables = cos.to(dtype), sin.to(dtype)
    if not torch.is_inference_mode_enabled():
        _ROPE_CACHE[key] = tables
        while len(_ROPE_CACHE) > ROPE_CACHE_SIZE:
            _ROPE_CACHE.popitem(last=False)
    return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., T, head_dim] by position: dim i pairs with dim i + head_dim / 2 (Hugging Face's rotate_half).
    cos/sin are cast to x's dtype first, as Hugging Face does (a no-op for rope_tables' own)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm as Hugging Face's LlamaRMSNorm: normalised in fp32, cast back to the input's dtype,
    then multiplied by the weight (so a bf16 input and an fp32 weight give fp32, as Hugging Face's).

    The normalisation is torch's `F.rms_norm` without a weight. torch 2.13 (aten/src/ATen/native/layer_norm.cpp,
    `rms_norm_symint`) sends it to `_fused_rms_norm`: on CUDA one kernel, which computes in fp32 ("opmath") for
    bf16/fp16 inputs, writes the input's dtype and keeps only the input and the fp32 1/rms per token for backward
    (derivatives.yaml); on CPU, where that op has no kernel, the composite `rms_norm_composite` (upcast, pow,
    mean, + eps, rsqrt, mul, cast back): Hugging Face's own sequence of ops, so equal to it bit for bit. Under
    autocast (layouts without FSDP2) the residual stream reaching the norms is fp32, so the fp32 kernel runs
    (recent torch also lists rms_norm among CUDA autocast's fp32 ops, autocast_mode.h).

    The weight is applied outside: `F.rms_norm(x, shape, weight)` would multiply by it in fp32 before the one
    rounding (not Hugging Face's numerics in bf16), and with an fp32 weight and a bf16 input torch warns and
    takes the composite path and returns bf16. The multiplication keeps the normalised tensor (input dtype) for
    the weight's gradient, as Hugging Face's does; it works with DTensors (TP's sequence parallelism: weight
    Replicate, input Shard(1), for which DTensor has a `_fused_rms_norm` strategy) and on the meta device.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, self.normalized_shape, eps=self.eps)


class Attention(nn.Module):
    """Grouped-query attention: `group` query heads share each key/value head."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.head_dim = args.head_dim
        self.group = args.n_heads // args.n_kv_heads
        self.qkv = nn.Linear(args.d_model, (args.n_heads + 2 * args.n_kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(args.n_heads * self.head_dim, args.d_model, bias=False)
        # Qwen3's per-head norms (named norm_* so that init_by_name starts them at one, as the block's norms)
        self.norm_q = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.norm_k = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.attention = CausalAttention()  # replaced by hpctrain.parallel for context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d], the full sequence in every layout (with SP, TP's input layout gathers it)."""
        bsz, seqlen, _ = x.shape
        # (B, T, kv heads on this rank, group + 2, head_dim): a group's query heads, then its key and value.
        qkv = self.qkv(x).view(bsz, seqlen, -1, self.group + 2, self.head_dim)
        # One split, not three slices: its backward writes the three gradients into one tensor (a slice's fills
        # a zero tensor of the whole output, and the three are then added up).
        q, k, v = qkv.split((self.group, 1, 1), dim=3)
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)  # query head g * group + j uses key/value head g
        if self.norm_q is not None and self.norm_k is not None:  # both or neither (qk_norm)
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope_tables(self.args, q, self.attention.full_length(seqlen))
        positions = self.attention.positions(seqlen, q.device)
        if positions is not None:  # this rank's chunks of the sequence: their true positions
            cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attention(q, k, v)  # query head g * group + j reads key/value head g
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))
        return out


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): proj(silu(gate(x)) * up(x)), gate and up two weights of their own.

    Separate weights, as torchtitan's w1 and w3, because that is the one layout that is contiguous for SwiGLU
    and splits under TP without tying the checkpoint to the TP degree: each matmul writes a contiguous output
    that silu and the product read at unit stride, and ColwiseParallel on both gives each rank matching gate
    and up rows. (The alternatives: rows interleaved in one weight, as before, split correctly but hand SwiGLU
    stride-2 slices, 2-4x slower elementwise work; one weight [gate; up] split colwise would give rank 0 the
    gates and rank 1 the ups unless blocked per TP rank, a layout that differs with every TP degree.) The cost
    is one more, equally large, matmul launch per block: nothing next to the MLP's own.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(args.d_model, args.ffn_hidden, bias=False)
        self.up = nn.Linear(args.d_model, args.ffn_hidden, bias=False)
        self.proj = nn.Linear(args.ffn_hidden, args.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    def __init__(self, args: LlamaArgs, mlp: nn.Module | None = None) -> None:
        """`mlp`: the feed-forward, when not the dense SwiGLU (a Mixture of Experts, hpctrain.models.mixtral.model)."""
        super().__init__()
        self.norm1 = RMSNorm(args.d_model, args.norm_eps)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.d_model, args.norm_eps)
        self.mlp = mlp if mlp is not None else MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] (with sequence parallelism, this rank's [B, T / tp, d])."""
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class Llama(nn.Module):
    tied_embeddings = False  # the head is `output`, a weight of its own

    def __init__(self, args: LlamaArgs, mlp: Callable[[], nn.Module] | None = None) -> None:
        """`mlp`: makes each block's feed-forward (default: the dense SwiGLU)."""
        super().__init__()
        self.args = args
        self.family = args.family  # its entry in hpctrain.models.registry (llama, qwen3, ...: the same module)
        self.tok_emb: nn.Embedding | None = nn.Embedding(args.embedding_rows, args.d_model)
        self.layers = nn.ModuleDict({str(i): Block(args, mlp() if mlp else None) for i in range(args.n_layers)})
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
        if self.norm_f is not None:  # the last stage: it holds the head too (the family entry's stage_modules)
            assert self.output is not None
            h = self.output(self.norm_f(h))
        return h

    def output_weight(self) -> torch.Tensor:
        if self.output is None:
            raise RuntimeError("this stage does not hold the output head")
        return self.output.weight

    def init_weights(self, seed: int | None = None) -> None:
        """GPT-2's initialisation by parameter name (hpctrain.models.common.init): every layout gets the
        single-process model's weights; the head's padding rows are zero like the embedding's."""
        init_by_name(self, seed, self.args.init_std, self.args.n_layers, self.args.vocab_size)


# ---------------------------------------------------------------- checkpoints of the interleaved layout

_GATE_UP = re.compile(r"(^|\.)mlp\.(gate|up)\.weight(?=\.|$)")
LEGACY_GATE_UP = "mlp.fc.weight"  # before issue 31: gate and up in one weight, rows interleaved (2j gate j)


def legacy_source(key: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """For a state-dict key of a gate or up weight, or of its optimizer state (`state.layers.3.mlp.up.weight.
    exp_avg`, DCP's flattened `train.model.layers.3.mlp.gate.weight`), the key an older checkpoint holds it under
    and how to take it from that tensor: every other row of the interleaved weight (and of its Adam moments, which
    follow the weight's layout element for element); a scalar (AdamW's step) is shared. None for other keys."""
    match = _GATE_UP.search(key)
    if match is None:
        return None
    half = 0 if match.group(2) == "gate" else 1
    old = f"{key[: match.start()]}{match.group(1)}{LEGACY_GATE_UP}{key[match.end() :]}"

    def take(interleaved: torch.Tensor) -> torch.Tensor:
        if interleaved.dim() == 0:
            return interleaved
        return torch.unflatten(interleaved, 0, (-1, 2))[:, half].contiguous()

    return old, take


def build(m: Any, tp: int = 1) -> Llama:
    """The family's builder (`Family.builder`): the Llama of a config's `model` section, embedding padded for `tp`,
    on the current device context (`with torch.device("meta")` allocates nothing; init_weights() fills it)."""
    return Llama(llama_args(m, tp))


# ---------------------------------------------------------------- Hugging Face (LlamaForCausalLM)


def _llama_qkv(prefix: str, n_heads: int, n_kv: int, head_dim: int) -> Recipe:
    """q_proj, k_proj, v_proj <-> one weight ordered by key/value group: q heads g*r..g*r+r-1, k head g, v head g."""
    r = n_heads // n_kv

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        d = q.shape[1]
        return torch.cat(
            [q.reshape(n_kv, r, head_dim, d), k.reshape(n_kv, 1, head_dim, d), v.reshape(n_kv, 1, head_dim, d)], dim=1
        ).reshape(-1, d)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        groups = t.reshape(n_kv, r + 2, head_dim, t.shape[1])
        return [
            groups[:, :r].reshape(-1, t.shape[1]).contiguous(),
            groups[:, r].reshape(-1, t.shape[1]).contiguous(),
            groups[:, r + 1].reshape(-1, t.shape[1]).contiguous(),
        ]

    return Recipe((f"{prefix}q_proj.weight", f"{prefix}k_proj.weight", f"{prefix}v_proj.weight"), join, split)


def hf_recipes(m: Any) -> dict[str, Recipe]:
    """Every weight of the config's Llama with the LlamaForCausalLM tensors it is made of (the family's
    `hf.recipes`): q, k and v fused by key/value group, the rest as they are."""
    head_dim = Dims.of(m).head_dim
    out: dict[str, Recipe] = {}
    out["tok_emb.weight"] = vocab("model.embed_tokens.weight", m.vocab_size)
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out[f"{ours}norm1.weight"] = same(f"{hf}input_layernorm.weight")
        out[f"{ours}attn.qkv.weight"] = _llama_qkv(f"{hf}self_attn.", m.n_heads, kv_heads_of(m), head_dim)
        out[f"{ours}attn.proj.weight"] = same(f"{hf}self_attn.o_proj.weight")
        out[f"{ours}norm2.weight"] = same(f"{hf}post_attention_layernorm.weight")
        out[f"{ours}mlp.gate.weight"] = same(f"{hf}mlp.gate_proj.weight")
        out[f"{ours}mlp.up.weight"] = same(f"{hf}mlp.up_proj.weight")
        out[f"{ours}mlp.proj.weight"] = same(f"{hf}mlp.down_proj.weight")
    out["norm_f.weight"] = same("model.norm.weight")
    out["output.weight"] = vocab("lm_head.weight", m.vocab_size)
    return out
