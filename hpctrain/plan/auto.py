"""Decisions the planner makes for a run, as plain data: the layout `parallel=auto` takes, where the configured
layout ranks, and a microbatch count worth suggesting.

Pure: nothing here edits a config (hpctrain.launch applies `layout_overrides`), and a suggestion is only made
when the planner's own estimate says it is faster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hpctrain import schedules
from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu
from hpctrain.plan.search import Candidate, context_degrees
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import Hardware, Layout, ModelShape


def layout_overrides(layout: Layout) -> dict[str, Any]:
    """The config keys (dotted) and values that make a run use `layout` (what `parallel=auto` sets)."""
    return {
        "parallel.dp": layout.dp,
        "parallel.tp": layout.tp,
        "parallel.pp": layout.pp,
        "parallel.ep": layout.ep,
        "parallel.cp": layout.cp,
        "parallel.virtual_stages": layout.virtual_stages,
        "parallel.schedule": layout.schedule,
        "parallel.first_stage_layers": layout.first_stage_layers,
        "parallel.last_stage_layers": layout.last_stage_layers,
        "parallel.sequence_parallel": layout.sequence_parallel,
        "parallel.recompute": layout.recompute,
        "parallel.dp_replicate": 1,
        "parallel.microbatches": 0,
        "zero.stage": layout.zero_stage,
        "zero.accumulate_unsharded": layout.accumulate_unsharded,
        "train.micro_batch": layout.micro_batch,
        "train.grad_accum": layout.grad_accum,
        "parallel.auto": False,
    }


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
    entry = schedules.get(layout.schedule)
    per_rank = layout.micro_batch * layout.grad_accum
    current = estimate_step(model, layout, hw).step_time_s
    best: MicrobatchTip | None = None
    for micro in range(1, per_rank + 1):
        m = per_rank // micro
        if per_rank % micro or micro == layout.micro_batch or m < layout.pp:
            continue
        if entry.microbatches_multiple_of_pp and m % layout.pp:
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
    model: ModelShape, layout: Layout, hw: Hardware, max_cp: int = 32
) -> tuple[Layout, MemoryBreakdown] | None:
    """The smallest CP degree above `layout`'s (search.context_degrees: powers of two up to max_cp that the sequence's
    rules allow) that makes it fit, and its memory; None where none does. The CP ranks come out of DP, so the job's
    GPUs and the global batch stay (each DP rank runs cp' / cp times the micro-batches); never with expert
    parallelism."""
    if layout.ep > 1:
        return None
    ranks = layout.dp * layout.cp
    for cp in context_degrees(model, ranks, max_cp):
        dp = ranks // cp
        if cp <= layout.cp or dp % layout.dp_replicate:
            continue
        trial = replace(layout, cp=cp, dp=dp, grad_accum=layout.global_batch // (layout.micro_batch * dp))
        mem = memory_per_gpu(model, trial, hw)
        if mem.fits:
            return trial, mem
    return None
