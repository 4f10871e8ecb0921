"""Parameter counts of the GPT and Llama architectures, as pure arithmetic: the whole model, and per pipeline
stage and TP rank.

The plan prints these on the login node before anything is built, so they must not need torch. They match
`sum(p.numel())` of `hpctrain.models.gpt.GPT` and `hpctrain.models.llama` exactly, whole and per stage and shard
(tested against the models built on the meta device), and the published totals (GPT-3 175B, Llama 3 8B/70B/405B).

The two blocks, with h = d_model, f = the MLP's hidden size, k = n_kv_heads x head_dim (the width of K and V):
    gpt    LayerNorm (weight, bias), fused QKV 3h x h, projection h x h, MLP h -> f -> h, all with biases:
           12 h^2 + 13 h for f = 4h; learned positions; the output head tied to the token embedding.
    llama  RMSNorm (weight only), fused QKV (h + 2k) x h (grouped-query attention: k < h), projection h x h,
           SwiGLU MLP (gate and up, f x h each, and down h x f), no biases: 2 h^2 + 2 h k + 3 h f + 2 h;
           RoPE (no position table); an untied output head.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def padded_vocab(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """The embedding's row count: the vocabulary rounded up to a multiple of `multiple` x TP.

    GPU matmuls run at full speed when the output dimension is a multiple of 64 (tensor-core tiles), and each
    TP rank then holds an equal, aligned slice of the vocabulary (Megatron's make-vocab-size-divisible-by).
    The extra rows are never looked up and their logits are cut off before the loss: the loss is the
    unpadded model's. `multiple` <= 1 disables padding.
    """
    step = max(1, multiple) * max(1, tp) if multiple > 1 else 1
    return -(-vocab_size // step) * step


def ffn_hidden_size(d_model: int, ffn_mult: int = 4) -> int:
    return ffn_mult * d_model


def ffn_hidden_of(model: ModelConfig) -> int:
    """The MLP's hidden size of a model config: model.ffn_hidden, or ffn_mult x d_model when unset (0)."""
    return model.ffn_hidden or ffn_hidden_size(model.d_model, model.ffn_mult)


def kv_heads_of(model: ModelConfig) -> int:
    """Key/value heads: model.n_kv_heads (grouped-query attention), or n_heads when unset (0)."""
    return model.n_kv_heads or model.n_heads


def arch_of(model: ModelConfig) -> str:
    """The config's architecture as a plain string ("gpt" or "llama"), whether OmegaConf gives the enum or not."""
    return str(getattr(model.arch, "value", model.arch))


def kv_dim_of(model: ModelConfig) -> int:
    """Width of the K and V projections: key/value heads x head_dim (d_model without grouped-query attention)."""
    return kv_heads_of(model) * (model.d_model // model.n_heads)


def tied_of(model: ModelConfig) -> bool:
    """GPT ties the output head to the token embedding; Llama 3 (8B and up) has a head of its own."""
    return arch_of(model) == "gpt"


def layer_params(d_model: int, ffn_hidden: int, arch: str = "gpt", kv_dim: int | None = None) -> int:
    """One transformer block's parameters (block_shapes): 12 d^2 + 13 d for a GPT block with ffn_hidden = 4d."""
    return _numel(block_shapes(d_model, ffn_hidden, arch, kv_dim))


def param_count(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    seq_len: int,
    ffn_hidden: int | None = None,
    tied_embeddings: bool = True,
    arch: str = "gpt",
    kv_dim: int | None = None,
) -> int:
    """Total parameters, GPT: 12 l d^2 (1 + 13/(12 d) + (V + s)/(12 l d)) + final LayerNorm (Narayanan et al. 2021);
    Llama: l (2 d^2 + 2 d k + 3 d f + 2 d) + 2 V d + d. `seq_len` is GPT's position table; `vocab_size` the
    embedding's rows (the tokenizer's vocabulary for the published count)."""
    ffn = ffn_hidden if ffn_hidden is not None else ffn_hidden_size(d_model)
    top = top_shapes(d_model, vocab_size, seq_len, arch, tied_embeddings)
    return n_layers * layer_params(d_model, ffn, arch, kv_dim) + _numel(top)


def model_param_count(model: ModelConfig, context: int | None = None) -> int:
    """A config's own parameter count, for its arch, with the tokenizer's vocabulary (what papers publish).

    context: GPT's position-table rows (model.context when None); Llama has no position table."""
    return param_count(model.n_layers, model.d_model, model.vocab_size, context or model.context,
                       ffn_hidden_of(model), tied_of(model), arch_of(model), kv_dim_of(model))


# ---------------------------------------------------------------- where the parameters live
# The same names and shapes as hpctrain.models.gpt.GPT and hpctrain.models.llama build (the tests count the
# meta-device models against these), so the plan counts every pipeline stage and TP shard without torch.

# Parameters TP splits, and along which dim (ColwiseParallel: dim 0 of the weight and bias; RowwiseParallel:
# dim 1; the token embedding and Llama's output head are vocabulary-parallel, dim 0). Everything else (the norms,
# the row-parallel biases) is replicated over TP.
SHARDED_DIMS: dict[str, int] = {
    "tok_emb.weight": 0,
    "output.weight": 0,
    "attn.qkv.weight": 0,
    "attn.qkv.bias": 0,
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0,
    "mlp.fc.bias": 0,
    "mlp.gate.weight": 0,
    "mlp.up.weight": 0,
    "mlp.proj.weight": 1,
}


def block_shapes(d_model: int, ffn_hidden: int, arch: str = "gpt", kv_dim: int | None = None
                 ) -> dict[str, tuple[int, ...]]:
    """One transformer block's parameters (names under `layers.<i>.`) and their shapes.

    kv_dim: the width of K and V (llama's grouped-query attention: n_kv_heads x head_dim); d_model when None."""
    d, f = d_model, ffn_hidden
    if arch == "gpt":
        return {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
                "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,),
                "mlp.fc.weight": (f, d), "mlp.fc.bias": (f,), "mlp.proj.weight": (d, f), "mlp.proj.bias": (d,)}
    if arch == "llama":
        k = d if kv_dim is None else kv_dim
        return {"norm1.weight": (d,), "attn.qkv.weight": (d + 2 * k, d), "attn.proj.weight": (d, d),
                "norm2.weight": (d,), "mlp.gate.weight": (f, d), "mlp.up.weight": (f, d), "mlp.proj.weight": (d, f)}
    raise ValueError(f"unknown model arch {arch!r}")


def top_shapes(d_model: int, embedding_rows: int, context: int, arch: str = "gpt", tied: bool = True
               ) -> dict[str, tuple[int, ...]]:
    """The parameters outside the blocks: token embedding (padded rows), GPT's positions, the final norm, and
    an untied output head (as many rows as the embedding)."""
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (embedding_rows, d_model)}
    if arch == "gpt":
        shapes.update({"pos_emb.weight": (context, d_model), "norm_f.weight": (d_model,), "norm_f.bias": (d_model,)})
    elif arch == "llama":
        shapes["norm_f.weight"] = (d_model,)
    else:
        raise ValueError(f"unknown model arch {arch!r}")
    if not tied:
        shapes["output.weight"] = (embedding_rows, d_model)
    return shapes


def sharded_dim(name: str) -> int | None:
    """The dim TP splits parameter `name` along (SHARDED_DIMS), None when it is replicated."""
    return next((d for suffix, d in SHARDED_DIMS.items() if name.endswith(suffix)), None)


def tp_local_numel(name: str, shape: Sequence[int], tp: int) -> int:
    """Elements of parameter `name` on one TP rank (the largest shard when the split is uneven)."""
    numel = math.prod(shape)
    dim = sharded_dim(name)
    if dim is None or tp == 1:
        return numel
    return numel // shape[dim] * -(-shape[dim] // tp)


def _numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Global layer indices of each pipeline stage: an even split (the checks require it)."""
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers cannot be split evenly into {n_stages} pipeline stages: "
                         "choose parallel.pp x parallel.virtual_stages dividing model.n_layers")
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def stage_holds(module: str, stage: int, n_stages: int, n_layers: int, tied: bool = True) -> bool:
    """Whether `stage` keeps a top-level module ("tok_emb", "pos_emb", "norm_f", "output") or layer
    ("layers.<i>").

    With `tied` embeddings (GPT) the last stage keeps the token embedding too: the output head is tied to it
    (Megatron's embedding copy); untied (Llama), the last stage holds the head of its own, `output`."""
    first, last = stage == 0, stage == n_stages - 1
    if module.startswith("layers."):
        return int(module.split(".")[1]) in stage_layers(n_layers, n_stages)[stage]
    return {"pos_emb": first, "tok_emb": first or (last and tied), "norm_f": last, "output": last}.get(module, True)


def stage_param_counts(model: ModelConfig, n_stages: int, tp: int = 1, per_gpu: bool = False) -> list[int]:
    """Parameters of each pipeline stage as built for a layout with `tp` (the embedding padded for it).

    per_gpu: what one TP rank holds (SHARDED_DIMS split, the rest replicated); otherwise the whole stage."""
    rows = padded_vocab(model.vocab_size, model.vocab_pad_multiple, tp)
    split, arch, tied = (tp if per_gpu else 1), arch_of(model), tied_of(model)
    shapes = block_shapes(model.d_model, ffn_hidden_of(model), arch, kv_dim_of(model))
    block = sum(tp_local_numel(name, shape, split) for name, shape in shapes.items())
    top: dict[str, int] = {}
    for name, shape in top_shapes(model.d_model, rows, model.context, arch, tied).items():
        module = name.split(".")[0]
        top[module] = top.get(module, 0) + tp_local_numel(name, shape, split)
    counts = []
    for stage, layers in enumerate(stage_layers(model.n_layers, n_stages)):
        held = sum(n for module, n in top.items() if stage_holds(module, stage, n_stages, model.n_layers, tied))
        counts.append(len(layers) * block + held)
    return counts


def model_flops_per_token(n_params: int, n_layers: int, seq_len: int, d_model: int) -> float:
    """MFU's numerator per token: 6 N + 12 l s h (Chowdhery et al. 2022, PaLM, appendix B).

    No recomputation is counted, and the attention term counts the full s x s score matrix, as Megatron's
    formula does; N is the model's own parameter count (vocabulary padding is not useful work). The same for
    Llama: 6 N already counts the SwiGLU matrices and the narrower K/V projections of grouped-query attention,
    and the score and context matmuls still run over all n_heads x head_dim = h columns."""
    return 6 * n_params + 12 * n_layers * seq_len * d_model
