"""What the per-step control plane costs, and how it scales with the world size.

    python bench/bench_control_plane.py [--worlds 2 4 8 16] [--iters 300]

Every step, the ranks must agree on a few numbers: a stop signal, a newer attempt holding the run (lease),
which checkpoint writes every rank has finished and whether a clock-timed tier is due, and on probe steps the
straggler timings (`hpctrain/train/control.py`). hpctrain carries them in the one all-reduce the step does
anyway (loss and gradient norm), on the engine's device. This measures, on forked gloo ranks of this machine
(tests/distributed_harness.py), per step:

  (a) the step's own all-reduce alone: 2 values (what any trainer does);
  (b) hpctrain: the same all-reduce carrying the control vector too (2 + 3 + 2 values: signals and lease,
      one save in flight, one clock-timed tier);
  (c) a probe step: (b) plus the straggler block, 2 values per rank (every `health.straggler_every` steps);
  (d) what hpctrain did before: (a) plus three small all-reduces of their own (stop flag, checkpoint
      agreement, lease), the pattern of most hand-written trainers.

It also times one all-reduce of n values (n = 2 .. 1024) per world size: gloo's ring splits the vector in
one chunk per rank, so fewer values than ranks is cheaper (empty chunks), and from n >= world on the cost is
flat: the vector's length is not what a step pays for.

Timings are rank 0's mean step time over a block of steps of one variant, the median over 5 rounds that
rotate the order of the variants; results are ratios against (a) in the same run, and go to
bench/control_plane.json. A gloo ring
all-reduce of a few values is latency-bound: 2(W-1) sequential hops, so each collective grows linearly with
the world size; (b) adds no collective, (d) adds three per step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.entry import EntryParser
from tests.distributed_harness import run_distributed  # noqa: E402

STEP_VALUES = 2  # loss, squared gradient norm
SIZES = (2, 7, 16, 64, 1024)
CONTROL_VALUES = 3 + 2  # SIGUSR2, SIGTERM, lease lost; one save in flight, one clock-timed tier


def _variants(world: int) -> dict[str, list[int]]:
    """Per variant, the sizes of the all-reduces one step makes."""
    return {
        "a_step_only": [STEP_VALUES],
        "b_hpctrain": [STEP_VALUES + CONTROL_VALUES],
        "c_probe_step": [STEP_VALUES + CONTROL_VALUES + 2 * world],
        "d_separate": [STEP_VALUES, 2, 2, 1],
    }


def _rank(rank: int, world: int, iters: int, warmup: int) -> dict[str, float] | None:
    """Each variant in blocks of `iters` steps after a barrier, the blocks rotated over 5 rounds: on an
    oversubscribed machine a collective's time is mostly waiting for the last rank to be scheduled, so
    variants are compared block against block, never step against the next step."""
    variants = _variants(world)
    tensors = {name: [torch.zeros(n, dtype=torch.float64) for n in sizes] for name, sizes in variants.items()}
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(5):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            for i in range(warmup + iters):
                if i == warmup:
                    dist.barrier()
                    started = time.perf_counter()
                for t in tensors[name]:
                    dist.all_reduce(t)  # CPU tensors on the gloo default group: this benchmark's only group
            per_step[name].append((time.perf_counter() - started) / iters)
    return {name: statistics.median(ts) * 1e3 for name, ts in per_step.items()} if rank == 0 else None


def _sizes(rank: int, world: int, iters: int, warmup: int) -> dict[int, float] | None:
    """One gloo all-reduce of n values, for n around the world size: what the vector's length costs."""
    out = {}
    for n in SIZES:
        t = torch.zeros(n, dtype=torch.float64)
        for _ in range(warmup):
            dist.all_reduce(t)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)  # CPU tensor, gloo default group
        out[n] = (time.perf_counter() - started) / iters * 1e3
    return out if rank == 0 else None


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "control_plane.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print(
        f"{'world':>5} | {'(a) step ms':>11} | {'(b) hpctrain':>12} | {'(c) probe':>9} | {'(d) separate':>12} | "
        f"{'b/a':>5} | {'c/a':>5} | {'d/a':>5}"
    )
    for world in args.worlds:
        ms = run_distributed(_rank, world, args.iters, args.warmup, timeout=900)[0]
        a = ms["a_step_only"]
        row = {
            "world": world,
            **{k: round(v, 4) for k, v in ms.items()},
            "b_over_a": ms["b_hpctrain"] / a,
            "c_over_a": ms["c_probe_step"] / a,
            "d_over_a": ms["d_separate"] / a,
        }
        rows.append(row)
        print(
            f"{world:>5} | {a:>11.3f} | {ms['b_hpctrain']:>12.3f} | {ms['c_probe_step']:>9.3f} | "
            f"{ms['d_separate']:>12.3f} | {row['b_over_a']:>5.2f} | {row['c_over_a']:>5.2f} | {row['d_over_a']:>5.2f}"
        )
    sizes = {world: run_distributed(_sizes, world, args.iters, args.warmup, timeout=900)[0] for world in args.worlds}
    print(
        "one all-reduce of n values, ms: "
        + "; ".join(
            f"world {w}: " + ", ".join(f"n={n} {ms:.2f}" for n, ms in by_n.items()) for w, by_n in sizes.items()
        )
    )
    args.out.write_text(json.dumps({"iters": args.iters, "rows": rows, "allreduce_ms_by_size": sizes}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
