"""What autograd saves for one transformer block: the measurement the activation formulas are held to."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from hpctrain.parallel.recompute import save_for_flash_attention


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_bytes(
    block: nn.Module,
    x: torch.Tensor,
    recompute: str = "none",
    parallelize: Callable[[nn.Module], None] | None = None,
    backward_mode: TorchDispatchMode | None = None,
) -> int:
    """Bytes `block` keeps for backward after its forward on `x` (on this rank: DTensors count their local shard;
    storages counted once, parameters left out): what autograd saves ("none"), or under the composable checkpoint
    its input and, for "selective", the op outputs hpctrain.parallel.recompute's policy caches. `parallelize`
    (TP) runs after the checkpoint is applied, in the engine's order; `backward_mode` is active during backward
    (recomputation included)."""
    saved: dict[int, int] = {}

    def count(t: Any) -> None:
        if isinstance(t, torch.Tensor) and _storage(t).data_ptr() not in weights:
            saved[_storage(t).data_ptr()] = _storage(t).nbytes()

    caches: list[Any] = []

    def contexts() -> Any:
        forward, recompute_ctx = create_selective_checkpoint_contexts(save_for_flash_attention)
        caches.append(forward.storage)
        return forward, recompute_ctx

    if recompute == "full":
        checkpoint(block)
    elif recompute == "selective":
        checkpoint(block, context_fn=contexts)
    if parallelize is not None:
        parallelize(block)
    weights = {_storage(p).data_ptr() for p in block.parameters()}
    if recompute != "none":
        count(x)  # the checkpoint keeps the block's input for its recomputation
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (count(t), t)[1], lambda t: t):
        y = block(x)
    for per_op in caches[0].values() if caches else []:
        for out in per_op.values():
            for wrapped in torch.utils._pytree.tree_leaves(out):
                count(getattr(wrapped, "val", None))
    with backward_mode or contextlib.nullcontext():
        y.sum().backward()  # recomputation runs and matches (SAC raises on a mismatch)
    return sum(saved.values())


def block_saved_bytes(model_cfg: Any, micro_batch: int, seq_len: int, recompute: str = "none") -> int:
    """Bytes layer 0 of the config's model keeps for backward in bf16 on CPU (`saved_bytes`)."""
    from hpctrain.models import create_model

    block = create_model(model_cfg).to(torch.bfloat16).layers["0"]
    x = torch.randn(micro_batch, seq_len, model_cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    return saved_bytes(block, x, recompute)
