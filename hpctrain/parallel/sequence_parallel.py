"""Sequence parallelism that keeps shards: the gathered input of a column-parallel Linear is saved for backward as
this rank's slice of the sequence and all-gathered again when backward needs it (Korthikanti et al. 2022, sec.
4.2.2; Megatron-LM's sequence parallelism does the same).

Why: DTensor's SP (`PrepareModuleInput(Shard(1) -> Replicate)` before the attention and the MLP, then
`ColwiseParallel` Linears) leaves the all-gathered input for the Linears to save whole: 2 s b h bytes for the QKV
projection and 2 s b h for the MLP's input on every TP rank, per layer and micro-batch, where the slice is 2 s b h /
t. For Llama 3 405B at TP 8 that was 4 of the 9.55 s b h a layer kept (docs/planner.md, "Llama 3 405B").

How: `GatherKeepingShard` gathers the attention's (or the MLP's) input as DTensor's SP does, and notes the gathered
tensor with its slice while the module runs; each of its column-parallel Linears (`ColwiseKeepingShard`, the same
parameter split as `ColwiseParallel`) multiplies the gathered input in `_GatheredLinear`, which saves the slice
instead. In backward the first of the module's Linears to need the input gathers it again (one all-gather, on
backward's thread, the group's one stream, as DTensor's own backward reduce-scatter), the others reuse it, and the
last one drops it. The gradient of the input leaves as a partial sum, which DTensor's backward of the forward
gather reduce-scatters, as before. Per layer: two all-gathers more in backward, 4 s b h (1 - 1/t) bytes less.

Used where nothing else decides what a block saves (`Layout.sp_keeps_shards`): no recomputation (full and
selective checkpoint the block), no FP8 (Float8Linear casts its input and saves the cast), eager (the engine keeps
DTensor's path under torch.compile), and no pipeline for now (docs/recompute.md: under torch's schedules
`dry_run=simulate` measured more activations on this path, not fewer).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


class _Slice:
    """A gathered input's slice of the sequence, shared by the Linears that read the gathered tensor; backward's
    re-gathered copy while some of them still need it."""

    def __init__(self, local: torch.Tensor, mesh: DeviceMesh) -> None:
        self.local, self.mesh = local, mesh
        self.users = 0  # Linears whose backward has not run yet
        self.again: torch.Tensor | None = None

    def gathered(self) -> torch.Tensor:
        """The whole sequence again (the first backward to ask gathers it; the last one frees it)."""
        if self.again is None:
            self.again = funcol.wait_tensor(funcol.all_gather_tensor(self.local, gather_dim=1, group=self.mesh))
        full = self.again
        self.users -= 1
        if self.users <= 0:
            self.again = None
        return full


# id(gathered local tensor) -> its slice, while the module that gathered it runs forward (weakly: an entry whose
# tensor is gone is never matched, so an id reused after it can never be mistaken for it)
_NOTED: dict[int, tuple[weakref.ref[torch.Tensor], _Slice]] = {}


def _slice_of(local: torch.Tensor) -> _Slice | None:
    entry = _NOTED.get(id(local))
    if entry is None or entry[0]() is not local:
        return None
    return entry[1]


class _GatheredLinear(torch.autograd.Function):
    """y = gathered @ weight.T (+ bias) on local tensors, saving `part`'s slice, not `gathered`. Under autocast
    (TP without FSDP2) the product runs in the autocast dtype, as F.linear's would, and the gradients come back in
    the dtypes of the inputs, as the casts' backward would give them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, gathered: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, part: _Slice
    ) -> torch.Tensor:
        device = gathered.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else gathered.dtype
        part.users += 1
        ctx.part, ctx.dtype = part, dtype
        ctx.dtypes = (gathered.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(part.local, weight)
        with torch.autocast(device, enabled=False):
            return F.linear(gathered.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _, weight = ctx.saved_tensors
        dtype, (input_dtype, weight_dtype, bias_dtype) = ctx.dtype, ctx.dtypes
        gathered = ctx.part.gathered().to(dtype)
        grad = grad.to(dtype)
        grad_input = grad @ weight.to(dtype)  # a partial sum over this rank's output columns
        flat_grad, flat_input = grad.reshape(-1, grad.shape[-1]), gathered.reshape(-1, gathered.shape[-1])
        grad_weight = flat_grad.t() @ flat_input
        grad_bias = flat_grad.sum(0).to(bias_dtype) if bias_dtype is not None else None
        return grad_input.to(input_dtype), grad_weight.to(weight_dtype), grad_bias, None


class GatherKeepingShard(ParallelStyle):
    """The module's input, this rank's slice of the sequence (`Shard(1)`), gathered whole as
    `PrepareModuleInput(Shard(1) -> Replicate)` gathers it, and noted with its slice for the module's
    `ColwiseKeepingShard` Linears while the module runs forward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        noted: list[int] = []

        def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            full = x.redistribute(device_mesh, (Replicate(),))
            local = full._local_tensor  # what the Linears find in the DTensor they are given
            _NOTED[id(local)] = (weakref.ref(local), _Slice(x._local_tensor.detach(), device_mesh))
            noted.append(id(local))
            return (full, *args[1:])

        def forget(*_: Any) -> None:
            while noted:
                _NOTED.pop(noted.pop(), None)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(forget, always_call=True)
        return module


class ColwiseKeepingShard(ColwiseParallel):
    """`ColwiseParallel` (its weight split by rows, its output this rank's columns, local) whose input, gathered by
    the enclosing `GatherKeepingShard`, is saved as its slice; any other input takes ColwiseParallel's path."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out = super()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ColwiseKeepingShard splits an nn.Linear, got {type(module).__name__}")
        plain = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            part = _slice_of(x._local_tensor) if isinstance(x, DTensor) else None
            if part is None or not isinstance(x, DTensor) or torch.compiler.is_compiling():
                return plain(x)
            weight, bias = module.weight, module.bias
            y = _GatheredLinear.apply(
                x.to_local(grad_placements=(Partial(),)),
                weight.to_local() if isinstance(weight, DTensor) else weight,
                (bias.to_local() if isinstance(bias, DTensor) else bias) if bias is not None else None,
                part,
            )
            return DTensor.from_local(y, device_mesh, (Shard(-1),), run_check=False)

        module.forward = forward  # type: ignore[method-assign,assignment]
        return out
