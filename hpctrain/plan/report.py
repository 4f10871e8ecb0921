"""The plan's model sections as plain data: parameter counts (a Mixture of Experts' active ones too), vocabulary
padding, parameters per pipeline stage.

Pure and JSON-ready. The login side (hpctrain.launch.plan_view) adds the run, the task environment, the checks'
warnings and the sbatch script, and renders the whole plan as text or JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.config.rules import layer_split
from hpctrain.models import registry
from hpctrain.models.family import Dims
from hpctrain.models.params import (
    arch_of,
    ffn_hidden_of,
    kv_heads_of,
    model_active_param_count,
    model_param_count,
    padded_vocab,
    stage_param_counts,
    tied_of,
)

if TYPE_CHECKING:
    from hpctrain.config.layout import Layout
    from hpctrain.config.schema import ModelConfig


def model_params(m: ModelConfig) -> int:
    """The model's own parameter count, with the tokenizer's vocabulary (what papers publish: GPT-3 175B,
    Llama 3 405B)."""
    return model_param_count(m)


def active_params(m: ModelConfig) -> int | None:
    """A Mixture of Experts' parameters per token (top_k of each layer's experts: what model cards publish as
    "active", Mixtral-8x7B 12.9B); None for a dense model, whose every parameter is active."""
    return model_active_param_count(m) if registry.family_of(m).moe else None


def vocab_padding(m: ModelConfig, tp: int) -> dict[str, int]:
    """The embedding as built (padded_vocab rows; GPT's head tied to it, Llama's a second matrix of as many rows):
    rows and parameters the padding adds."""
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp)
    matrices = 1 if tied_of(m) else 2
    return {
        "vocab_size": m.vocab_size,
        "embedding_rows": rows,
        "multiple": m.vocab_pad_multiple,
        "tp": tp,
        "extra_rows": rows - m.vocab_size,
        "extra_params": matrices * (rows - m.vocab_size) * m.d_model,
    }


def model_summary(m: ModelConfig) -> dict[str, Any]:
    """The model's shape; a Mixture of Experts adds its experts (how many, per token, their width, shared ones)."""
    out = {
        "name": m.name,
        "arch": arch_of(m),
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": kv_heads_of(m),
        "ffn_hidden": ffn_hidden_of(m),
        "vocab_size": m.vocab_size,
        "context": m.context,
    }
    if registry.family_of(m).moe:
        d = Dims.of(m)
        out["moe"] = {
            "n_experts": d.n_experts,
            "top_k": d.top_k,
            "expert_hidden": d.expert_hidden,
            "n_shared_experts": d.n_shared_experts,
        }
    return out


def stage_counts(m: ModelConfig, lay: Layout) -> dict[str, Any] | None:
    """Parameters of each pipeline stage, the stages each pipeline rank holds (the schedule's placement), and
    what one GPU of each rank holds after the TP split (and the EP split of the experts), before ZeRO; None when
    the layers do not split into its stages.

    Closed form (hpctrain.models.params), exact: the output head counts on the last stage (GPT: the tied head's
    copy of the embedding; Llama: its own matrix), a rank with several virtual stages sums them, and zbv's V puts
    the first and the last stage on rank 0."""
    split = layer_split(m.n_layers, lay.n_stages, lay.first_stage_layers, lay.last_stage_layers)
    if split is None:
        return None
    whole = stage_param_counts(m, split, lay.tp)
    shard = stage_param_counts(m, split, lay.tp, per_gpu=True, ep=getattr(lay, "ep", 1))
    ranks = [list(lay.stages_of(r)) for r in range(lay.pp)]
    head = "the tied head's embedding copy" if tied_of(m) else "the output head"
    return {
        "params_per_stage": whole,
        "layers_per_stage": list(split),
        "stages_of_rank": ranks,
        "last_stage_head": head,
        "params_per_gpu_before_zero": [sum(shard[s] for s in ids) for ids in ranks],
    }
