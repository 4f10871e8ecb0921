"""Pipeline parallelism: cutting the GPT into stages and running them with torch.distributed.pipelining.

A stage is the full model (built on meta) with the layers it does not own deleted and the modules it does
not need set to None, so parameter names stay those of the single-process model and checkpoints load into
any layout. Layers are split evenly (the config checks require pp x virtual_stages to divide n_layers);
the first stage also holds the embeddings, the last the final LayerNorm and the tied head, which needs the
token embedding too: the first and last stages both keep `tok_emb` and the engine sums its gradients
between them (Megatron's embedding group), so both copies take identical steps.

Stage placement: looped schedules put stage s on pipeline rank s % pp; zbv runs a V: rank r holds stages r
and 2 pp - 1 - r (so rank 0 holds the first and the last stage).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from hpctrain.config.layout import Layout
from hpctrain.models.gpt import GPT
from hpctrain.parallel.tensor_parallel import tp_local_numel

SINGLE_STAGE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE_SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Global layer indices of each stage: an even split."""
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers cannot be split evenly into {n_stages} pipeline stages: "
                         "choose parallel.pp x parallel.virtual_stages dividing model.n_layers")
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices held by a pipeline rank, in execution order."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def prune_to_stage(model: GPT, stage: int, n_stages: int) -> GPT:
    """Keep only what `stage` computes (in place); parameter names do not change."""
    keep = stage_layers(len(model.layers), n_stages)[stage]
    for name in list(model.layers):
        if int(name) not in keep:
            del model.layers[name]
    first, last = stage == 0, stage == n_stages - 1
    if not first:
        model.pos_emb = None
    if not (first or last):
        model.tok_emb = None
    if not last:
        model.norm_f = None
    return model


def stage_model(full: GPT, stage: int, n_stages: int) -> GPT:
    """A stage cut from a full model built on the meta device (the full model is left as it was)."""
    return prune_to_stage(copy.deepcopy(full), stage, n_stages)


def build_schedule(stages: list[PipelineStage], schedule: str, n_microbatches: int,
                   loss_fn: Any) -> Any:
    """The schedule object for this rank's stages; `loss_fn` returns the loss of one microbatch.

    scale_grads=True divides the gradients by the number of microbatches: the loss is a mean over them.
    """
    if schedule in SINGLE_STAGE_SCHEDULES:
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule} runs one stage per rank, got {len(stages)}: use "
                             "interleaved_1f1b for virtual stages")
        return SINGLE_STAGE_SCHEDULES[schedule](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                scale_grads=True)
    if schedule in MULTI_STAGE_SCHEDULES:
        return MULTI_STAGE_SCHEDULES[schedule](stages, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                               scale_grads=True)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; known: "
                     f"{sorted(SINGLE_STAGE_SCHEDULES) + sorted(MULTI_STAGE_SCHEDULES)}")


def _meta_model(cfg: Any) -> GPT:
    from hpctrain.parallel.engine import gpt_args

    with torch.device("meta"):
        return GPT(gpt_args(cfg))


def stage_param_counts(cfg: Any, layout: Layout) -> list[int]:
    """Parameters of each pipeline stage (pp x virtual_stages of them), counted on the meta device.

    The last stage counts the tied head's copy of the token embedding. Nothing is allocated: the 175B model
    (96 layers) builds in a fraction of a second.
    """
    full = _meta_model(cfg)
    n_stages = layout.pp * layout.virtual_stages
    return [sum(p.numel() for p in stage_model(full, s, n_stages).parameters()) for s in range(n_stages)]


def rank_param_counts(cfg: Any, layout: Layout) -> list[int]:
    """Parameters on one GPU of each pipeline rank after the TP split (before any ZeRO sharding).

    A rank holding several virtual stages sums them; an uneven TP split counts the largest shard.
    """
    full = _meta_model(cfg)
    n_stages = layout.pp * layout.virtual_stages
    per_stage = [sum(tp_local_numel(name, p.shape, layout.tp)
                     for name, p in stage_model(full, s, n_stages).named_parameters())
                 for s in range(n_stages)]
    return [sum(per_stage[s] for s in stage_ids(r, layout.pp, layout.virtual_stages, cfg.parallel.schedule))
            for r in range(layout.pp)]
