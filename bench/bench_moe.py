"""An MoE training step on 2 CPU ranks with expert parallelism 2 against EP 1 and against a dense model.

The same model with EP 1, a dense model of equal active FLOPs, and the all-to-all's share of the EP 2 step.

    python bench/bench_moe.py [--rounds 7] [--steps 3] [--warmup 2] [--zero 1]

The model is a Qwen3-MoE (model.arch=qwen3_moe): 4 layers, d 256, 8 query heads of 32 sharing 4 key/value heads,
per-head q/k norms; each block's MLP is 8 SwiGLU experts of hidden 256, 2 per token (softmax router, dropless);
vocabulary 2000 padded to 2048; fp32. It runs on 2 gloo ranks forked from this process
(tests/distributed_harness.py: one thread each, this machine's 2 cores), dp 2, each rank a micro-batch of 4
sequences of 128 random tokens a step, through hpctrain's engine:
  (a)  ep2     parallel.ep=2: each rank holds 4 experts of each layer and sends every token to the rank holding
               its experts and back (hpctrain.models.common.moe.GroupedExperts._dispatch: all-to-alls of the counts,
               the rows and the results forward, two backward);
  (b)  ep1     the same model with parallel.ep=1: each rank holds all 8 experts, whose gradients are all-reduced
               with the rest;
  (c)  dense   model.arch=qwen3, the same attention and a SwiGLU MLP of hidden top_k x 256 = 512: the MoE's active
               FLOPs but the router's (8 x 256 multiply-adds a token and layer);
  (a') ep2 a2a (a)'s engine, its dispatch's collectives clocked (`timed_all_to_all`).
With zero.stage=1 (the default) all three run under FSDP2, like for like (EP 1 then shards the experts' optimizer
states too). `--zero 0` compares wrappers as well: (a) runs under FSDP2's replicate (DDP cannot hold EP's DTensor
experts), (b) and (c) under DDP, which is cheaper on CPU.

Timing: the variants take turns step by step (a b c a' a b c a' ...), `--rounds` rounds of `--steps` steps, after
`--warmup` untimed steps each, so that a machine that gets busier slows all alike. Every step starts after a
barrier and takes the slower rank's wall time; a variant's figure is the median over rounds of its round's median
step. Wall clock only: the process's CPU time would count gloo's threads and miss the waits on the peer rank, both
part of what expert parallelism costs. The ratios a/b and a/c are step times (< 1: EP 2 is faster), their spread
over the rounds says how noisy the machine was.

The all-to-all's share: during (a') the two functions _dispatch calls through their modules,
`torch.distributed.all_to_all_single` (the counts) and `_functional_collectives.all_to_all_single_autograd` (rows
and results), are replaced by ones that return only once the result is there, forward and backward, and add the
seconds from the call until then: the time the rank's step spent in the dispatch's collectives, the wait for the
peer included. The functional all-to-all is asynchronous (waited at the result's first use, a few small index ops
later; its backward waits at once): the clock waits at once, giving up that overlap. The share is that time over
the rank's own step time, averaged over the ranks; (a')/(a) is what the clock costs, and its count of all-to-alls
a step (3 forward and 2 backward per layer) checks that it caught each one. The clock includes what the EP ranks
wait on each other's experts: `ep_rank_load` is the busiest rank's share of the routed tokens over the mean.
Prints a table and writes bench/moe.json.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.config.layout import resolve_layout  # noqa: E402
from hpctrain.config.schema import Config  # noqa: E402
from hpctrain.entry import EntryParser
from tests.distributed_harness import run_distributed  # noqa: E402

RANKS = 2
VOCAB = 2000
SEQ = 128
MICRO_BATCH = 4  # sequences per rank and step
LR = 1e-3
EXPERT_HIDDEN, TOP_K = 256, 2
MOE_MODEL = {
    "name": "bench_moe",
    "arch": "qwen3_moe",
    "n_layers": 4,
    "d_model": 256,
    "n_heads": 8,
    "n_kv_heads": 4,
    "ffn_hidden": EXPERT_HIDDEN,
    "vocab_size": VOCAB,
    "context": 2048,
    "norm_eps": 1e-6,
    "rope": {"theta": 1000000.0},
    "moe": {"n_experts": 8, "top_k": TOP_K, "expert_hidden": EXPERT_HIDDEN, "router": "softmax"},
}
DENSE_MODEL = {
    **{k: v for k, v in MOE_MODEL.items() if k != "moe"},
    "name": "bench_dense",
    "arch": "qwen3",
    "ffn_hidden": TOP_K * EXPERT_HIDDEN,
}
VARIANTS = ("ep2", "ep1", "dense", "ep2_a2a")  # ep2_a2a: ep2's engine under timed_all_to_all


def make_cfg(model: dict[str, Any], ep: int, zero: int) -> Any:
    """The config of one variant: dp RANKS, one micro-batch per rank and step."""
    return OmegaConf.merge(
        OmegaConf.structured(Config),
        {
            "model": model,
            "cluster": {"name": "bench", "nodes": 1, "gpus_per_node": RANKS},
            "train": {"global_batch": RANKS * MICRO_BATCH, "micro_batch": MICRO_BATCH, "seq_len": SEQ, "seed": 1},
            "optim": {"lr": LR, "warmup_steps": 0, "grad_clip": 1.0},
            "parallel": {"ep": ep},
            "zero": {"stage": zero},
        },
    )


def batch_of(step: int, dp_rank: int) -> torch.Tensor:
    """This rank's random batch of the step, as Engine.step takes it: [2 (inputs, targets), 1, MICRO_BATCH, SEQ]."""
    data = torch.randint(
        0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + dp_rank)
    )
    return torch.stack((data[:, :-1], data[:, 1:]))[:, None]


# ---------------------------------------------------------------- the all-to-all clock


class A2AClock:
    """Seconds spent in all-to-alls and how many ran, while `timed_all_to_all` is open."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def add(self, started: float) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1


def _waited_all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup, clock: A2AClock
) -> torch.Tensor:
    """The functional all-to-all (the op all_to_all_single_autograd runs), waited for at once, on the clock."""
    started = time.perf_counter()
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), output_splits, input_splits, group.group_name)
    out = torch.ops._c10d_functional.wait_tensor(out)
    clock.add(started)
    return out


class _TimedAllToAll(torch.autograd.Function):
    """funcol.all_to_all_single_autograd, synchronous and clocked: backward, the all-to-all with the splits swapped
    (as torch's registered backward)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        clock: A2AClock,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.clock = (output_splits, input_splits), group, clock
        return _waited_all_to_all(x, output_splits, input_splits, group, clock)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        return _waited_all_to_all(grad, input_splits, output_splits, ctx.group, ctx.clock), None, None, None, None


@contextlib.contextmanager
def timed_all_to_all() -> Iterator[A2AClock]:
    """While open, dist.all_to_all_single and funcol.all_to_all_single_autograd (what GroupedExperts._dispatch
    calls) run on the yielded clock: from each call, forward or backward, until its result is there."""
    sync, functional = dist.all_to_all_single, funcol.all_to_all_single_autograd
    clock = A2AClock()

    def timed_sync(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        work = sync(*args, **kwargs)
        clock.add(started)
        return work

    def timed_functional(
        x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        return _TimedAllToAll.apply(x, output_splits, input_splits, group, clock)

    dist.all_to_all_single, funcol.all_to_all_single_autograd = timed_sync, timed_functional
    try:
        yield clock
    finally:
        dist.all_to_all_single, funcol.all_to_all_single_autograd = sync, functional


# ---------------------------------------------------------------- one rank


def _local_numel(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def ep_rank_load(tokens_per_expert: list[list[float]], ep: int) -> float:
    """The tokens routed to the busiest EP rank's experts over the mean per rank, averaged over the layers."""
    loads = []
    for tokens in tokens_per_expert:
        local = len(tokens) // ep
        per_rank = [sum(tokens[r * local : (r + 1) * local]) for r in range(ep)]
        loads.append(max(per_rank) * ep / sum(per_rank))
    return statistics.mean(loads)


def _rank(rank: int, world: int, rounds: int, steps: int, warmup: int, zero: int) -> dict[str, Any]:
    """Builds the three engines, runs the variants interleaved; this rank's step times by variant, round and step,
    its all-to-all seconds and counts in the ep2_a2a steps, and what each variant holds."""
    from hpctrain.parallel.engine import build_engine

    cfgs = {
        "ep2": make_cfg(MOE_MODEL, 2, zero),
        "ep1": make_cfg(MOE_MODEL, 1, zero),
        "dense": make_cfg(DENSE_MODEL, 1, zero),
    }
    engines = {name: build_engine(cfg, resolve_layout(cfg), torch.device("cpu")) for name, cfg in cfgs.items()}
    wall: dict[str, list[list[float]]] = {name: [[] for _ in range(rounds)] for name in VARIANTS}
    a2a: list[list[float]] = [[] for _ in range(rounds)]
    calls: set[int] = set()
    load: list[float] = []

    def run(name: str, step: int) -> A2AClock | None:
        engine = engines[name.removesuffix("_a2a")]
        batch = batch_of(step, engine.dp_rank)
        if name != "ep2_a2a":
            stats = engine.step(batch, LR)
            if name == "ep2":
                load.append(ep_rank_load(stats.moe.tokens_per_expert, engine.dims.ep))
            return None
        with timed_all_to_all() as clock:
            engine.step(batch, LR)
        return clock

    for name in VARIANTS:
        for s in range(warmup):
            run(name, s)
    for r in range(rounds):
        for s in range(steps):
            for name in VARIANTS:
                dist.barrier()
                started = time.perf_counter()
                clock = run(name, warmup + r * steps + s)
                wall[name][r].append(time.perf_counter() - started)
                if clock is not None:
                    a2a[r].append(clock.seconds)
                    calls.add(clock.calls)
    wrapper = "FSDP2 replicate" if zero == 0 else f"FSDP2 ZeRO-{zero}"
    layouts = {
        name: {
            "ep": e.dims.ep,
            "data_parallel": "DDP" if e.ddp else wrapper,
            "params_on_rank": sum(_local_numel(p) for part in e.model_parts for p in part.parameters()),
        }
        for name, e in engines.items()
    }
    return {
        "wall": wall,
        "a2a": a2a,
        "a2a_calls": sorted(calls),
        "layouts": layouts,
        "ep_rank_load": statistics.mean(load[warmup:]),
    }


# ---------------------------------------------------------------- the summary


def step_rounds(results: list[dict[str, Any]], name: str) -> list[float]:
    """Per round, the median over its steps of the slower rank's step time."""
    per_rank = [res["wall"][name] for res in results]
    return [
        statistics.median(max(times) for times in zip(*(ranks[r] for ranks in per_rank)))
        for r in range(len(per_rank[0]))
    ]


def ratio(a: list[float], b: list[float]) -> dict[str, Any]:
    """a's median step time over b's, and round by round."""
    rounds = [x / y for x, y in zip(a, b)]
    return {
        "ratio": statistics.median(a) / statistics.median(b),
        "ratio_rounds": rounds,
        "ratio_min": min(rounds),
        "ratio_max": max(rounds),
    }


def a2a_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The all-to-all's seconds and share of the ep2_a2a step: per step the ranks' mean, the median over each
    round's steps, then over rounds."""
    rounds = len(results[0]["a2a"])
    ms, share, share_by_rank = [], [], []
    for r in range(rounds):
        per_step = list(zip(*(zip(res["a2a"][r], res["wall"]["ep2_a2a"][r]) for res in results)))
        ms.append(statistics.median(statistics.mean(a for a, _ in ranks) * 1e3 for ranks in per_step))
        share.append(statistics.median(statistics.mean(a / w for a, w in ranks) for ranks in per_step))
        share_by_rank.append(
            [statistics.median(ranks[i][0] / ranks[i][1] for ranks in per_step) for i in range(len(results))]
        )
    return {
        "method": "dist.all_to_all_single and funcol.all_to_all_single_autograd replaced during the ep2_a2a "
        "steps by synchronous versions (the same ops, waited at once, forward and backward) that "
        "add up the wall time from each call until its result is there (peer waits included); "
        "share = that sum over the rank's own step time, mean over ranks",
        "calls_per_step": sorted({c for res in results for c in res["a2a_calls"]}),
        "ms_per_step": statistics.median(ms),
        "share": statistics.median(share),
        "share_rounds": share,
        "share_by_rank": [statistics.median(r[i] for r in share_by_rank) for i in range(len(results))],
    }


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--zero", type=int, default=1, choices=range(4), help="zero.stage of every variant")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "moe.json")
    args = parser.parse_args()
    started = time.perf_counter()
    results = run_distributed(_rank, RANKS, args.rounds, args.steps, args.warmup, args.zero, timeout=3600)
    tokens = RANKS * MICRO_BATCH * SEQ
    rounds = {name: step_rounds(results, name) for name in VARIANTS}
    variants = {
        name: {
            **results[0]["layouts"][name.removesuffix("_a2a")],
            "step_ms": statistics.median(rounds[name]) * 1e3,
            "tok_s": tokens / statistics.median(rounds[name]),
            "step_ms_rounds": [t * 1e3 for t in rounds[name]],
        }
        for name in VARIANTS
    }
    ratios = {
        "a/b ep2/ep1": ratio(rounds["ep2"], rounds["ep1"]),
        "a/c ep2/dense": ratio(rounds["ep2"], rounds["dense"]),
        "a'/a clock overhead": ratio(rounds["ep2_a2a"], rounds["ep2"]),
    }
    a2a = a2a_summary(results)

    print(
        f"Qwen3-MoE: {MOE_MODEL['n_layers']} layers, d {MOE_MODEL['d_model']}, {MOE_MODEL['moe']['n_experts']} "
        f"experts of {EXPERT_HIDDEN}, top {TOP_K}; dense: SwiGLU {DENSE_MODEL['ffn_hidden']}; fp32, {RANKS} gloo "
        f"ranks x 1 thread, dp {RANKS}, {MICRO_BATCH} x {SEQ} tokens per rank and step, zero.stage {args.zero}; "
        f"{args.rounds} rounds x {args.steps} steps, interleaved"
    )
    print(f"{'variant':8} {'ep':>3} {'data parallel':>16} {'params/rank':>12} {'step ms':>8} {'tok/s':>7}")
    for name, v in variants.items():
        print(
            f"{name:8} {v['ep']:3d} {v['data_parallel']:>16} {v['params_on_rank']:12,d} {v['step_ms']:8.1f} "
            f"{v['tok_s']:7.0f}"
        )
    print(f"{'ratio (step time)':22} {'median':>7} {'rounds min-max':>15}")
    for label, r in ratios.items():
        print(f"{label:22} {r['ratio']:7.3f} {r['ratio_min']:7.3f}-{r['ratio_max']:.3f}")
    print(
        f"all-to-all in the EP 2 step: {a2a['ms_per_step']:.1f} ms a step, {100 * a2a['share']:.1f}% of it "
        f"(rounds {100 * min(a2a['share_rounds']):.1f}-{100 * max(a2a['share_rounds']):.1f}%; by rank "
        + ", ".join(f"{100 * s:.1f}%" for s in a2a["share_by_rank"])
        + f"), {'/'.join(map(str, a2a['calls_per_step']))} all-to-alls a step"
    )
    print(
        f"EP 2 rank load (busiest rank's tokens / mean, over layers and steps): {results[0]['ep_rank_load']:.3f}; "
        f"the bench took {time.perf_counter() - started:.0f} s"
    )
    args.out.write_text(
        json.dumps(
            {
                "model": MOE_MODEL,
                "dense_model": DENSE_MODEL,
                "ranks": RANKS,
                "threads_per_rank": 1,
                "seq": SEQ,
                "micro_batch": MICRO_BATCH,
                "zero_stage": args.zero,
                "rounds": args.rounds,
                "steps": args.steps,
                "warmup": args.warmup,
                "variants": variants,
                "ratios": ratios,
                "all_to_all": a2a,
                "ep_rank_load": results[0]["ep_rank_load"],
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
