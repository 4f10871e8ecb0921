"""Parameter counts of hpctrain's model families, as pure arithmetic: the whole model, and per pipeline
stage, TP rank and EP rank, and a Mixture of Experts' active parameters.

The plan prints these on the login node before anything is built, so they must not need torch. Which
parameters exist, and their shapes, is each family's (hpctrain.models.registry: `block_shapes`, `top_shapes`,
`tp_dims`, `ep_dims`); this module sums them for a `(Family, Dims)`: the family says which parameters, the
`Dims` how large (hpctrain.models.family.Dims, the one owner of a model's shape). They match `sum(p.numel())` of
the built models exactly, whole and per stage and shard (tested against the models built on the meta device), and
the published totals (GPT-3 175B, Llama 3 8B/70B/405B, Qwen3-8B, Mixtral-8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B).

Active parameters (Mixture of Experts): each token goes through top_k of a layer's n_experts experts, so of the
expert weights (the family's `ep_dims`, stacked [n_experts, ...]) top_k / n_experts count per token; the router,
attention, norms, embedding and head count whole. That is the "active" figure model cards publish (Mixtral-8x7B
12.9B, Qwen3-30B-A3B 3.3B) and what MFU's 6 N counts for an MoE model; a dense model's active count is its total.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from hpctrain.models import registry
from hpctrain.models.family import Dims, Family, Shapes

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


def ffn_hidden_of(model: ModelConfig) -> int:
    """The MLP's hidden size of a model config: model.ffn_hidden, or ffn_mult x d_model when unset (0)."""
    return model.ffn_hidden or model.ffn_mult * model.d_model


def kv_heads_of(model: ModelConfig) -> int:
    """Key/value heads: model.n_kv_heads (grouped-query attention), or n_heads when unset (0)."""
    return model.n_kv_heads or model.n_heads


def arch_of(model: ModelConfig) -> str:
    """The config's model family (model.arch), checked against the registry."""
    return registry.family_of(model).name


def tied_of(model: ModelConfig) -> bool:
    """Whether the family ties its output head to the token embedding (GPT) or has a head of its own (Llama)."""
    return registry.family_of(model).tied_embeddings


def built_dims(model: ModelConfig) -> tuple[Family, Dims]:
    """A config's family and the shape it builds: `Dims.of` less what the family has no use for (key/value groups
    without grouped-query attention, model.moe for a dense family: the config checks refuse both, and until then
    neither the planner nor the checkpoint fingerprint may see a shape the family cannot build)."""
    family, dims = registry.family_of(model), Dims.of(model)
    if not family.grouped_query:
        dims = replace(dims, kv_heads=dims.n_heads)
    if not family.moe:
        dims = replace(dims, n_experts=0, top_k=0, expert_hidden=0, n_shared_experts=0)
    return family, dims


def layer_params(family: Family, dims: Dims) -> int:
    """One transformer block's parameters (its `block_shapes`): 12 d^2 + 13 d for a GPT block with ffn_hidden 4d."""
    return _numel(family.block_shapes(dims))


def param_count(family: Family, dims: Dims, embedding_rows: int | None = None) -> int:
    """Parameters of `family` at `dims`, the embedding with `embedding_rows` (the tokenizer's vocabulary when None:
    the count papers publish). GPT: 12 l d^2 (1 + 13/(12 d) + (V + s)/(12 l d)) + final LayerNorm (Narayanan et
    al. 2021, s its position table, dims.context); Llama: l (2 d^2 + 2 d k + 3 d f + 2 d) + 2 V d + d."""
    top = family.top_shapes(dims, embedding_rows or dims.vocab_size)
    return dims.n_layers * layer_params(family, dims) + _numel(top)


def active_param_count(family: Family, dims: Dims, embedding_rows: int | None = None) -> int:
    """Active parameters of `family` at `dims`: the total less the experts no token of a layer visits,
    (n_experts - top_k) / n_experts of each expert weight (exact: the expert dim is n_experts)."""
    inactive = expert_layer_params(family, dims) * (dims.n_experts - dims.top_k) // max(dims.n_experts, 1)
    return param_count(family, dims, embedding_rows) - dims.n_layers * inactive


def expert_layer_params(family: Family, dims: Dims) -> int:
    """One block's expert weights (the family's `ep_dims`: what expert parallelism splits); 0 for a dense family."""
    return sum(
        math.prod(shape) for name, shape in family.block_shapes(dims).items() if family.expert_dim(name) is not None
    )


def model_param_count(model: ModelConfig, context: int | None = None) -> int:
    """A config's own parameter count, for its family, with the tokenizer's vocabulary (what papers publish).

    context: GPT's position-table rows (model.context when None); RoPE families have no position table."""
    family, dims = built_dims(model)
    return param_count(family, replace(dims, context=context or model.context))


def model_active_param_count(model: ModelConfig, context: int | None = None) -> int:
    """The parameters one token goes through (model_param_count for a dense model): each layer's expert weights
    count top_k / n_experts (module docstring)."""
    family, dims = built_dims(model)
    return active_param_count(family, replace(dims, context=context or model.context))


# ---------------------------------------------------------------- where the parameters live
# The same names and shapes as the families' torch modules build (the tests count the meta-device models against
# these), so the plan counts every pipeline stage and TP shard without torch.


def tp_local_numel(family: Family, name: str, shape: Sequence[int], tp: int, ep: int = 1) -> int:
    """Elements of `family`'s parameter `name` on one TP rank (the largest shard when the split is uneven), and on
    one EP rank: an expert weight keeps n_experts / ep of its experts (the checks require ep to divide n_experts),
    whole over TP."""
    numel = math.prod(shape)
    if family.expert_dim(name) is not None:
        return numel // ep
    dim = family.sharded_dim(name)
    if dim is None or tp == 1:
        return numel
    return numel // shape[dim] * -(-shape[dim] // tp)


def _numel(shapes: Shapes) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def stage_layers(split: Sequence[int]) -> list[range]:
    """Global layer indices of each pipeline stage, from its layer counts (`Layout.layer_split`)."""
    ends = list(itertools.accumulate(split))
    return [range(end - n, end) for n, end in zip(split, ends)]


def stage_holds(family: Family, module: str, stage: int, split: Sequence[int]) -> bool:
    """Whether `stage` of a model cut into `split` (layers per stage) keeps a top-level module ("tok_emb",
    "pos_emb", "norm_f", "output") or layer ("layers.<i>") of `family` (`Family.stage_holds`: a tied embedding is
    on the last stage too, as the output head, Megatron's embedding copy)."""
    if module.startswith("layers."):
        return int(module.split(".")[1]) in stage_layers(split)[stage]
    return family.stage_holds(module, stage == 0, stage == len(split) - 1)


def stage_param_counts(
    model: ModelConfig, split: Sequence[int], tp: int = 1, per_gpu: bool = False, ep: int = 1
) -> list[int]:
    """Parameters of each pipeline stage as built for a layout with `tp` (the embedding padded for it).

    per_gpu: what one TP and EP rank holds (the family's `tp_dims` split over tp, its `ep_dims` over ep, the rest
    replicated); otherwise the whole stage."""
    rows = padded_vocab(model.vocab_size, model.vocab_pad_multiple, tp)
    tp_split, experts = (tp, ep) if per_gpu else (1, 1)
    family, dims = built_dims(model)
    block = sum(
        tp_local_numel(family, name, shape, tp_split, experts) for name, shape in family.block_shapes(dims).items()
    )
    top: dict[str, int] = {}
    for name, shape in family.top_shapes(dims, rows).items():
        module = name.split(".")[0]
        top[module] = top.get(module, 0) + tp_local_numel(family, name, shape, tp_split, experts)
    counts = []
    for stage, layers in enumerate(stage_layers(split)):
        held = sum(n for module, n in top.items() if stage_holds(family, module, stage, split))
        counts.append(len(layers) * block + held)
    return counts


def model_flops_per_token(n_params: int, n_layers: int, seq_len: int, q_dim: int) -> float:
    """MFU's numerator per token: 6 N + 12 l s h (Chowdhery et al. 2022, PaLM, appendix B).

    No recomputation is counted, and the attention term counts the full s x s score matrix, as Megatron's
    formula does; N is the model's own active parameter count (vocabulary padding is not useful work; a Mixture
    of Experts' token runs top_k of its experts: `model_active_param_count`). The same for every family: 6 N
    already counts a gated MLP's matrices and the narrower K/V projections of grouped-query attention, and the
    score and context matmuls run over all n_heads x head_dim = q_dim columns (h, unless the family sets the head
    width apart: Qwen3)."""
    return 6 * n_params + 12 * n_layers * seq_len * q_dim
