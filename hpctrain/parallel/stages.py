"""Which stage holds what, and parameter counts per stage and per GPU, without building anything real.

Kept apart from pipeline.py (which imports torch.distributed.pipelining and the engine) so the dry-run plan
can count the 175B model's parameters per stage on the meta device in well under a second.
"""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.config.layout import Layout
from hpctrain.models.gpt import GPT, gpt_args

# Parameters TP splits, and along which dim (Colwise: dim 0 of the weight and bias; Rowwise: dim 1).
SHARDED_DIMS: dict[str, int] = {
    "tok_emb.weight": 0,
    "attn.qkv.weight": 0,
    "attn.qkv.bias": 0,
    "attn.proj.weight": 1,
    "mlp.fc.weight": 0,
    "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
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

def stage_holds(module: str, stage: int, n_stages: int, n_layers: int) -> bool:
    """Whether `stage` keeps a top-level module ("tok_emb", "pos_emb", "norm_f") or layer ("layers.<i>")."""
    first, last = stage == 0, stage == n_stages - 1
    if module.startswith("layers."):
        return int(module.split(".")[1]) in stage_layers(n_layers, n_stages)[stage]
    return {"pos_emb": first, "tok_emb": first or last, "norm_f": last}.get(module, True)

def tp_local_numel(name: str, shape: torch.Size, tp: int) -> int:
    """Elements of parameter `name` on one TP rank (the largest shard when the split is uneven)."""
    numel = 1
    for size in shape:
        numel *= size
    dim = next((d for suffix, d in SHARDED_DIMS.items() if name.endswith(suffix)), None)
    if dim is None or tp == 1:
        return numel
    return numel // shape[dim] * -(-shape[dim] // tp)


def stage_param_counts(cfg: Any, layout: Layout) -> list[int]:
    """Parameters of each pipeline stage (pp x virtual_stages of them), counted on the meta device.

    The last stage counts the tied head's copy of the token embedding. Nothing is allocated: the 175B model
    (96 layers) builds in a fraction of a second.
    """
    return param_counts(cfg, layout)[0]


def rank_param_counts(cfg: Any, layout: Layout) -> list[int]:
    """Parameters on one GPU of each pipeline rank after the TP split (before any ZeRO sharding).

    A rank holding several virtual stages sums them; an uneven TP split counts the largest shard.
    """
    return param_counts(cfg, layout)[1]


def param_counts(cfg: Any, layout: Layout) -> tuple[list[int], list[int]]:
    """(parameters per stage, parameters per GPU of each pipeline rank after TP), from one meta build."""
    named = list(_meta_model(cfg).named_parameters())
    n_stages, n_layers = layout.pp * layout.virtual_stages, cfg.model.n_layers
    stages, per_stage = [], []
    for s in range(n_stages):
        mine = [(name, p) for name, p in named if stage_holds(_module_of(name), s, n_stages, n_layers)]
        stages.append(sum(p.numel() for _, p in mine))
        per_stage.append(sum(tp_local_numel(name, p.shape, layout.tp) for name, p in mine))
    ranks = [sum(per_stage[s] for s in stage_ids(r, layout.pp, layout.virtual_stages, cfg.parallel.schedule))
             for r in range(layout.pp)]
    return stages, ranks


def _module_of(param: str) -> str:
    """"layers.3.attn.qkv.weight" -> "layers.3"; "tok_emb.weight" -> "tok_emb"."""
    parts = param.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _meta_model(cfg: Any) -> GPT:
    with torch.device("meta"):
        return GPT(gpt_args(cfg))
