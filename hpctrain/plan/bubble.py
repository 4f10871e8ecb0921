"""Pipeline bubble: the share of a training step that pipeline stages spend idle.

With p stages, m microbatches per step and per-microbatch time t_mb (forward + backward of one stage),
Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 2.2) give the bubble time (p - 1) * t_mb for GPipe and 1F1B, and (p - 1) / v * t_mb
for the interleaved schedule with v model chunks per GPU, against an ideal m * t_mb. They report
the ratio bubble / ideal = (p - 1) / (v m). We return the fraction of the whole step instead,

    bubble_fraction = bubble / (ideal + bubble) = ((p - 1) / v) / (m + (p - 1) / v),

because that is what a profiler shows and what divides throughput: step = ideal / (1 - fraction).

A rule of thumb in the design article, "microbatches >= 4 x stages gives ~90% efficiency", is
optimistic: m = 4p with p = 8 leaves 1 - 7/39 = 82%; 90% needs m >= 9 (p - 1), i.e. 63 microbatches on
8 stages (or interleaving). With m = 12 on p = 8, as in the article's 175B layout, 7/19 = 37% idles.

Other schedules (names as in torch.distributed.pipelining):
  * "looped_bfs" (Lamy-Poirier 2023, breadth-first): the interleaved bubble (p - 1)/v, but GPipe's memory.
Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split the backward pass
into input-gradient (B) and weight-gradient (W) halves and fill the bubble with W:
  * "zb_h1": same activation memory as 1F1B; with T_F = T_B = T_W its bubble is (p - 1) * t_mb / 3,
    a third of 1F1B's. We return ((p - 1)/3) / (m + (p - 1)/3).
  * "interleaved_zero_bubble": we assume ZB-H1's third of the interleaved bubble, (p - 1)/(3 v).
  * "zb_h2" (about twice 1F1B's activation memory) and "zbv" (Qi et al. 2024, "Pipeline Parallelism with
    Controllable Memory": V-shaped, 2 chunks per GPU, 1F1B's memory): essentially no bubble when
    T_F = T_B = T_W and the optimizer-step synchronisation is bypassed. We return 0.0: an optimistic
    bound, not a measurement; real runs keep a few percent.
"""

from __future__ import annotations

from hpctrain import schedules


def bubble_time_in_microbatches(pp: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle time per step in units of one full-stage microbatch time t_mb (the schedule's registry entry)."""
    if pp < 1 or virtual_stages < 1:
        raise ValueError("pp and virtual_stages must be >= 1")
    entry = schedules.get(schedule)
    if virtual_stages > 1 and entry.chunks == "one":
        raise ValueError(f"virtual_stages > 1 only applies to the multi-chunk schedules, not {schedule}")
    return float(entry.bubble(pp, virtual_stages))


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Fraction of the step the pipeline idles: bubble / (m * t_mb + bubble). 0 when pp == 1."""
    if microbatches < 1:
        raise ValueError("microbatches must be >= 1")
    bubble = bubble_time_in_microbatches(pp, virtual_stages, schedule)
    return bubble / (microbatches + bubble)


def pipeline_efficiency(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Fraction of the step doing useful work: 1 - bubble_fraction (m / (m + p - 1) for 1F1B)."""
    return 1.0 - bubble_fraction(pp, microbatches, virtual_stages, schedule)


def bubble_overhead(pp: int, microbatches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Narayanan 2021's own measure: bubble time over ideal time, (p - 1) / (v m) for interleaved."""
    if microbatches < 1:
        raise ValueError("microbatches must be >= 1")
    return bubble_time_in_microbatches(pp, virtual_stages, schedule) / microbatches


def microbatches_for_efficiency(pp: int, target: float, virtual_stages: int = 1, schedule: str = "1f1b") -> int:
    """Smallest m whose pipeline efficiency reaches `target` (e.g. 0.9 -> 63 for p = 8, 1F1B)."""
    if not 0.0 < target < 1.0:
        raise ValueError("target must be in (0, 1)")
    bubble = bubble_time_in_microbatches(pp, virtual_stages, schedule)
    # m / (m + b) >= target  <=>  m >= b * target / (1 - target)
    m = max(1, int(bubble * target / (1.0 - target)))
    while m / (m + bubble) < target:
        m += 1
    while m > 1 and (m - 1) / (m - 1 + bubble) >= target:
        m -= 1
    return m
