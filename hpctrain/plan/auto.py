"""Decisions the planner makes for a run, as plain data: the layout `parallel=auto` takes, where the configured
layout ranks, and a microbatch count worth suggesting.

Pure: nothing here edits a config (hpctrain.launch applies `layout_overrides`), and a suggestion is only made
when the planner's own estimate says it is faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.config.cluster import cluster_hardware
from hpctrain.config.layout import layout_rules
from hpctrain.config.rules import key_of, microbatch_rules, zero_rules
from hpctrain.config.schema import simulating
from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu
from hpctrain.plan.search import Candidate, context_degrees, search_layouts, workload
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import Hardware, Layout, ModelShape

if TYPE_CHECKING:
    from hpctrain.config.schema import Config

# The Layout fields `parallel=auto` sets from the layout it picks (config keys: config.rules.key_of)
CHOSEN = (
    "dp",
    "tp",
    "pp",
    "ep",
    "cp",
    "virtual_stages",
    "schedule",
    "first_stage_layers",
    "last_stage_layers",
    "sequence_parallel",
    "recompute",
    "zero_stage",
    "accumulate_unsharded",
    "micro_batch",
    "grad_accum",
)


def layout_overrides(layout: Layout) -> dict[str, Any]:
    """The config keys (dotted) and values that make a run use `layout` (what `parallel=auto` sets)."""
    return {
        **{key_of(field): getattr(layout, field) for field in CHOSEN},
        key_of("dp_replicate"): 1,
        key_of("microbatches"): 0,
        key_of("auto"): False,
    }


def auto_candidates(cfg: Config) -> list[Candidate]:
    """The layouts `parallel=auto` chooses from, fastest first (hpctrain.launch.cli.apply_auto takes the first): the
    search on the run's model, GPUs, global batch, precision, torch.compile, and the ZeRO stages its offload
    settings allow. Each obeys the layout rules the checks report (search.search_layouts)."""
    c, p = cfg.cluster, cfg.precision
    return search_layouts(
        ModelShape.of(cfg.model, cfg.train.seq_len),
        c.nodes * c.gpus_per_node,
        cluster_hardware(c),
        cfg.train.global_batch,
        dtype=str(getattr(p.dtype, "value", p.dtype)),
        reduce_dtype=str(getattr(p.reduce_dtype, "value", p.reduce_dtype)),
        zero_stages=zero_stages_for(bool(cfg.zero.offload_optimizer), bool(cfg.zero.offload_params)),
        compile=bool(cfg.parallel.compile),
        fp8=str(p.fp8),
        simulate=simulating(cfg),
    )


def zero_stages_for(offload_optimizer: bool, offload_params: bool) -> tuple[int, ...]:
    """The ZeRO stages a run's offload settings allow (config.rules.zero_rules, and the layout's own rule that
    parameter offload needs stage 3): those the search may pick for it (it estimates them without offload)."""
    allowed = []
    for z in (0, 1, 2, 3):
        try:
            Layout(dp=1, tp=1, pp=1, zero_stage=z, offload_optimizer=offload_optimizer, offload_params=offload_params)
        except ValueError:
            continue
        if not zero_rules(z, 1, offload_optimizer):
            allowed.append(z)
    return tuple(allowed)


def search_summary(candidates: list[Candidate], mine: Candidate, top_k: int) -> dict[str, Any]:
    """The search as data: how many layouts fit, where the configured one ranks, the top ones."""
    rank = 1 + sum(1 for c in candidates if c.tokens_per_s > mine.tokens_per_s)
    return {
        "candidates": len(candidates),
        "configured_rank": rank,
        "top": [
            {
                "dp": c.layout.dp,
                "tp": c.layout.tp,
                "pp": c.layout.pp,
                "ep": c.layout.ep,
                "cp": c.layout.cp,
                "virtual_stages": c.layout.virtual_stages,
                "first_stage_layers": c.layout.first_stage_layers,
                "last_stage_layers": c.layout.last_stage_layers,
                "micro_batch": c.layout.micro_batch,
                "grad_accum": c.layout.grad_accum,
                "zero_stage": c.layout.zero_stage,
                "accumulate_unsharded": c.layout.accumulate_unsharded,
                "recompute": c.layout.recompute,
                "est_tokens_per_s": c.tokens_per_s,
                "est_mfu": c.step.mfu,
                "why": c.why,
            }
            for c in candidates[:top_k]
        ],
    }


@dataclass(frozen=True)
class MicrobatchTip:
    """A micro-batch size (and so a microbatch count) for the same global batch that the estimate finds faster."""

    micro_batch: int
    microbatches: int
    bubble_fraction: float
    step_time_s: float
    current_step_time_s: float

    @property
    def speedup(self) -> float:
        return self.current_step_time_s / self.step_time_s


def better_microbatches(
    model: ModelShape, layout: Layout, hw: Hardware, min_speedup: float = 1.02
) -> MicrobatchTip | None:
    """The fastest other split of each DP rank's batch into microbatches that fits and is legal for the
    schedule, if the estimate says it is at least `min_speedup` times faster; None otherwise.

    More microbatches shrink the bubble but, under ZeRO-3, re-gather the weights once more each: the step-time
    estimate weighs both, a rule of thumb does not. Gains under 2% are below what the estimate can tell apart."""
    if layout.pp == 1:
        return None
    per_rank = layout.micro_batch * layout.grad_accum
    current = estimate_step(model, layout, hw).step_time_s
    best: MicrobatchTip | None = None
    for micro in range(1, per_rank + 1):
        m = per_rank // micro
        if per_rank % micro or micro == layout.micro_batch:
            continue
        if microbatch_rules(layout.schedule, layout.pp, layout.virtual_stages, m):
            continue
        trial = replace(layout, micro_batch=micro, grad_accum=m)
        if not memory_per_gpu(model, trial, hw).fits:
            continue
        step = estimate_step(model, trial, hw).step_time_s
        if step * min_speedup <= current and (best is None or step < best.step_time_s):
            frac = bubble_fraction(layout.pp, m, layout.virtual_stages, layout.schedule)
            best = MicrobatchTip(micro, m, frac, step, current)
    return best


def context_for_fit(
    model: ModelShape, layout: Layout, hw: Hardware, max_cp: int = 32, compile: bool = False
) -> tuple[Layout, MemoryBreakdown] | None:
    """The smallest CP degree above `layout`'s (search.context_degrees: powers of two up to max_cp that the context
    rules allow, so none for an MoE model or with expert parallelism) that makes it fit, and its memory; None where
    none does. The CP ranks come out of DP, so the job's GPUs and the global batch stay (each DP rank runs cp' / cp
    times the micro-batches). `compile`: the run's parallel.compile. What it returns passes the layout rules."""
    w = workload(model, hw, compile)
    ranks = layout.dp * layout.cp
    for cp in context_degrees(w, ranks, max_cp, layout.ep):
        dp = ranks // cp
        if cp <= layout.cp or dp % layout.dp_replicate:
            continue
        trial = replace(layout, cp=cp, dp=dp, grad_accum=layout.global_batch // (layout.micro_batch * dp))
        if layout_rules(trial, w):
            continue
        mem = memory_per_gpu(model, trial, hw)
        if mem.fits:
            return trial, mem
    return None
