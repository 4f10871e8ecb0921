"""Throughput of hpctrain's engine against a plain PyTorch loop, same model and global batch.

    python bench/bench_engine.py [--steps 20] [--warmup 3]

(a) a plain single-process loop written here (GPT, AdamW, clip_grad_norm_), (b) hpctrain's engine in one
process, (c) hpctrain DDP on 2 forked gloo processes (tests/distributed_harness.py). Prints tokens/s and the
ratios; the target is (b) >= 0.95 x (a). On a 2-core machine (c) gives each rank one core, so it measures the
engine's DP overhead rather than a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.config.layout import resolve_layout  # noqa: E402
from hpctrain.config.schema import Config  # noqa: E402

SEQ = 128


def make_cfg(world: int) -> Any:
    return OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "bench", "n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 256, "context": 256},
        "cluster": {"name": "bench", "nodes": 1, "gpus_per_node": world},
        "train": {"global_batch": 16, "micro_batch": 16 // world, "seq_len": SEQ, "seed": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
    })


def batch(step: int, rows: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    data = torch.randint(0, 256, (16, SEQ + 1), generator=gen)[offset:offset + rows]
    return data[:, :-1], data[:, 1:]


def timed(step_fn: Any, steps: int, warmup: int) -> float:
    """Median seconds per step after warm-up."""
    times = []
    for s in range(warmup + steps):
        started = time.perf_counter()
        step_fn(s)
        if s >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def plain_loop(steps: int, warmup: int) -> float:
    """The baseline: what a user would write by hand, no hpctrain code in the step."""
    from hpctrain.models.gpt import GPT, gpt_args

    cfg = make_cfg(1)
    model = GPT(gpt_args(cfg.model, cfg.parallel.tp))
    model.init_weights(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(s: int) -> None:
        x, y = batch(s, 16)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return timed(step, steps, warmup)


def engine_loop(rank: int, world: int, steps: int, warmup: int) -> float:
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    per = 16 // world
    return timed(lambda s: engine.step(torch.stack(batch(s, per, engine.dp_rank * per))[:, None], 1e-3), steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from tests.distributed_harness import run_distributed

    tokens = 16 * SEQ
    plain = plain_loop(args.steps, args.warmup)
    single = engine_loop(0, 1, args.steps, args.warmup)
    ddp = max(run_distributed(engine_loop, 2, args.steps, args.warmup, timeout=600))
    print(f"model: 4 layers, d 128, seq {SEQ}, global batch 16 ({tokens} tokens/step), fp32, "
          f"{torch.get_num_threads()} threads single-process, 1 per rank with 2 ranks")
    print(f"(a) plain PyTorch loop      {tokens / plain:10,.0f} tok/s  ({plain * 1e3:.1f} ms/step)")
    print(f"(b) hpctrain, 1 process     {tokens / single:10,.0f} tok/s  ({single * 1e3:.1f} ms/step)  "
          f"{plain / single:.3f} x plain")
    print(f"(c) hpctrain DDP, 2 ranks   {tokens / ddp:10,.0f} tok/s  ({ddp * 1e3:.1f} ms/step)  "
          f"{plain / ddp:.3f} x plain, {single / ddp:.3f} x 1-process engine")


if __name__ == "__main__":
    main()
