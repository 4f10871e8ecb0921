"""The weights' initialisation every family shares: GPT-2's, by parameter name, the same in every layout.

Each parameter draws from a generator seeded by (seed, its name), so a pipeline stage or a TP shard materialised
from the meta device gets exactly the single-process model's weights (`assign_param` copies a DTensor's piece).
"""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_by_name(model: nn.Module, seed: int | None, std: float, n_layers: int, vocab_size: int) -> None:
    """GPT-2 initialisation: N(0, std), residual projections (`*proj.weight`, the experts' `w_down`) scaled by
    1/sqrt(2 n_layers), biases 0, norms 1, and the rows of the embedding and head past the vocabulary 0 (never
    looked up: zero logits, zero gradient).

    Each parameter draws from a generator seeded by (seed, name), so every layout (a pipeline stage, a TP
    shard materialised from meta) gets exactly the weights of the single-process model.
    """
    resid_std = std / math.sqrt(2 * n_layers)
    base = 0 if seed is None else seed
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(stable_hash(f"{base}:{name}"))
        if name.endswith("bias"):
            value = torch.zeros(p.shape)
        elif ".norm" in name or name.startswith("norm"):
            value = torch.ones(p.shape)
        else:
            scale = resid_std if name.endswith(("proj.weight", "experts.w_down")) else std
            value = torch.randn(p.shape, generator=gen) * scale
            if name in ("tok_emb.weight", "output.weight"):
                value[vocab_size:] = 0.0
        assign_param(p, value)


def stable_hash(text: str) -> int:
    """Deterministic across processes (Python's hash() is salted per process)."""
    h = 1469598103934665603
    for byte in text.encode():
        h = ((h ^ byte) * 1099511628211) % (1 << 63)
    return h


def assign_param(p: torch.Tensor, full_value: torch.Tensor) -> None:
    """Copy a full-size value into a parameter that may be a DTensor shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        # Every rank computed the same full value: take the local piece without communication.
        shard = distribute_tensor(
            full_value.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements, src_data_rank=None
        )
        p.copy_(shard)
    else:
        p.copy_(full_value.to(device=p.device, dtype=p.dtype))
