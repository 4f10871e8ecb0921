"""The layout search applied to a config: rank layouts for the dry-run plan, or pick one for `parallel=auto`."""

from __future__ import annotations

from typing import Any

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.plan.estimate import cluster_hardware, model_shape
from hpctrain.plan.search import Candidate, evaluate, explain, search_layouts


def search(cfg: Any) -> list[Candidate]:
    """Every legal layout of this model on this job's GPUs that fits, fastest first."""
    n_gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    return search_layouts(model_shape(cfg), n_gpus, cluster_hardware(cfg), cfg.train.global_batch,
                          dtype=cfg.precision.dtype.value)


def apply_best(cfg: Any) -> Candidate:
    """`parallel=auto`: set dp/tp/pp/virtual stages/micro-batch/ZeRO stage/recompute to the best layout."""
    candidates = search(cfg)
    if not candidates:
        raise ConfigError([Problem(
            "parallel.auto", f"no layout of {cfg.model.name} on {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} "
            f"{cfg.cluster.gpu_type} with global batch {cfg.train.global_batch} fits in memory",
            "add nodes, change train.global_batch, or use offload (zero=stage3_offload) with an explicit layout",
        )])
    best = candidates[0]
    lay = best.layout
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp = lay.dp, lay.tp, lay.pp
    cfg.parallel.virtual_stages = lay.virtual_stages
    cfg.parallel.schedule = lay.schedule
    cfg.parallel.sequence_parallel = lay.sequence_parallel
    cfg.parallel.recompute = lay.recompute
    cfg.parallel.dp_replicate = 1
    cfg.parallel.microbatches = 0
    cfg.zero.stage = lay.zero_stage
    cfg.train.micro_batch, cfg.train.grad_accum = lay.micro_batch, lay.grad_accum
    cfg.parallel.auto = False
    return best


def search_section(cfg: Any, estimates: Any, top_k: int) -> dict[str, Any]:
    """The plan's search section: the top layouts and where the configured one ranks, and why."""
    candidates = search(cfg)
    lines = [f"layout search: {len(candidates)} layouts fit on {cfg.cluster.nodes * cfg.cluster.gpus_per_node} "
             f"x {cfg.cluster.gpu_type}, fastest first (estimates)"]
    lines += [f"  {i + 1:>3}. {c.why}" for i, c in enumerate(candidates[:top_k])]
    mine = evaluate(estimates.model, estimates.layout, estimates.hw)
    rank = 1 + sum(1 for c in candidates if c.tokens_per_s > mine.tokens_per_s)
    lines.append(f"  the configured layout ranks {rank} of {len(candidates)}:")
    lines += [f"    {line}" for line in explain(mine, candidates[0] if candidates else None).splitlines()]
    return {
        "title": "layout search",
        "lines": lines,
        "json": {"candidates": len(candidates), "configured_rank": rank,
                 "top": [{"dp": c.layout.dp, "tp": c.layout.tp, "pp": c.layout.pp,
                          "virtual_stages": c.layout.virtual_stages, "micro_batch": c.layout.micro_batch,
                          "grad_accum": c.layout.grad_accum, "zero_stage": c.layout.zero_stage,
                          "recompute": c.layout.recompute, "est_tokens_per_s": c.tokens_per_s,
                          "est_mfu": c.step.mfu, "why": c.why} for c in candidates[:top_k]]},
    }
