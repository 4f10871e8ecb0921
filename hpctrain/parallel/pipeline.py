"""Pipeline parallelism: cutting the model into stages and running them with torch.distributed.pipelining.

A stage is the full model (built on meta) with the layers it does not own deleted and the modules it does
not need set to None, so parameter names stay those of the single-process model and checkpoints load into
any layout. Layers are split evenly (the config checks require pp x virtual_stages to divide n_layers);
which top-level modules a stage keeps is the family entry's (`Family.stage_modules`): the first stage the
embeddings, the last the final norm and the head. A head tied to the token embedding (GPT's) is kept by the first
and the last stage, and the engine sums its gradients between them (Megatron's embedding group), so both copies
take identical steps.

Stage placement comes from the schedule's entry in hpctrain.schedules: looped schedules put stage s on
pipeline rank s % pp; zbv runs a V: rank r holds stages r and 2 pp - 1 - r (rank 0 holds the first and the
last stage).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hpctrain import schedules
from hpctrain.models import registry
from hpctrain.models.params import stage_holds

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


def prune_to_stage(model: FamilyModule, stage: int, split: Sequence[int]) -> FamilyModule:
    """Keep only what `stage` of the cut `split` (layers per stage, `Layout.layer_split`) computes (in place);
    parameter names do not change."""
    family = registry.get(model.family)
    for name in list(model.layers):
        if not stage_holds(family, f"layers.{name}", stage, split):
            del model.layers[name]
    for name in family.stage_modules:  # the top-level modules a stage may drop
        if not stage_holds(family, name, stage, split):
            setattr(model, name, None)
    return model


def stage_model(full: FamilyModule, stage: int, split: Sequence[int]) -> FamilyModule:
    """A stage cut from a full model built on the meta device (the full model is left as it was)."""
    return prune_to_stage(copy.deepcopy(full), stage, split)


def build_schedule(stages: list[PipelineStage], schedule: str, n_microbatches: int, loss_fn: Any) -> Any:
    """The schedule object for this rank's stages (the class named in hpctrain.schedules); `loss_fn`
    returns the loss of one microbatch.

    scale_grads=True divides the gradients by the number of microbatches: the loss is a mean over them.
    """
    entry = schedules.get(schedule)
    if entry.torch_class is None:
        raise ValueError(f"schedule {schedule} is modelled by the planner only; runnable: {schedules.RUNNABLE}")
    cls = getattr(torch_schedules, entry.torch_class)
    if entry.chunks == "one":
        if len(stages) != 1:
            raise ValueError(
                f"schedule {schedule} runs one stage per rank, got {len(stages)}: use "
                "interleaved_1f1b for virtual stages"
            )
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def evaluate(schedule: Any, placement: str, args: tuple[torch.Tensor, ...], **kwargs: Any) -> None:
    """Forward-only through the pipeline (`schedule.eval`). torch 2.13's eval on a V schedule (zbv, dualpipev)
    still runs its backward actions and fails where two stages share a rank ("can't steal_bwd_input if this
    stage doesn't have backward"): those run their own lowered plan with everything of the backward taken
    out (the forwards and their sends and receives keep their order, so the pairing between ranks holds)."""
    if placement != "v":
        schedule.eval(*args, **kwargs)
        return
    training = schedule.pipeline_order_with_comms
    forward = {rank: _forwards(actions) for rank, actions in training.items()}
    schedule.pipeline_order_with_comms = forward
    try:
        schedule.eval(*args, **kwargs)
    finally:
        schedule.pipeline_order_with_comms = training


_FORWARD_KINDS = {
    torch_schedules.FORWARD,
    torch_schedules.SEND_F,
    torch_schedules.RECV_F,
    torch_schedules.UNSHARD,
    torch_schedules.RESHARD,
}


def _forwards(actions: list[Any]) -> list[Any]:
    """A rank's lowered actions without the backward (overlapped forward/backward pairs keep their forward)."""
    out = []
    for action in actions:
        for a in action.sub_actions or (action,):
            if a.computation_type in _FORWARD_KINDS:
                out.append(a)
    return out


def start_up(schedule: Any, first_args: tuple[Any, ...], first_target: Any) -> None:
    """The schedule's start-up (the vote, then shape inference with one micro-batch forward and backward, whose
    memory torch frees after), which torch runs inside the first step: run apart, before it, so that the engine
    can tell its forward from training (an MoE layer's routing counts) and hpctrain.simulate from the measured
    step. `first_args` and `first_target` are the step's first micro-batch as the schedule splits it."""
    if hasattr(schedule, "_initialize_stages"):  # several stages on this rank (torch's multi-stage schedules)
        schedule._initialize_stages(first_args, {}, first_target)
    else:
        schedule._initialize_stage(first_args, {}, first_target)
