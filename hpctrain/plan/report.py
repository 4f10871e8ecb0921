"""The plan's model sections as plain data: parameter counts, vocabulary padding, parameters per pipeline stage.

Pure and JSON-ready. The login side (hpctrain.launch.plan_view) adds the run, the task environment, the checks'
warnings and the sbatch script, and renders the whole plan as text or JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain import schedules
from hpctrain.models.params import padded_vocab, param_count, stage_param_counts

if TYPE_CHECKING:
    from hpctrain.config.layout import Layout
    from hpctrain.config.schema import ModelConfig


def model_params(m: ModelConfig) -> int:
    """The model's own parameter count, with the tokenizer's vocabulary (what papers publish: GPT-3 175B)."""
    return param_count(m.n_layers, m.d_model, m.vocab_size, m.context, m.ffn_mult * m.d_model)


def vocab_padding(m: ModelConfig, tp: int) -> dict[str, int]:
    """The embedding as built (hpctrain.models.gpt: padded_vocab rows, tied head): rows and parameters it adds."""
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp)
    return {"vocab_size": m.vocab_size, "embedding_rows": rows, "multiple": m.vocab_pad_multiple, "tp": tp,
            "extra_rows": rows - m.vocab_size, "extra_params": (rows - m.vocab_size) * m.d_model}


def model_summary(m: ModelConfig) -> dict[str, Any]:
    return {"name": m.name, "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
            "vocab_size": m.vocab_size, "context": m.context}


def stage_counts(m: ModelConfig, lay: Layout, schedule: str) -> dict[str, list[Any]] | None:
    """Parameters of each pipeline stage, the stages each pipeline rank holds (the schedule's placement), and
    what one GPU of each rank holds after the TP split, before ZeRO; None when the layers do not split evenly.

    Closed form (hpctrain.models.params), exact: the tied head's copy of the embedding counts on the last stage,
    a rank with several virtual stages sums them, and zbv's V puts the first and the last stage on rank 0."""
    n_stages = lay.pp * lay.virtual_stages
    if m.n_layers % n_stages:
        return None
    whole = stage_param_counts(m, n_stages, lay.tp)
    shard = stage_param_counts(m, n_stages, lay.tp, per_gpu=True)
    placement = schedules.get(schedule).stage_ids
    ranks = [placement(r, lay.pp, lay.virtual_stages) for r in range(lay.pp)] if lay.pp > 1 else [[0]]
    return {"params_per_stage": whole, "stages_of_rank": ranks,
            "params_per_gpu_before_zero": [sum(shard[s] for s in ids) for ids in ranks]}
