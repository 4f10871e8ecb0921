"""The gradient buffer of ZeRO-1 (and zero.accumulate_unsharded), filled as backward makes each gradient.

Megatron's distributed optimizer keeps one reduce-dtype `main_grad` per parameter and adds each gradient into
it the moment autograd makes it (a hook per parameter), so between micro-batches and through backward nothing
else of the gradients lives: 2 bytes of working parameters + 4 of gradient buffer + 12/N of sharded master and
Adam. FSDP2's own no-sync accumulation holds more, in the compute dtype, on top of its reduce-dtype accumulator
(`FSDPParam.unsharded_accumulated_grad`):
  * each unit's fresh gradients, on the unsharded parameters' `.grad` until the unit's post-backward adds them
    in (one layer's);
  * a tied head's gradient: the head and the embedding are one parameter, one autograd AccumulateGrad node, and
    autograd holds the head's contribution until the embedding's arrives at the very end of backward.
`fill_as_made` does Megatron's part on FSDP2. A post-accumulate-grad hook on each unsharded parameter adds the
fresh gradient into the accumulator (created in the reduce dtype by the first micro-batch's) and drops it; the
tied head reads the embedding through a leaf of its own (`BufferFill.head_weight`), whose gradient goes the same
way into the embedding's accumulator as soon as the head's backward makes it (under TP too: DTensor adds the head's
vocabulary-parallel gradient to the embedding's as autograd would have). FSDP2's post-backward then finds no `.grad`
to add, and in the last micro-batch reduce-scatters the accumulator as before. Beyond the buffer, one
parameter's fresh gradient lives at a time (Megatron's transient without gradient-accumulation fusion).

Only where FSDP2 accumulates in a wider dtype than it computes (reduce_dtype set: bf16 with fp32 reduction);
with one dtype `.grad` is the accumulator and AccumulateGrad adds in place. Not under PP, whose schedules
drive FSDP2's accumulation themselves: config.layout.fills_buffer says where. Reads FSDP2's FSDPParam (torch 2.13):
`_unsharded_param`, which lives from the first all-gather on, and `unsharded_accumulated_grad`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _fsdp_params(model: nn.Module) -> list[Any]:
    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            # torch 2.13 keeps a list of groups per module; earlier releases one group (or None)
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            for group in groups:
                if group is not None:
                    params.extend(group.fsdp_params)
    return params


def _add_into(fsdp_param: Any, grad: torch.Tensor) -> None:
    if fsdp_param.unsharded_accumulated_grad is None:
        fsdp_param.unsharded_accumulated_grad = grad.to(fsdp_param.reduce_dtype)
    else:
        fsdp_param.unsharded_accumulated_grad += grad


class BufferFill:
    """The hooks of one model part, registered once FSDP2 has made its unsharded parameters (`arm`, before each
    backward: idempotent), and the tied head's leaf."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.by_param: dict[int, Any] = {}
        self.armed = False  # every unsharded parameter hooked: later calls return at once

    def arm(self) -> None:
        """Hook every unsharded parameter not hooked yet (each lives from its unit's first all-gather on: after
        the first forward, all of them)."""
        if self.armed:
            return
        waiting = 0
        for fsdp_param in _fsdp_params(self.model):
            if fsdp_param.reduce_dtype is None:
                continue
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is None:
                waiting += 1
            elif id(param) not in self.by_param:
                self.by_param[id(param)] = fsdp_param
                param.register_post_accumulate_grad_hook(self._move(fsdp_param))
        self.armed = not waiting

    @staticmethod
    def _move(fsdp_param: Any) -> Any:
        def hook(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            if grad is not None:
                _add_into(fsdp_param, grad)

        return hook

    def head_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The tied head's view of the embedding `weight` (an unsharded parameter): a leaf of its own whose
        gradient goes straight into the embedding's accumulator, so autograd does not hold it to the end."""
        if not torch.is_grad_enabled():
            return weight
        self.arm()  # the head runs last in forward: every unit is gathered by now
        fsdp_param = self.by_param.get(id(weight))
        if fsdp_param is None:
            return weight
        leaf = weight.detach().requires_grad_()
        leaf.register_post_accumulate_grad_hook(self._move(fsdp_param))
        return leaf


def fill_as_made(model: nn.Module, tied_head: bool) -> BufferFill:
    """Fill `model`'s FSDP2 accumulators as gradients are made; `tied_head`: the model reads its head through
    `output_weight()` from the embedding (GPT), which then goes through `BufferFill.head_weight`."""
    fill = BufferFill(model)
    if tied_head:
        tied = model.output_weight
        model.output_weight = lambda: fill.head_weight(tied())  # type: ignore[assignment, operator]  # the model's method
    return fill
