"""What parallel.compile compiles, and how: each transformer block on its own (regional compilation).

torchtitan's recipe (`apply_compile` in its llama3 parallelize.py): every block is compiled with
`fullgraph=True` after TP and activation checkpointing (torchtitan: before FSDP2, which then wraps the
compiled module; here after it, which leaves the same hooks outside the graph, see below). The blocks run the
same code on the same shapes and dynamo passes their parameters in as graph inputs, so one compiled graph
serves every layer (compile time does not grow with depth); a graph break is an error here, not a silent
fall back to eager.

What hpctrain compiles is the block's `forward` (norms, attention, MLP, residuals, and TP's redistributions
of the submodules inside it), in place, so parameter names stay those of the single-process model (no
`_orig_mod.` prefix: weights drawn by name, checkpoints and HF export see the same names). The hooks on the
block itself stay eager, outside the graph:
- FSDP2's all-gather/reshard hooks, as in torchtitan;
- the composable activation checkpoint (hpctrain.parallel.recompute): its hooks enter a Python context
  manager that dynamo cannot trace (`fullgraph=True` fails on them, see docs/compile.md). Around a compiled
  forward, full recomputation replays the compiled block, and selective recomputation still sees the
  matmuls and collectives it saves (Inductor calls them as external kernels, through the dispatcher);
- with sequence parallelism, the first block's hook that takes this rank's sequence slice.

The compile caches are on node-local disk (hpctrain.distributed.task_env.compile_cache_environment); the
time spent compiling goes to the goodput ledger as its own part (`CompileClock`, the metrics' compile_s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._dynamo.utils import calculate_time_spent
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


def compiled_units(block: nn.Module, recompute: str, tp: int) -> list[nn.Module]:
    """The modules of one block whose forward is compiled: the whole block, or its attention and MLP each
    - where FSDP2 shards them as units of their own: their all-gather hooks would sit inside the block's
      graph, and dynamo refuses FSDP2's hooks (`torch._dynamo.disable`: fullgraph fails);
    - under selective recomputation with TP, where torch 2.13 gets a compiled block's gradients wrong
      (silently: the gradient norm is off by 0.2-20%, docs/compile.md), and attention and MLP are exact."""
    attn, mlp = block.get_submodule("attn"), block.get_submodule("mlp")
    inner_fsdp = any(isinstance(m, FSDPModule) for m in (attn, mlp))
    if inner_fsdp or (recompute == "selective" and tp > 1):
        return [attn, mlp]
    return [block]


def apply_compile(model: FamilyModule, recompute: str = "none", tp: int = 1, backend: Any = "inductor") -> None:
    """Compile every block of `model` (a whole model or a pipeline stage) in place, after its activation
    checkpointing (`recompute`, parallel.recompute), TP (`tp` ranks) and FSDP2: only forwards are compiled,
    so the order leaves every hook outside the graphs; FSDP2 first shows which modules it made units.

    `backend`: Inductor for training; tests pass a counting backend over "aot_eager" (the same graphs)."""
    # DDP: no splitting of the graphs at its bucket boundaries (dynamo's DDPOptimizer, meant for one graph of
    # the whole model): a block is one region, and DDP's hooks reduce its gradients after its backward.
    torch._dynamo.config.optimize_ddp = False
    for block in model.layers.values():
        for unit in compiled_units(block, recompute, tp):
            unit.forward = torch.compile(unit.forward, backend=backend, fullgraph=True)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far: dynamo's frame compiles (tracing, AOTAutograd,
    Inductor's forward) and the backward graphs compiled lazily in the first backward."""
    return calculate_time_spent().get("total_wall_time", 0.0)


class CompileClock:
    """The compilation inside each training step, for its metrics row (`compile_s`).

    `with clock:` around the step; `clock.report()` then gives {"compile_s": seconds} for a step that compiled
    (the first, or a recompilation) and {} for the others, so rows of runs without compilation do not change.
    Host-side bookkeeping only: no device work, no synchronisation."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._started = 0.0

    def __enter__(self) -> CompileClock:
        self._started = compile_seconds()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._seconds = compile_seconds() - self._started

    def report(self) -> dict[str, float]:
        return {"compile_s": self._seconds} if self._seconds > 0 else {}
