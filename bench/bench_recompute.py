"""parallel.recompute none / selective / full on the CPU: bytes each layer keeps for backward, and step time.

    python bench/bench_recompute.py [--rounds 5] [--steps 2] [--warmup 1] [--quick]

Two block families as hpctrain builds them (hpctrain.models.create_model), each a stack of 4 layers, d 256, 8 heads
(Llama: 2 key/value heads, SwiGLU 704; GPT: GELU 1024), bf16, sequences of 1024 tokens, micro-batch 2 (--quick:
2 layers, 512 tokens): a shape where activations, not weights, dominate. Each mode is applied the engine's way
(hpctrain.parallel.recompute.apply_recompute on the whole model), one process, one thread.

Memory: the bytes layer 0 keeps after its forward (tests/plan/saved.py: what autograd saves, or the checkpoint's
input and the selective policy's cached outputs; storages counted once, parameters left out), in sbh units
(s x b x d elements) and against the planner's formula (hpctrain.plan.activations.activation_bytes_per_layer).
Time: forward and backward through the layers (a random input of the residual width, loss the mean square of the
output), no optimizer. The modes take turns (none selective full none selective full ...), `--rounds` rounds of
`--steps` steps after `--warmup` untimed steps each, so a machine that gets busier slows all alike; a mode's figure
is the median over rounds of its round's median step, its ratio to `none` the median of the per-round ratios (their
spread: how noisy the machine was). Acceptance (issue 33): selective keeps less than none and takes less time than
full. Prints a table and writes bench/recompute.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpctrain.entry import EntryParser  # noqa: E402
from hpctrain.models import create_model  # noqa: E402
from hpctrain.models.params import built_dims  # noqa: E402
from hpctrain.parallel.recompute import apply_recompute  # noqa: E402
from hpctrain.plan.activations import activation_bytes_per_layer  # noqa: E402
from tests.conftest import _compose  # noqa: E402
from tests.plan.saved import saved_bytes  # noqa: E402

MODES = ("none", "selective", "full")
D, HEADS, KV_HEADS, LLAMA_FFN, MICRO_BATCH = 256, 8, 2, 704, 2
BLOCKS = {
    "gpt": ["model=tiny"],
    "llama": ["model=llama_tiny", f"model.n_kv_heads={KV_HEADS}", f"model.ffn_hidden={LLAMA_FFN}"],
}


def model_cfg(family: str, layers: int) -> Any:
    return _compose(
        *BLOCKS[family], f"model.d_model={D}", f"model.n_heads={HEADS}", f"model.n_layers={layers}", "model.dropout=0.0"
    ).model


def build(cfg: Any, mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(cfg).to(torch.bfloat16)
    apply_recompute(model, mode)
    return model


def layer_bytes(cfg: Any, seq: int) -> dict[str, dict[str, float]]:
    """Per mode: layer 0's kept bytes, measured and by the planner's formula."""
    out = {}
    for mode in MODES:
        x = torch.randn(MICRO_BATCH, seq, D, dtype=torch.bfloat16, requires_grad=True)
        block = create_model(cfg).to(torch.bfloat16).layers["0"]
        measured = saved_bytes(block, x, mode)
        out[mode] = {
            "bytes": measured,
            "sbh": measured / (seq * MICRO_BATCH * D),
            "formula_bytes": activation_bytes_per_layer(*built_dims(cfg), seq, MICRO_BATCH, recompute=mode),
        }
    return out


def step(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Seconds of one forward and backward through the layers."""
    started = time.perf_counter()
    h = x
    for layer in model.layers.values():
        h = layer(h)
    h.float().pow(2).mean().backward()
    return time.perf_counter() - started


def time_modes(cfg: Any, seq: int, rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per mode, each round's median step seconds, the modes taking turns."""
    models = {mode: build(cfg, mode) for mode in MODES}
    x = torch.randn(MICRO_BATCH, seq, D, dtype=torch.bfloat16, requires_grad=True)
    for mode in MODES:
        for _ in range(warmup):
            step(models[mode], x)
    per_round: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            per_round[mode].append(statistics.median(step(models[mode], x) for _ in range(steps)))
    return per_round


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 layers, 512 tokens, 3 rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "recompute.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers, seq = (2, 512) if args.quick else (4, 1024)
    rounds = 3 if args.quick else args.rounds
    started = time.perf_counter()
    results: dict[str, Any] = {}
    print(
        f"{layers} layers, d {D}, {HEADS} heads, bf16, {MICRO_BATCH} x {seq} tokens, 1 thread; "
        f"{rounds} rounds x {args.steps} steps, interleaved"
    )
    print(
        f"{'block':6} {'mode':10} {'sbh/layer':>9} {'formula':>8} {'vs none':>8} {'step ms':>8} {'vs none':>8} "
        f"{'rounds min-max':>14}"
    )
    for family in BLOCKS:
        cfg = model_cfg(family, layers)
        kept = layer_bytes(cfg, seq)
        times = time_modes(cfg, seq, rounds, args.steps, args.warmup)
        family_result = {}
        for mode in MODES:
            ratios = [t / n for t, n in zip(times[mode], times["none"])]
            family_result[mode] = {
                **kept[mode],
                "bytes_vs_none": kept[mode]["bytes"] / kept["none"]["bytes"],
                "step_ms": statistics.median(times[mode]) * 1e3,
                "step_ms_rounds": [t * 1e3 for t in times[mode]],
                "time_vs_none": statistics.median(ratios),
                "time_vs_none_rounds": ratios,
            }
            r = family_result[mode]
            print(
                f"{family:6} {mode:10} {r['sbh']:9.3f} {r['formula_bytes'] / kept[mode]['bytes']:8.3f} "
                f"{r['bytes_vs_none']:8.3f} {r['step_ms']:8.1f} {r['time_vs_none']:8.3f} "
                f"{min(ratios):6.3f}-{max(ratios):.3f}"
            )
        sel, full = family_result["selective"], family_result["full"]
        family_result["accepted"] = sel["bytes_vs_none"] < 1 and sel["time_vs_none"] < full["time_vs_none"]
        results[family] = family_result
    print(
        "formula: the planner's bytes over the measured; accepted (selective keeps less than none, is faster "
        "than full): "
        + ", ".join(f"{f} {r['accepted']}" for f, r in results.items())
        + f"; the bench took {time.perf_counter() - started:.0f} s"
    )
    args.out.write_text(
        json.dumps(
            {
                "layers": layers,
                "d_model": D,
                "heads": HEADS,
                "kv_heads_llama": KV_HEADS,
                "seq": seq,
                "micro_batch": MICRO_BATCH,
                "dtype": "bf16",
                "threads": 1,
                "rounds": rounds,
                "steps": args.steps,
                "warmup": args.warmup,
                "blocks": results,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
