"""Throughput of hpctrain's engine and Llama block against plain PyTorch, and parallel.compile on against off.

    python bench/bench_engine.py [--rounds 5] [--steps 5] [--warmup 3] [--threads 1] [--no-compile]

The model is a Llama at torchtitan's debug-model shapes (6 layers, d 256, 16 heads, SwiGLU 768, vocabulary 2000
padded to 2048: 6,163,712 parameters), fp32, on sequences of --seq tokens, --batch of them per step.
Each part runs its variants interleaved step by step, A B A B ..., `--rounds` rounds of `--steps` timed steps
(after `--warmup` untimed ones per variant), so that a machine that gets busier slows both alike. A variant's
figure is the median over rounds of its round's median step, by the wall clock and by the process's CPU time
(with one thread, what the step itself computed: steadier on a shared machine); the ratio's spread over the
rounds says how noisy the machine was.
  (a) engine   hpctrain's engine in one process / a plain loop written here on the same module (build_model:
               the same Llama and weights; fused AdamW, clip_grad_norm_, loss.item() per step). Goal >= 0.97.
  (b) block    hpctrain's Llama blocks / a straightforward Llama block written here of the same shapes and
               weights (separate q, k, v, gate and up Linears, F.rms_norm with its weight, RoPE tables built
               once), forward and backward of the stack of blocks. Goal >= 0.97.
  (c) compile  the engine with parallel.compile=true / without (the compile happens in the warm-up).
Prints a table (throughput ratio = baseline time / variant time: > 1 is faster) and writes bench/engine.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.config.layout import resolve_layout  # noqa: E402
from hpctrain.config.schema import Config  # noqa: E402
from hpctrain.entry import EntryParser

VOCAB = 2000  # torchtitan's debug tokenizer; the embedding and head are padded to 2048 rows
MODEL = {
    "name": "bench",
    "arch": "llama",
    "n_layers": 6,
    "d_model": 256,
    "n_heads": 16,
    "n_kv_heads": 16,
    "ffn_hidden": 768,
    "vocab_size": VOCAB,
    "context": 2048,
    "rope": {"theta": 500000.0},
}


def make_cfg(seq: int, batch: int, **parallel: Any) -> Any:
    return OmegaConf.merge(
        OmegaConf.structured(Config),
        {
            "model": MODEL,
            "cluster": {"name": "bench", "nodes": 1, "gpus_per_node": 1},
            "train": {"global_batch": batch, "micro_batch": batch, "seq_len": seq, "seed": 1},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "grad_clip": 1.0},
            "parallel": parallel,
        },
    )


def batch_of(step: int, seq: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


# ---------------------------------------------------------------- the variants: each a step function


def plain_loop(cfg: Any) -> Callable[[int], None]:
    """What a user writes by hand around the same module: no hpctrain code in the step."""
    from hpctrain.parallel.engine import build_model

    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    seq, batch = cfg.train.seq_len, cfg.train.global_batch

    def step(s: int) -> None:
        x, y = batch_of(s, seq, batch)
        logits = model(x)[..., :VOCAB]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def engine_loop(cfg: Any) -> Callable[[int], None]:
    from hpctrain.parallel.engine import build_engine

    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    seq, batch = cfg.train.seq_len, cfg.train.global_batch
    return lambda s: engine.step(torch.stack(batch_of(s, seq, batch))[:, None], 1e-3)


class PlainBlock(nn.Module):
    """A straightforward Llama block (Hugging Face's and torchtitan's way): separate projections, torch's
    RMSNorm with its weight, rotate_half RoPE on tables handed in."""

    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, d // heads, eps
        self.attn_norm, self.ffn_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = F.rms_norm(x, (d,), self.attn_norm, self.eps)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            self.rope(q, cos, sin), self.rope(k, cos, sin), v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        h = F.rms_norm(x, (d,), self.ffn_norm, self.eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    @torch.no_grad()
    def copy_from(self, block: nn.Module) -> PlainBlock:
        """hpctrain's block's weights: its QKV rows are grouped by key/value head (the group's queries, k, v)."""
        r = self.heads // self.kv_heads
        qkv = block.attn.qkv.weight.view(self.kv_heads, r + 2, self.head_dim, -1)
        self.wq.weight.copy_(qkv[:, :r].reshape(self.wq.weight.shape))
        self.wk.weight.copy_(qkv[:, r].reshape(self.wk.weight.shape))
        self.wv.weight.copy_(qkv[:, r + 1].reshape(self.wv.weight.shape))
        for ours, theirs in (
            (self.wo, block.attn.proj),
            (self.gate, block.mlp.gate),
            (self.up, block.mlp.up),
            (self.down, block.mlp.proj),
        ):
            ours.weight.copy_(theirs.weight)
        self.attn_norm.copy_(block.norm1.weight)
        self.ffn_norm.copy_(block.norm2.weight)
        return self


def block_loops(cfg: Any) -> tuple[Callable[[int], None], Callable[[int], None], float]:
    """Forward and backward through the model's blocks, hpctrain's and the plain ones with the same weights;
    and the two outputs' largest relative difference (they compute the same function)."""
    from hpctrain.models.llama.model import rope_cos_sin
    from hpctrain.parallel.engine import build_model

    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    m = cfg.model
    ours = list(model.layers.values())
    plain = [PlainBlock(m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.norm_eps).copy_from(b) for b in ours]
    seq, batch = cfg.train.seq_len, cfg.train.global_batch
    cos, sin = rope_cos_sin(model.args, seq, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, m.d_model, generator=gen)
    grad = torch.randn(batch, seq, m.d_model, generator=gen)

    def run(blocks: list[nn.Module], call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = x.clone().requires_grad_()
        out = h
        for block in blocks:
            out = call(block, out)
        out.backward(grad)
        for block in blocks:
            block.zero_grad(set_to_none=True)
        return out.detach()

    def hpctrain_blocks(_: int) -> torch.Tensor:
        return run(ours, lambda block, h: block(h))

    def plain_blocks(_: int) -> torch.Tensor:
        return run(plain, lambda block, h: block(h, cos, sin))

    a, b = hpctrain_blocks(0), plain_blocks(0)
    return hpctrain_blocks, plain_blocks, float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------- interleaved timing


def interleaved(
    variants: dict[str, Callable[[int], Any]], rounds: int, steps: int, warmup: int
) -> dict[str, dict[str, list[float]]]:
    """Per variant, the median seconds per step of each round, wall-clock ("wall") and this process's CPU time
    ("cpu": with one thread, the time the step computed, whatever else the machine ran meanwhile). The variants
    take turns step by step (A B A B ...), round after round."""
    for fn in variants.values():
        for s in range(warmup):
            fn(s)
    medians: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in variants}
    for r in range(rounds):
        times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in variants}
        for s in range(steps):
            for name, fn in variants.items():
                wall, cpu = time.perf_counter(), time.process_time()
                fn(warmup + r * steps + s)
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
        for name in variants:
            for clock in ("wall", "cpu"):
                medians[name][clock].append(statistics.median(times[name][clock]))
    return medians


def compare(
    label: str, base: str, variant: str, medians: dict[str, dict[str, list[float]]], goal: float | None, tokens: int
) -> dict[str, Any]:
    """The variant's throughput over the baseline's, from the medians and round by round (the noise), by the
    wall clock and by CPU time."""
    row: dict[str, Any] = {"part": label, "baseline": base, "variant": variant, "goal": goal}
    for clock in ("wall", "cpu"):
        b, v = medians[base][clock], medians[variant][clock]
        per_round = [x / y for x, y in zip(b, v)]
        base_s, var_s = statistics.median(b), statistics.median(v)
        row[clock] = {
            "baseline_ms": base_s * 1e3,
            "variant_ms": var_s * 1e3,
            "baseline_tok_s": tokens / base_s,
            "variant_tok_s": tokens / var_s,
            "ratio": base_s / var_s,
            "ratio_rounds": per_round,
            "ratio_min": min(per_round),
            "ratio_max": max(per_round),
            "step_spread_pct": 100 * (max(b + v) / min(b + v) - 1),
        }
    return row


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="skip (c)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "engine.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.seq * args.batch
    cfg = make_cfg(args.seq, args.batch)
    timing = (args.rounds, args.steps, args.warmup)
    rows = [
        compare(
            "(a) engine",
            "plain loop",
            "hpctrain engine",
            interleaved({"plain loop": plain_loop(cfg), "hpctrain engine": engine_loop(cfg)}, *timing),
            0.97,
            tokens,
        )
    ]
    ours, plain, difference = block_loops(cfg)
    rows.append(
        compare(
            "(b) block",
            "plain block",
            "hpctrain block",
            interleaved({"plain block": plain, "hpctrain block": ours}, *timing),
            0.97,
            tokens,
        )
    )
    rows[-1]["max_relative_difference"] = difference
    if not args.no_compile:
        started = time.perf_counter()
        compiled = engine_loop(make_cfg(args.seq, args.batch, compile=True))
        compiled(0)
        compile_s = time.perf_counter() - started
        rows.append(
            compare(
                "(c) compile",
                "compile off",
                "compile on",
                interleaved({"compile off": engine_loop(cfg), "compile on": compiled}, *timing),
                None,
                tokens,
            )
        )
        rows[-1]["first_step_with_compile_s"] = compile_s

    print(
        f"Llama: {MODEL['n_layers']} layers, d {MODEL['d_model']}, "
        f"{MODEL['n_heads']} heads, SwiGLU {MODEL['ffn_hidden']}, fp32; {args.batch} x {args.seq} tokens a step, "
        f"{args.threads} thread(s); {args.rounds} rounds x {args.steps} steps, interleaved"
    )
    print(
        f"{'part':12} {'baseline':>12} {'variant':>16} {'clock':>5} {'base ms':>9} {'var ms':>9} {'ratio':>7} "
        f"{'rounds min-max':>15} {'goal':>6}"
    )
    for row in rows:
        goal = f"{row['goal']:.2f}" if row["goal"] else "-"
        for clock in ("wall", "cpu"):
            r = row[clock]
            print(
                f"{row['part']:12} {row['baseline']:>12} {row['variant']:>16} {clock:>5} {r['baseline_ms']:9.1f} "
                f"{r['variant_ms']:9.1f} {r['ratio']:7.3f} {r['ratio_min']:7.3f}-{r['ratio_max']:.3f} {goal:>6}"
            )
    print(f"(b) the two blocks' outputs differ by {difference:.1e} (relative)")
    if not args.no_compile:
        print(f"(c) first step with compile: {rows[-1]['first_step_with_compile_s']:.1f} s")
    args.out.write_text(
        json.dumps(
            {
                "model": MODEL,
                "seq": args.seq,
                "batch": args.batch,
                "threads": args.threads,
                "rounds": args.rounds,
                "steps": args.steps,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
