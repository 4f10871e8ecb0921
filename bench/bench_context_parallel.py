"""Context-parallel attention on CPU gloo ranks: hpctrain's all-gather of K/V against a ring, and the ideal.

    python bench/bench_context_parallel.py [--rounds 4] [--warmup 1] [--cps 2 4] [--shapes 2048:2 2048:8 4096:2]

Why: issue 33 asks to pick between all-gathering keys and values over the CP group (what Llama 3 did) and passing
them round a ring, with a measurement. torch's own `context_parallel` cannot be the ring here: it only dispatches
the CUDA SDPA ops (flash / efficient / cuDNN), and its default rotate method is itself "allgather"
(`_ContextParallelOptions.rotate_method = _RotateMethod.ALL_GATHER`; `set_rotate_method("alltoall")` switches to a
shift by all-to-all). So the ring is our own, bench/ring_attention.py (tested exact against full causal SDPA, forward
and backward, tests/parallel/test_ring_attention_bench.py).

What: one attention layer's core, fp32, batch 1, 8 query heads of 64, GQA with `kv` key/value heads, sequence
`seq` in hpctrain's load-balanced layout (CP rank r holds chunks r and 2 cp - 1 - r of 2 cp), on cp gloo ranks forked
from this process (tests/distributed_harness.py, one thread each):
  (a) allgather  hpctrain.parallel.context_parallel.cp_attention: functional all-gathers of K and V (autograd:
                 reduce-scatters backward), one SDPA per local chunk with a bottom-right causal mask;
  (b) ring       bench/ring_attention.ring_attention: cp - 1 K/V sends forward, each overlapped with the current
                 block's flash-kernel pieces, merged by log-sum-exp; cp dK/dV accumulator sends backward;
  (d) allgather_flash  bench/ring_attention.allgather_flash_attention: one functional all-gather of stacked K/V,
                 then exactly the ring's flash pieces and merge, no P2P: (d) against (b) is the communication
                 pattern alone, (a) against (d) cp_attention's kernel choice (SDPA with an explicit c x end
                 bottom-right mask: the CPU flash kernel then computes every key block, masked or not, and
                 reads the mask; 1024 queries against 2048 keys, GQA 8/2, fp32, one thread: 108 ms masked, 83 ms
                 unmasked, 74 ms as an unmasked piece + an is_causal square, checked once on this machine);
  (c) ideal      every rank computes the whole sequence's causal SDPA (hpctrain's CausalAttention) at the same time
                 (so the same cores are shared the same way), its time divided by cp: perfect scaling, no traffic.
Each forward alone (no_grad) and forward + backward (given output gradient). The variants take turns
(a b d c a b d c ..., forward then forward + backward each round), `--rounds` rounds after `--warmup` untimed ones;
each timing starts after a barrier and is the slowest rank's wall time. A figure is the median over rounds; a ratio
the median of the per-round ratios (a/c, b/c, d/c, b/a, b/d; their spread says how noisy the machine was).

Traffic (analytic, per rank and layer, the bench's dtype): both designs receive (cp - 1)/cp of the whole sequence's
K and V. The all-gather in 2 collectives forward (K, V) and 2 reduce-scatters backward; the ring in cp - 1 P2P
send/receive pairs forward (K and V stacked) and cp backward (the dK/dV accumulators, the last one bringing each
home). What this cannot show: gloo on 2 shared cores has no NVLink/InfiniBand and no compute/copy engines that run
beside the kernels, so the ring's overlap buys little here and the collectives' cost is memcpy-bound; cp 4 puts
4 ranks on 2 cores (each rank's time then includes waiting for a core, for (c) too). Prints a table and writes
bench/context_parallel.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ring_attention import allgather_flash_attention, ring_attention  # noqa: E402
from hpctrain.entry import EntryParser
from hpctrain.models.common.attention import CausalAttention  # noqa: E402
from hpctrain.parallel.context_parallel import cp_attention  # noqa: E402
from tests.distributed_harness import run_distributed  # noqa: E402

HEADS, HEAD_DIM, BATCH = 8, 64, 1
VARIANTS = ("allgather", "ring", "allgather_flash", "ideal")
MODES = ("fwd", "fwd_bwd")


def _timed(fn: Callable[[], None]) -> float:
    """The slowest rank's wall seconds for fn, all ranks starting after a barrier."""
    dist.barrier()
    started = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _worker(rank: int, cp: int, shapes: list[tuple[int, int]], rounds: int, warmup: int) -> dict[str, Any]:
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for seq, kv in shapes:
        g = torch.Generator().manual_seed(rank)
        local = seq // cp

        def rand(heads: int, length: int) -> torch.Tensor:
            return torch.randn(BATCH, heads, length, HEAD_DIM, generator=g).requires_grad_()

        inputs = {
            "allgather": (rand(HEADS, local), rand(kv, local), rand(kv, local)),
            "ideal": (rand(HEADS, seq), rand(kv, seq), rand(kv, seq)),
        }
        inputs["ring"] = inputs["allgather_flash"] = inputs["allgather"]
        douts = {
            "allgather": torch.randn(BATCH, HEADS, local, HEAD_DIM, generator=g),
            "ideal": torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=g),
        }
        douts["ring"] = douts["allgather_flash"] = douts["allgather"]
        fns = {
            "allgather": lambda q, k, v: cp_attention(q, k, v, group),
            "ring": lambda q, k, v: ring_attention(q, k, v, group),
            "allgather_flash": lambda q, k, v: allgather_flash_attention(q, k, v, group),
            "ideal": CausalAttention(),
        }

        def run(variant: str, mode: str) -> None:
            if mode == "fwd":
                with torch.no_grad():
                    fns[variant](*inputs[variant])
            else:
                fns[variant](*inputs[variant]).backward(douts[variant])

        times: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in MODES}
        for r in range(warmup + rounds):
            for mode in MODES:
                for variant in VARIANTS:
                    t = _timed(lambda: run(variant, mode))
                    if r >= warmup:
                        times[mode][variant].append(t / cp if variant == "ideal" else t)
        out[f"{seq}:{kv}"] = times
    return out


def traffic(cp: int, seq: int, kv: int, elem: int = 4) -> dict[str, Any]:
    """Bytes each rank receives per layer and the launches, per design (analytic)."""
    local_kv = 2 * BATCH * kv * (seq // cp) * HEAD_DIM * elem
    moved = (cp - 1) * local_kv
    return {
        "local_kv_bytes": local_kv,
        "full_kv_bytes": cp * local_kv,
        "kv_over_q": kv / HEADS,
        "allgather": {
            "fwd_bytes": moved,
            "bwd_bytes": moved,
            "fwd_launches": 2,
            "bwd_launches": 2,
            "launch_kind": "all_gather_into_tensor (K, V) / reduce_scatter_tensor backward",
        },
        "ring": {
            "fwd_bytes": moved,
            "bwd_bytes": cp * local_kv,
            "fwd_launches": cp - 1,
            "bwd_launches": cp,
            "launch_kind": "batch_isend_irecv (1 send + 1 recv, K/V stacked) per step",
        },
        "allgather_flash": {
            "fwd_bytes": moved,
            "bwd_bytes": moved,
            "fwd_launches": 1,
            "bwd_launches": 1,
            "launch_kind": "all_gather_into_tensor (K/V stacked) / reduce_scatter_tensor",
        },
    }


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--shapes", nargs="+", default=["2048:2", "2048:8", "4096:2"], help="seq:kv_heads")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "context_parallel.json")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    print(
        f"batch {BATCH}, {HEADS} query heads of {HEAD_DIM}, fp32, gloo, 1 thread a rank on {os.cpu_count()} cores; "
        f"{args.rounds} rounds after {args.warmup}, interleaved; ideal = full causal SDPA / cp"
    )
    print(
        f"{'cp':>2} {'seq':>5} {'kv':>2} {'mode':7} {'allg ms':>8} {'ring ms':>8} {'ideal ms':>8} "
        f"{'flash ms':>8} {'a/c':>6} {'b/c':>6} {'d/c':>6} {'b/a':>6} {'b/d':>6} {'b/d min-max':>12} "
        f"{'KV MiB in':>9}"
    )
    results: list[dict[str, Any]] = []
    for cp in args.cps:
        times = run_distributed(_worker, cp, shapes, args.rounds, args.warmup, timeout=900)[0]
        for seq, kv in shapes:
            row: dict[str, Any] = {"cp": cp, "seq": seq, "kv_heads": kv, "traffic": traffic(cp, seq, kv)}
            for mode in MODES:
                t = times[f"{seq}:{kv}"][mode]
                a, b, c, d = t["allgather"], t["ring"], t["ideal"], t["allgather_flash"]
                ba, bd = [y / x for x, y in zip(a, b)], [y / x for x, y in zip(d, b)]
                row[mode] = {
                    **{f"{v}_ms": statistics.median(t[v]) * 1e3 for v in VARIANTS},
                    **{f"{v}_ms_rounds": [x * 1e3 for x in t[v]] for v in VARIANTS},
                    "allgather_over_ideal": statistics.median(x / z for x, z in zip(a, c)),
                    "ring_over_ideal": statistics.median(y / z for y, z in zip(b, c)),
                    "allgather_flash_over_ideal": statistics.median(x / z for x, z in zip(d, c)),
                    "ring_over_allgather": statistics.median(ba),
                    "ring_over_allgather_rounds": ba,
                    "ring_over_allgather_flash": statistics.median(bd),
                    "ring_over_allgather_flash_rounds": bd,
                }
                r = row[mode]
                print(
                    f"{cp:2} {seq:5} {kv:2} {mode:7} {r['allgather_ms']:8.1f} {r['ring_ms']:8.1f} "
                    f"{r['ideal_ms']:8.1f} {r['allgather_flash_ms']:8.1f} {r['allgather_over_ideal']:6.2f} "
                    f"{r['ring_over_ideal']:6.2f} {r['allgather_flash_over_ideal']:6.2f} "
                    f"{r['ring_over_allgather']:6.2f} {r['ring_over_allgather_flash']:6.2f} "
                    f"{min(bd):5.2f}-{max(bd):.2f} "
                    f"{row['traffic']['allgather']['fwd_bytes'] / 2**20:9.2f}"
                )
            results.append(row)
    took = time.perf_counter() - started
    print(
        f"KV MiB in: K/V bytes each rank receives per layer forward, the same for both designs; "
        f"the bench took {took:.0f} s, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    args.out.write_text(
        json.dumps(
            {
                "batch": BATCH,
                "heads": HEADS,
                "head_dim": HEAD_DIM,
                "dtype": "fp32",
                "threads_per_rank": 1,
                "cores": os.cpu_count(),
                "backend": "gloo",
                "rounds": args.rounds,
                "warmup": args.warmup,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg()[0],
                "seconds": took,
                "torch": torch.__version__,
                "rows": results,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
