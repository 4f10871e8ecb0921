"""Mixed precision: compute dtype, gradient-reduction dtype and fp16 dynamic loss scaling.

Master weights and optimizer states stay fp32 in every layout. FSDP2 layouts cast through its
MixedPrecisionPolicy (parameters gathered in the compute dtype, gradients reduced in reduce_dtype); the
others (single process, DDP) run forward under autocast, and DDP reduces in reduce_dtype with a compression
hook (on GPUs). fp16 adds a dynamic loss scale: an overflow anywhere skips the step on every rank and halves
the scale (never below min_scale); loss_scale_window clean steps double it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from hpctrain.config.schema import PrecisionConfig
from hpctrain.parallel.clipping import scale_grads_

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def enum_value(value: Any) -> str:
    """A config enum's string (OmegaConf gives enums from structured configs, plain strings from dicts)."""
    return value.value if hasattr(value, "value") else str(value)


def compute_dtype(precision: PrecisionConfig) -> torch.dtype:
    return DTYPES[enum_value(precision.dtype)]


def reduce_dtype(precision: PrecisionConfig) -> torch.dtype:
    return DTYPES[enum_value(precision.reduce_dtype)]


def configure_device_math(tf32: bool, device: torch.device) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on GPUs (torch leaves matmuls at full fp32 by
    default: 8x slower on an A100/H100 for a 10-bit mantissa the training loss cannot tell apart)."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32


def fsdp_mp_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    if compute_dtype(precision) == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=reduce_dtype(precision))


@contextlib.contextmanager
def autocast(precision: PrecisionConfig, device: torch.device, enabled: bool) -> Iterator[None]:
    """Autocast to the compute dtype, for layouts without an FSDP2 mixed-precision policy."""
    dtype = compute_dtype(precision)
    if not enabled or dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def ddp_comm_hook(precision: PrecisionConfig, device_type: str) -> Any | None:
    """DDP gradient compression to reduce_dtype (None: reduce in fp32, DDP's default).

    torch's compression hooks need NCCL: on CPU/gloo DDP reduces in fp32 whatever reduce_dtype says (a CPU run
    on a GPU machine too: the mesh's device decides, not whether a GPU exists)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if device_type != "cuda":
        return None
    return {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}.get(
        reduce_dtype(precision)
    )


class LossScaler:
    """Dynamic loss scaling (the GradScaler recipe: x0.5 on overflow, x2 after loss_scale_window clean steps).

    torch's GradScaler/ShardedGradScaler are not used: their fused unscale kernel rejects a mix of DTensor (TP)
    and plain gradients, and under a pipeline schedule the first stage never sees the loss they must scale
    first. The overflow decision instead comes from the global gradient norm, which the engine all-reduces over
    every parallel dim anyway, so all ranks skip together without another collective. The skip itself happens
    on the device (fused AdamW's `found_inf`, hpctrain.parallel.engine); the scale is host state, updated from
    the step's one read of the reduced values, after the optimizer step is queued.
    """

    def __init__(self, p: PrecisionConfig) -> None:
        self.enabled = bool(p.loss_scaling)
        self.scale = float(p.initial_scale) if self.enabled else 1.0
        self.window = int(p.loss_scale_window)
        self.min_scale = float(p.min_scale)
        self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params: list[torch.Tensor]) -> None:
        if self.enabled:
            scale_grads_(params, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
