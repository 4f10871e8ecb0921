"""The process a simulation on fake CUDA runs in: started by `fake_cuda.run_module` with the library loaded before
torch. argv: MODE REQUEST ANSWER, each a pickle file.

- simulate: REQUEST (config dict, layout, rank, micro-batches) -> ANSWER a Simulation (`dry_run=simulate`).
- check: the same request -> ANSWER a `Checked`: the step run under the GPU's rules (fake_cuda.rules), what it
  synchronised, which torch.cuda calls it made, which threads issued its collectives, the attention kernels.
A failure is answered as its message and traceback (a str): torch's exceptions do not always pickle.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("simulate", "check")


@dataclass(frozen=True)
class Checked:
    """One engine step on fake CUDA under the GPU's rules, passed."""

    host_syncs: tuple[str, ...]  # each host synchronisation of the step, with the code that made it
    cuda_calls: dict[str, int]  # torch.cuda calls in the step, by name
    collectives: dict[tuple[str, str], int]  # (op, thread: main / autograd) -> count
    attention: dict[str, int]  # SDPA kernel -> calls (flash / efficient / math)


def main() -> None:
    mode, request, answer = sys.argv[1:4]
    if mode not in MODES:
        raise SystemExit(f"usage: MODE REQUEST ANSWER, MODE one of {MODES}")
    try:
        outcome: Any = run(mode, *pickle.loads(Path(request).read_bytes()))
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    Path(answer).write_bytes(pickle.dumps(outcome))


def run(mode: str, config: dict[str, Any], layout: Any, rank: int, microbatches: int | None) -> Any:
    import torch

    from hpctrain.simulate.fake_cuda import runtime
    from hpctrain.simulate.rank import simulate_here
    from hpctrain.train.loop import load_config

    torch.set_num_threads(1)
    runtime.install()
    cfg = load_config(config)
    if mode == "simulate":
        return simulate_here(cfg, layout, rank, microbatches, device="cuda")
    from hpctrain.simulate.fake_cuda.rules import GpuRules, gloo_group_names

    modes: list[GpuRules] = []

    def step_modes() -> list[GpuRules]:
        runtime.CALLS.clear()
        modes[:] = [GpuRules(gloo_group_names())]
        return modes

    sim = simulate_here(cfg, layout, rank, microbatches, device="cuda", step_modes=step_modes)
    (rules,) = modes
    return Checked(
        host_syncs=tuple(rules.syncs),
        cuda_calls=dict(Counter(runtime.CALLS)),
        collectives=dict(rules.collectives),
        attention=sim.attention,
    )
