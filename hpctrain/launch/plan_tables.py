"""The plan's text sections: parameters per stage, the memory table, the step estimate with its assumptions and
range, and the layout search. Login side: the planner (hpctrain.plan) returns data, this turns it into lines.
"""

from __future__ import annotations

from typing import Any

from hpctrain.plan.estimate import Estimates
from hpctrain.plan.search import Candidate, explain
from hpctrain.plan.types import GiB


def stage_lines(counts: dict[str, Any], tp: int) -> list[str]:
    """Parameters per pipeline rank and per GPU after the TP split (closed form, hpctrain.models.params)."""
    stages, ranks = counts["params_per_stage"], counts["stages_of_rank"]
    lines = [f"parameters per pipeline rank: {len(stages)} stages, TP {tp} ({counts['last_stage_head']} on the "
             "last stage)"]
    for r, (mine, per_gpu) in enumerate(zip(ranks, counts["params_per_gpu_before_zero"])):
        lines.append(f"  pipeline rank {r}: stage(s) {','.join(map(str, mine))} "
                     f"{sum(stages[s] for s in mine):>16,} params, {per_gpu:>15,} per GPU after TP")
    return lines


def memory_lines(est: Estimates) -> list[str]:
    """The most loaded GPU's memory, column by column with its parts, and whether it fits."""
    mem, hw, g = est.memory, est.hw, GiB
    bar_total = max(mem.total, mem.usable)
    lines = [f"per-GPU memory (most loaded GPU: pipeline stage {mem.stage}; {hw.name}, "
             f"{hw.gpu_mem_bytes / g:.0f} GiB, {mem.usable / g:.1f} GiB usable after the reserve)"]
    columns = (("parameters", "params", mem.params), ("gradients", "grads", mem.grads),
               ("optimizer", "optimizer", mem.optimizer), ("activations", "activations", mem.activations),
               ("total", "", mem.total))
    for name, kind, value in columns:
        bar = "#" * round(30 * value / bar_total) if bar_total else ""
        lines.append(f"  {name:<12} {value / g:9.2f} GiB  {bar}")
        lines += [f"  {'':<12} {p.bytes / g:9.2f} GiB    {p.name}" + (" (host memory)" if p.cpu else "")
                  for p in mem.parts if p.kind == kind]
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines.append(f"  {verdict}: headroom {mem.headroom / g:.2f} GiB"
                 + (f"; {mem.cpu_offload_bytes / g:.1f} GiB offloaded to CPU memory" if mem.cpu_offload_bytes else ""))
    return lines


def step_lines(est: Estimates) -> list[str]:
    """The step estimate, the assumptions it rests on and the range they span, then the traffic."""
    st, hw = est.step, est.hw
    comm = sum(i.time_s for i in st.comm.items)
    lines = [
        "step estimate",
        f"  FLOPs per iteration  {est.flops_per_iteration:.3e} (Narayanan et al. 2021, recompute "
        f"{est.layout.recompute})",
        f"  step time            {st.step_time_s:.3f} s = compute {st.compute_s:.3f} + TP {st.tp_s:.3f} + "
        f"PP {st.pp_s:.3f} + bubble {st.bubble_s:.3f} + exposed DP {st.dp_exposed_s:.3f}",
        f"  throughput           {st.tokens_per_s:,.0f} tokens/s, {st.samples_per_s:,.1f} samples/s",
        f"  MFU                  {st.mfu:.1%} (of {_rate(hw.peak_flops)} per GPU, efficiency "
        f"{hw.efficiency:.0%} of peak assumed for matmuls)",
        *range_lines(est),
        f"  pipeline bubble      {st.bubble_fraction:.1%} of the pipeline time ({st.bubble_share:.1%} of the step)",
        f"  communication        {sum(i.bytes for i in st.comm.items) / 1e9:.2f} GB per GPU per step, "
        f"{comm:.3f} s of transfers, {st.comm_share:.1%} of the step exposed",
    ]
    for item in st.comm.items:
        lines.append(f"    {item.name:<28} {item.bytes / 1e9:9.3f} GB over {item.link:<7} {item.time_s:.3f} s")
    return lines


def range_lines(est: Estimates) -> list[str]:
    """The two unsourced constants, what each alone moves the estimate to, and the span of both together."""
    span = est.range
    lines = ["  assumptions          two constants no source pins carry the absolute numbers:"]
    for a, (low, high) in zip(span.assumptions, span.alone):
        lines.append(f"    {a.name} {a.value:g}, plausible {a.low:g}-{a.high:g}: {_samples(low, high)} ({a.why})")
    slow, fast = span.slowest, span.fastest
    lines.append(f"  range                {_samples(slow, fast)}, MFU {slow.mfu:.1%}-{fast.mfu:.1%}, step "
                 f"{fast.step_time_s:.2f}-{slow.step_time_s:.2f} s with both over their intervals: the estimate "
                 "ranks layouts, it does not predict a run")
    return lines


def search_lines(candidates: list[Candidate], mine: Candidate, rank: int, top_k: int, where: str) -> list[str]:
    """The top layouts of the search and where the configured one ranks (`rank`), with what holds it back."""
    lines = [f"layout search: {len(candidates)} layouts fit on {where}, fastest first (estimates)"]
    lines += [f"  {i + 1:>3}. {c.why}" for i, c in enumerate(candidates[:top_k])]
    lines.append(f"  the configured layout ranks {rank} of {len(candidates)}:")
    lines += [f"    {line}" for line in explain(mine, candidates[0] if candidates else None).splitlines()]
    return lines


def _samples(a: Any, b: Any) -> str:
    low, high = sorted((a.samples_per_s, b.samples_per_s))
    return f"{low:,.1f}-{high:,.1f} samples/s"


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.0f} GFLOP/s"
