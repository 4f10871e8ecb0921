"""The optimizer: AdamW (GPT-3's) with weight decay on matrices only, fused on GPUs."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hpctrain.config.schema import OptimConfig, ZeroConfig


def param_groups(params: Any, optim: OptimConfig) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not biases, LayerNorm gains). DTensor and plain parameters go to
    separate groups: the foreach/fused optimizer kernels cannot mix them (TP without FSDP has both)."""
    params = [p for p in params if p.requires_grad]
    groups = []
    for decay in (True, False):
        for is_dtensor in (True, False):
            members = [p for p in params if (p.ndim >= 2) == decay and isinstance(p, DTensor) == is_dtensor]
            if members:
                groups.append({"params": members, "weight_decay": optim.weight_decay if decay else 0.0})
    return groups


def optimizer_defaults(o: OptimConfig, device_type: str = "cpu") -> dict[str, Any]:
    """AdamW's settings; on GPUs the fused kernel (one launch for all parameters instead of a foreach
    chain of about a dozen), on the CPU torch's default (foreach), whose results the CPU tests pin."""
    fused = {"fused": True} if device_type == "cuda" else {}
    return dict(lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, **fused)


def build_optimizer(params: Any, optim: OptimConfig, zero: ZeroConfig | None = None, rank: int = 0
                    ) -> torch.optim.Optimizer:
    """AdamW (GPT-3's optimizer), fused when every parameter is on a GPU (FSDP2 offload keeps them on the CPU);
    with zero.offload_optimizer_device=nvme, AdamW with its moments in a file under zero.nvme_path."""
    params = list(params)
    device_type = "cuda" if params and all(p.device.type == "cuda" for p in params) else "cpu"
    if zero is not None and zero.offload_optimizer and zero.offload_optimizer_device == "nvme":
        from hpctrain.parallel.nvme import NvmeAdamW, chunk_elements

        return NvmeAdamW(param_groups(params, optim), zero.nvme_path, chunk_elements(zero.nvme_chunk_mb), rank,
                         **optimizer_defaults(optim, "cpu"))
    return torch.optim.AdamW(param_groups(params, optim), **optimizer_defaults(optim, device_type))
