"""A first-order estimate of one training step's time, to rank layouts (not to promise numbers).

Model (all per GPU, the most loaded one):
  compute  = hardware FLOPs of the iteration (flops.py, with the layout's recomputation) / n_gpus
             / (peak * efficiency). Work is assumed evenly spread (the logit layer on the last stage is not).
  busy     = compute + exposed TP traffic + exposed PP sends. TP collectives sit between the matmuls of
             every layer and are taken as fully exposed; PP sends likewise by default.
  pipeline = busy / (1 - bubble_fraction): the bubble stretches everything a stage does per micro-batch.
  DP       = data-parallel / ZeRO traffic outside the pipeline. Traffic that can overlap compute hides
             at most (1 - dp_exposed) of itself and never more than the compute it can overlap with:
             the last micro-batch's backward for a once-per-step gradient reduction (ZeRO-0/1: the
             reduction waits for the pipeline flush), every backward for per-micro-batch
             reduce-scatters (ZeRO-2/3), the whole compute for ZeRO-3's prefetched all-gathers.
             The parameter all-gather after the optimizer step is exposed.
  step     = pipeline + exposed DP.
Ignored: the optimizer step itself (memory-bound, small once sharded), kernel launch and latency terms,
efficiency loss of small per-GPU matmuls at large TP, stragglers, data loading. Real runs are slower;
the ranking between layouts is what this is for.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.comm import CommBreakdown, comm_per_step
from hpctrain.plan.flops import flops_per_iteration, mfu
from hpctrain.plan.types import Hardware, Layout, ModelShape

BACKWARD_SHARE = 2.0 / 3.0  # backward is ~2x forward: 2/3 of compute without recomputation


@dataclass(frozen=True)
class StepEstimate:
    step_time_s: float
    compute_s: float  # pure matmul time, recomputation included
    tp_s: float  # exposed tensor-parallel traffic
    pp_s: float  # exposed pipeline sends
    bubble_s: float  # idle pipeline time
    dp_s: float  # all data-parallel / ZeRO traffic
    dp_exposed_s: float  # the part of it not hidden behind compute
    bubble_fraction: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    hfu: float  # hardware FLOPs utilisation: counts recomputation as useful work
    comm: CommBreakdown

    @property
    def comm_s(self) -> float:
        """Communication on the critical path (exposed)."""
        return self.tp_s + self.pp_s + self.dp_exposed_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_time_s

    @property
    def bubble_share(self) -> float:
        return self.bubble_s / self.step_time_s

    @property
    def compute_share(self) -> float:
        return self.compute_s / self.step_time_s


def _exposed_dp(comm: CommBreakdown, layout: Layout, compute_s: float, dp_exposed: float) -> float:
    """Exposed DP time: each overlappable item hides at most (1 - dp_exposed) of itself, and only within its window."""
    exposed = 0.0
    for item in comm.items:
        if item.kind != "dp":
            continue
        t = item.time_s
        if item.overlap == "compute":
            window = compute_s
        elif item.overlap == "backward":
            per_microbatch = layout.zero_stage >= 2
            window = BACKWARD_SHARE * compute_s / (1 if per_microbatch else layout.microbatches)
        else:
            exposed += t
            continue
        exposed += max(dp_exposed * t, t - window)
    return exposed


def estimate_step(
    model: ModelShape,
    layout: Layout,
    hw: Hardware,
    dp_exposed: float = 0.5,
    tp_exposed: float = 1.0,
    pp_exposed: float = 1.0,
) -> StepEstimate:
    """Estimated time of one optimizer step of `layout` on `hw`, with its breakdown (see module docstring)."""
    for name, value in (("dp_exposed", dp_exposed), ("tp_exposed", tp_exposed), ("pp_exposed", pp_exposed)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1]")
    n = layout.n_gpus
    flops = flops_per_iteration(model, layout.global_batch, layout.recompute, layout.tp)
    compute_s = flops / n / (hw.peak_flops * hw.efficiency)
    comm = comm_per_step(model, layout, hw)
    tp_s = tp_exposed * comm.time_of("tp")
    pp_s = pp_exposed * comm.time_of("pp")
    busy = compute_s + tp_s + pp_s
    frac = bubble_fraction(layout.pp, layout.microbatches, layout.virtual_stages, layout.schedule)
    pipeline_s = busy / (1.0 - frac)
    dp_s = comm.time_of("dp")
    dp_exp = _exposed_dp(comm, layout, compute_s, dp_exposed)
    step = pipeline_s + dp_exp
    tokens_per_s = layout.global_batch * model.seq_len / step
    return StepEstimate(
        step_time_s=step,
        compute_s=compute_s,
        tp_s=tp_s,
        pp_s=pp_s,
        bubble_s=pipeline_s - busy,
        dp_s=dp_s,
        dp_exposed_s=dp_exp,
        bubble_fraction=frac,
        tokens_per_s=tokens_per_s,
        samples_per_s=layout.global_batch / step,
        mfu=mfu(tokens_per_s, model, n, hw.peak_flops),
        hfu=flops / step / (n * hw.peak_flops),
        comm=comm,
    )
