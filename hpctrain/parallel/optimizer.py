"""The optimizer: AdamW (GPT-3's) with weight decay on matrices only, fused where the device has the kernel."""

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


FUSED_DEVICES = ("cuda", "cpu")  # device types with torch's fused AdamW kernel (CPU's since torch 2.4)


def optimizer_defaults(o: OptimConfig, device_type: str = "cpu") -> dict[str, Any]:
    """AdamW's settings: the fused kernel where the device has one (one pass over every parameter instead of a
    foreach chain of about a dozen, and it skips a non-finite step on the device: `skip_if_found_inf`), foreach
    elsewhere. Without either flag torch picks its for-loop implementation on the CPU (811 against 554 tok/s
    for a plain loop there, issue 31)."""
    kernel = {"fused": True} if device_type in FUSED_DEVICES else {"foreach": True}
    return dict(lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, **kernel)


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt.step()` can be queued before the host knows the step is finite: torch's fused Adam/AdamW
    take GradScaler's `found_inf` tensor and leave parameters, moments and step counts untouched where it is
    1 (`_step_supports_amp_scaling`)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def skip_if_found_inf(opt: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """Hand the step's device-side verdict (a 0-d float32 tensor, 1.0: do not apply) to a fused optimizer,
    the way GradScaler does (`found_inf` attribute read by its step); None removes it."""
    if found_inf is None:
        opt.__dict__.pop("found_inf", None)
    else:
        opt.found_inf = found_inf  # type: ignore[attr-defined]


def build_optimizer(
    params: Any, optim: OptimConfig, zero: ZeroConfig | None = None, rank: int = 0
) -> torch.optim.Optimizer:
    """AdamW (GPT-3's optimizer), fused where every parameter's device has the kernel (FSDP2's offload keeps
    them on the CPU); with zero.offload_optimizer_device=nvme, AdamW with its moments in a file under
    zero.nvme_path (torch's fused CPU kernel on each chunk, but no `found_inf`: it cannot skip on the device)."""
    params = list(params)
    types = {p.device.type for p in params}
    device_type = types.pop() if len(types) == 1 else "mixed"  # foreach: the fused kernel wants one device
    if zero is not None and zero.offload_optimizer and zero.offload_optimizer_device == "nvme":
        from hpctrain.parallel.nvme import NvmeAdamW, chunk_elements

        hyper = {k: v for k, v in optimizer_defaults(optim, "cpu").items() if k not in ("fused", "foreach")}
        return NvmeAdamW(param_groups(params, optim), zero.nvme_path, chunk_elements(zero.nvme_chunk_mb), rank, **hyper)
    return torch.optim.AdamW(param_groups(params, optim), **optimizer_defaults(optim, device_type))
