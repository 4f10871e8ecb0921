"""Parameter counts of the GPT family, as pure arithmetic: the whole model, and per pipeline stage and TP rank.

The plan prints these on the login node before anything is built, so they must not need torch. They match
`sum(p.numel())` of `hpctrain.models.gpt.GPT` exactly, whole and per stage and shard (tested against the model
built on the meta device).
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


def layer_params(d_model: int, ffn_hidden: int) -> int:
    """One pre-LN transformer block: QKV + proj + 2 MLP matrices, their biases, 2 LayerNorms.

    With ffn_hidden = 4d this is the standard 12 d^2 + 13 d.
    """
    attn = 3 * d_model * d_model + 3 * d_model + d_model * d_model + d_model
    mlp = 2 * d_model * ffn_hidden + ffn_hidden + d_model
    norms = 2 * 2 * d_model
    return attn + mlp + norms


def embedding_params(d_model: int, vocab_size: int, seq_len: int) -> int:
    """Token embedding (tied with the output head) + learned positions."""
    return vocab_size * d_model + seq_len * d_model


def param_count(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    seq_len: int,
    ffn_hidden: int | None = None,
    tied_embeddings: bool = True,
) -> int:
    """Total parameters: 12 l d^2 (1 + 13/(12 d) + (V + s)/(12 l d)) + final LayerNorm (Narayanan et al. 2021)."""
    ffn = ffn_hidden if ffn_hidden is not None else ffn_hidden_size(d_model)
    total = n_layers * layer_params(d_model, ffn) + embedding_params(d_model, vocab_size, seq_len)
    total += 2 * d_model  # final LayerNorm
    if not tied_embeddings:
        total += vocab_size * d_model
    return total


# ---------------------------------------------------------------- where the parameters live
# The same names and shapes as hpctrain.models.gpt.GPT builds (the test counts the meta-device model against
# these), so the plan counts every pipeline stage and TP shard without torch.

# Parameters TP splits, and along which dim (ColwiseParallel: dim 0 of the weight and bias; RowwiseParallel:
# dim 1; the token embedding is vocabulary-parallel, dim 0). Everything else is replicated over TP.
SHARDED_DIMS: dict[str, int] = {
    "tok_emb.weight": 0,
    "attn.qkv.weight": 0,
    "attn.qkv.bias": 0,
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0,
    "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
}


def block_shapes(d_model: int, ffn_hidden: int) -> dict[str, tuple[int, ...]]:
    """One transformer block's parameters (names under `layers.<i>.`) and their shapes."""
    d, f = d_model, ffn_hidden
    return {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
            "attn.proj.weight": (d, d), "attn.proj.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,),
            "mlp.fc.weight": (f, d), "mlp.fc.bias": (f,), "mlp.proj.weight": (d, f), "mlp.proj.bias": (d,)}


def top_shapes(d_model: int, embedding_rows: int, context: int) -> dict[str, tuple[int, ...]]:
    """The parameters outside the blocks: tied token embedding (padded rows), positions, final LayerNorm."""
    return {"tok_emb.weight": (embedding_rows, d_model), "pos_emb.weight": (context, d_model),
            "norm_f.weight": (d_model,), "norm_f.bias": (d_model,)}


def tp_local_numel(name: str, shape: Sequence[int], tp: int) -> int:
    """Elements of parameter `name` on one TP rank (the largest shard when the split is uneven)."""
    numel = math.prod(shape)
    dim = next((d for suffix, d in SHARDED_DIMS.items() if name.endswith(suffix)), None)
    if dim is None or tp == 1:
        return numel
    return numel // shape[dim] * -(-shape[dim] // tp)


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Global layer indices of each pipeline stage: an even split (the checks require it)."""
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers cannot be split evenly into {n_stages} pipeline stages: "
                         "choose parallel.pp x parallel.virtual_stages dividing model.n_layers")
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def stage_holds(module: str, stage: int, n_stages: int, n_layers: int) -> bool:
    """Whether `stage` keeps a top-level module ("tok_emb", "pos_emb", "norm_f") or layer ("layers.<i>").

    The last stage keeps the token embedding too: the output head is tied to it (Megatron's embedding copy)."""
    first, last = stage == 0, stage == n_stages - 1
    if module.startswith("layers."):
        return int(module.split(".")[1]) in stage_layers(n_layers, n_stages)[stage]
    return {"pos_emb": first, "tok_emb": first or last, "norm_f": last}.get(module, True)


def stage_param_counts(model: ModelConfig, n_stages: int, tp: int = 1, per_gpu: bool = False) -> list[int]:
    """Parameters of each pipeline stage as built for a layout with `tp` (the embedding padded for it).

    per_gpu: what one TP rank holds (SHARDED_DIMS split, the rest replicated); otherwise the whole stage."""
    rows = padded_vocab(model.vocab_size, model.vocab_pad_multiple, tp)
    split = tp if per_gpu else 1
    shapes = block_shapes(model.d_model, model.ffn_mult * model.d_model)
    block = sum(tp_local_numel(name, shape, split) for name, shape in shapes.items())
    top: dict[str, int] = {}
    for name, shape in top_shapes(model.d_model, rows, model.context).items():
        module = name.split(".")[0]
        top[module] = top.get(module, 0) + tp_local_numel(name, shape, split)
    counts = []
    for stage, layers in enumerate(stage_layers(model.n_layers, n_stages)):
        held = sum(n for module, n in top.items() if stage_holds(module, stage, n_stages, model.n_layers))
        counts.append(len(layers) * block + held)
    return counts


def model_flops_per_token(n_params: int, n_layers: int, seq_len: int, d_model: int) -> float:
    """MFU's numerator per token: 6 N + 12 l s h (Chowdhery et al. 2022, PaLM, appendix B).

    No recomputation is counted, and the attention term counts the full s x s score matrix, as Megatron's
    formula does; N is the model's own parameter count (vocabulary padding is not useful work)."""
    return 6 * n_params + 12 * n_layers * seq_len * d_model
