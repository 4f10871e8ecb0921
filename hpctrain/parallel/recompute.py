"""Activation checkpointing (parallel.recompute), applied per transformer block.

- full: each block keeps only its input; the whole block is recomputed in backward (Chen et al. 2016;
  Narayanan 2021 eq. 3 counts this as a fourth forward pass).
- selective: each block saves the outputs of its matmuls (and of TP collectives, so recomputation never
  communicates) and recomputes everything else: the attention core (softmax(QK^T)V, whose s x s
  intermediates dominate activation memory), GELU/SwiGLU, the norms, RoPE and dropout. This is Korthikanti et al.
  2022's selective recomputation, the cost hpctrain.plan.flops counts as "selective".

The composable `checkpoint` keeps parameter names unchanged (no `_checkpoint_wrapped_module` prefix), so
weight initialisation and checkpoints see the same names in every layout.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

if TYPE_CHECKING:
    from hpctrain.models import Transformer

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.wait_tensor.default,
}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: Transformer, mode: str) -> None:
    """Checkpoint every block of `model` ("none" | "selective" | "full"), in place."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"parallel.recompute must be none, selective or full, got {mode!r}")
    for block in model.layers.values():
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))
