"""Mixed precision: compute dtype, gradient-reduction dtype and fp16 dynamic loss scaling.

Master weights and optimizer states stay fp32 in every layout. FSDP2 layouts cast through its
MixedPrecisionPolicy (parameters gathered in the compute dtype, gradients reduced in reduce_dtype); the
others (single process, DDP, TP alone) run forward under autocast, and DDP reduces in reduce_dtype with a
compression hook. fp16 adds a dynamic loss scale: an overflow anywhere skips the step on every rank and
halves the scale (never below min_scale); loss_scale_window clean steps double it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _name(value: Any) -> str:
    return value.value if hasattr(value, "value") else str(value)


def compute_dtype(cfg: Any) -> torch.dtype:
    return DTYPES[_name(cfg.precision.dtype)]


def reduce_dtype(cfg: Any) -> torch.dtype:
    return DTYPES[_name(cfg.precision.reduce_dtype)]


def fsdp_mp_policy(cfg: Any) -> MixedPrecisionPolicy:
    if compute_dtype(cfg) == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(cfg), reduce_dtype=reduce_dtype(cfg))


@contextlib.contextmanager
def autocast(cfg: Any, device: torch.device, enabled: bool) -> Iterator[None]:
    """Autocast to the compute dtype, for layouts without an FSDP2 mixed-precision policy."""
    dtype = compute_dtype(cfg)
    if not enabled or dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def ddp_comm_hook(cfg: Any) -> Any | None:
    """DDP gradient compression to reduce_dtype (None: reduce in fp32, DDP's default)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {torch.bfloat16: default_hooks.bf16_compress_hook,
            torch.float16: default_hooks.fp16_compress_hook}.get(reduce_dtype(cfg))


class LossScaler:
    """Dynamic loss scaling over torch's GradScaler (ShardedGradScaler when distributed: it all-reduces the
    overflow flag over the world, so TP/PP/FSDP ranks holding different gradients skip together)."""

    def __init__(self, cfg: Any, device: torch.device) -> None:
        p = cfg.precision
        self.enabled = bool(p.loss_scaling)
        self.min_scale = float(p.min_scale)
        kwargs = dict(init_scale=float(p.initial_scale), growth_interval=int(p.loss_scale_window),
                      enabled=self.enabled)
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.scaler: torch.amp.GradScaler = ShardedGradScaler(device=device.type, **kwargs)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.enabled else 1.0

    def unscale_(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.enabled:
            for opt in optimizers:
                self.scaler.unscale_(opt)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Step every optimizer unless a gradient overflowed, then update the scale."""
        if not self.enabled:
            for opt in optimizers:
                opt.step()
            return
        for opt in optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        if self.scaler.get_scale() < self.min_scale:
            self.scaler.update(new_scale=self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)
