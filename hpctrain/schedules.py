"""The pipeline schedules: one entry each, holding everything the rest of hpctrain asks about a schedule.

The config schema's allowed names, the checks, the planner (bubble, activation memory), the engine (the
torch.distributed.pipelining class, stage placement, the zero-bubble rule) all read this table, so adding a
schedule is one entry plus its tests (docs/planner.md shows the diff that moved 1F1B here). Pure Python, no
torch: the login node plans with it without importing torch; the class is named, and resolved on the task.

Per entry, with p pipeline ranks, m microbatches per step, v model chunks (virtual stages) per rank:
- bubble: idle time per step in units of one full-stage microbatch time (Narayanan et al. 2021, sec. 2.2:
  (p - 1) for GPipe and 1F1B, (p - 1)/v interleaved; Qi et al. 2023 for the zero-bubble family: ZB-H1 a third
  of 1F1B's with T_F = T_B = T_W, ZB-H2 and ZB-V essentially none, an optimistic bound).
- inflight: microbatches whose activations stage i holds at its peak, in units of a whole stage's layers
  (GPipe and looped BFS: all m; 1F1B: min(p - i, m); interleaved: Megatron's warm-up 2(p - i - 1) + (v - 1)p
  chunks plus the one in flight, over v (Korthikanti et al. 2022, sec. 4.2.3); ZB-H2: 2(p - i) - 1; ZB-V: p on
  every stage, its V balances memory).
- chunks: the virtual-stage rule: "one" (exactly 1), "many" (>= 2 when p > 1), "two" (exactly 2).
- placement: "loop" puts stage s on rank s % p; "v" gives rank r stages r and 2p - 1 - r.
- split_backward: weight gradients in a separate pass (zero bubble); with FSDP2-sharded parameters torch 2.13
  loses some of them, so ZeRO >= 1 with DP is rejected for these.
- all_forwards_first: every forward runs before any backward (the last stage keeps all m outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _one_f_one_b(p: int, m: int, v: int, stage: int) -> float:
    return float(min(p - stage, m))


def _interleaved(p: int, m: int, v: int, stage: int) -> float:
    return min((2 * (p - stage - 1) + (v - 1) * p + 1) / v, float(m))


def _all(p: int, m: int, v: int, stage: int) -> float:
    return float(m)


@dataclass(frozen=True)
class Schedule:
    name: str
    torch_class: str | None  # in torch.distributed.pipelining.schedules; None: modelled by the planner only
    chunks: str  # "one" | "many" | "two"
    placement: str  # "loop" | "v"
    bubble: Callable[[int, int], float]  # (p, v) -> idle microbatch-times per step
    inflight: Callable[[int, int, int, int], float]  # (p, m, v, stage) -> microbatches held
    split_backward: bool = False
    all_forwards_first: bool = False
    microbatches_multiple_of_pp: bool = False  # torch's interleaved schedules need m % p == 0
    min_microbatches: Callable[[int, int], int] = lambda p, v: p  # (p, v) -> fewest m the schedule runs
    source: str = ""

    @property
    def runnable(self) -> bool:
        return self.torch_class is not None

    def chunk_problem(self, pp: int, virtual_stages: int) -> tuple[str, str, str] | None:
        """(key, what is wrong, the fix) for `virtual_stages` model chunks on `pp` ranks; None when fine.
        The key is the parallel.* setting to change: "virtual_stages" or "schedule"."""
        v = virtual_stages
        if v > 1 and pp == 1:
            return (
                "virtual_stages",
                f"virtual_stages={v} without pipeline parallelism (pp=1)",
                "set parallel.pp>1 or parallel.virtual_stages=1",
            )
        if pp == 1:
            return None
        if self.chunks == "one" and v != 1:
            return (
                "virtual_stages",
                f"virtual_stages={v} needs a multi-chunk schedule, but {self.name} runs one model chunk per rank",
                "set parallel.schedule=interleaved_1f1b",
            )
        if self.chunks == "many" and v < 2:
            return (
                "schedule",
                f"{self.name} needs parallel.virtual_stages >= 2",
                "set parallel.virtual_stages=2 (or more), or parallel.schedule=1f1b",
            )
        if self.chunks == "two" and v != 2:
            return (
                "virtual_stages",
                f"the {self.name} schedule runs exactly 2 chunks per rank (a V), got {v}",
                "set parallel.virtual_stages=2",
            )
        return None

    def stage_ids(self, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
        """The stage indices a pipeline rank holds, in execution order."""
        if self.placement == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + c * pp for c in range(virtual_stages)]


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "gpipe",
            "ScheduleGPipe",
            "one",
            "loop",
            lambda p, v: p - 1.0,
            _all,
            all_forwards_first=True,
            source="Huang et al. 2019",
        ),
        Schedule(
            "1f1b",
            "Schedule1F1B",
            "one",
            "loop",
            lambda p, v: p - 1.0,
            _one_f_one_b,
            source="Narayanan et al. 2021 (PipeDream-Flush)",
        ),
        Schedule(
            "interleaved_1f1b",
            "ScheduleInterleaved1F1B",
            "many",
            "loop",
            lambda p, v: (p - 1) / v,
            _interleaved,
            microbatches_multiple_of_pp=True,
            source="Narayanan et al. 2021, sec. 2.2",
        ),
        Schedule(
            "looped_bfs",
            "ScheduleLoopedBFS",
            "many",
            "loop",
            lambda p, v: (p - 1) / v,
            _all,
            all_forwards_first=True,
            microbatches_multiple_of_pp=True,
            source="Lamy-Poirier 2023",
        ),
        Schedule(
            "interleaved_zero_bubble",
            "ScheduleInterleavedZeroBubble",
            "many",
            "loop",
            lambda p, v: (p - 1) / (3.0 * v),
            _interleaved,
            split_backward=True,
            microbatches_multiple_of_pp=True,
            source="Qi et al. 2023 (ZB-H1's third of the interleaved bubble, assumed)",
        ),
        Schedule(
            "zbv",
            "ScheduleZBVZeroBubble",
            "two",
            "v",
            lambda p, v: 0.0,
            lambda p, m, v, i: float(min(p, m)),
            split_backward=True,
            source="Qi et al. 2024, Pipeline Parallelism with Controllable Memory",
        ),
        Schedule(
            "dualpipev",
            "ScheduleDualPipeV",
            "two",
            "v",
            lambda p, v: (p - 1) / 6.0,
            lambda p, m, v, i: min(p + 0.5, float(m)),
            split_backward=True,
            min_microbatches=lambda p, v: 2 * p,
            source="DeepSeek-AI 2024, DualPipe (V: 2p chunks on p ranks): bubble (p - 1)(F&B + B - 3W) chunk-times, "
            "= (p - 1)/6 stage-times with F = B = W and no overlap gain; 2p + 1 chunk activations",
        ),
        Schedule(
            "zb_h1",
            None,
            "one",
            "loop",
            lambda p, v: (p - 1) / 3.0,
            _one_f_one_b,
            split_backward=True,
            source="Qi et al. 2023, ZB-H1",
        ),
        Schedule(
            "zb_h2",
            None,
            "one",
            "loop",
            lambda p, v: 0.0,
            lambda p, m, v, i: float(min(2 * (p - i) - 1, m)),
            split_backward=True,
            source="Qi et al. 2023, ZB-H2",
        ),
    )
}
RUNNABLE: tuple[str, ...] = tuple(name for name, s in SCHEDULES.items() if s.runnable)
ALIASES = {"interleaved": "interleaved_1f1b"}


def get(name: str) -> Schedule:
    """The entry for `name` (or an alias); the error lists the known ones."""
    name = ALIASES.get(name, name)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]
