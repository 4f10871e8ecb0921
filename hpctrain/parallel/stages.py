"""Which pipeline stage holds what, on the task side, and the meta-device count that checks the plan's numbers.

The placement rules and the per-stage parameter counts are pure arithmetic in hpctrain.models.params (the
login node plans without torch); they are re-exported here for the engine's pipeline code. `meta_stage_counts`
builds the real model on the meta device and counts what each stage and TP shard holds: the reference the
closed form is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hpctrain.models import create_model, registry
from hpctrain.models.params import stage_holds, stage_layers, tp_local_numel

if TYPE_CHECKING:
    from hpctrain.config.schema import Config

__all__ = ["meta_stage_counts", "stage_holds", "stage_layers", "tp_local_numel"]


def meta_stage_counts(cfg: Config, split: Sequence[int], tp: int) -> tuple[list[int], list[int]]:
    """(parameters per stage, per GPU of each stage after the TP split), from the model built on the meta device.

    Nothing is allocated; with a tied head (GPT) the last stage counts its copy of the token embedding. `cfg` is
    the run's config (the model of model.arch as built for cfg.parallel.tp)."""
    with torch.device("meta"):
        model = create_model(cfg.model, cfg.parallel.tp)
    named, family = list(model.named_parameters()), registry.family_of(cfg.model)
    whole, shard = [], []
    for s in range(len(split)):
        mine = [(name, p) for name, p in named if stage_holds(family, _module_of(name), s, split)]
        whole.append(sum(p.numel() for _, p in mine))
        shard.append(sum(tp_local_numel(family, name, tuple(p.shape), tp) for name, p in mine))
    return whole, shard


def _module_of(param: str) -> str:
    """ "layers.3.attn.qkv.weight" -> "layers.3"; "tok_emb.weight" -> "tok_emb"."""
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]
