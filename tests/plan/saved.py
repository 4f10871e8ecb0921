"""What autograd saves for one transformer block: the measurement the activation formulas are held to."""

from __future__ import annotations

from typing import Any

import torch


def block_saved_bytes(model_cfg: Any, micro_batch: int, seq_len: int) -> int:
    """Bytes autograd saves for the forward of layer 0 of the config's model in bf16 on CPU (storages counted once,
    parameters left out)."""
    from hpctrain.models import create_model

    block = create_model(model_cfg).to(torch.bfloat16).layers["0"]
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(micro_batch, seq_len, model_cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(saved.values())
