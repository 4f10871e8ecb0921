"""The rank's pipeline peers, stood in for in torch's start-up protocol (torch 2.13's pipelining).

A schedule's first step runs a start-up protocol between the stages before any micro-batch moves
(torch/distributed/pipelining/schedules.py `_warmup_p2p`, stage.py `_forward_metadata_inference` and
`_backward_metadata_inference`): a vote on static or dynamic shape inference, read back with `.item()`, then
each stage receives the previous stage's output shapes and the next stage's gradient shapes as pickled
objects. A fake process group delivers nothing and a fake tensor holds no value, so here those three reads
are answered with what the peers would send:

- the vote: every rank builds its stages with the same engine code, so every peer votes as this rank does
  (dynamic: the engine passes no example inputs);
- the shapes: every stage boundary carries the residual stream, the same tensor (shape, dtype) whichever
  stage sends it; it is what stage 0 sends, measured by running stage 0 (this rank's own, or a stand-in built
  the same way) on the step's first micro-batch. The rank's own sends are checked against it.

Everything after the start-up (the schedule's sends, receives, forwards and backwards) is torch's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining import stage as torch_stage


class BoundaryMismatch(RuntimeError):
    """A stage of this rank sent a tensor that differs from the stand-in's: the simulation would be wrong."""


@contextlib.contextmanager
def pipeline_peers(boundary: tuple[Any, ...] | None) -> Iterator[list[tuple[Any, ...]]]:
    """Answer the start-up protocol's reads while the block runs. `boundary`: the tensor metas a stage sends
    forward (None: this rank holds stage 0 and records them when it sends). Yields the metas this rank sent."""
    sent: list[tuple[Any, ...]] = []
    known = [boundary] if boundary is not None else []
    saved = (
        torch_schedules._PipelineSchedule._warmup_p2p,
        torch_stage.PipelineStage._recv_meta,
        torch_stage.PipelineStage._send_meta,
    )

    def vote(schedule: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        mode = torch_stage.InferenceMode
        dynamic = any(mode.needs_dynamic(stage._user_meta, has_backward) for stage in stages)
        for stage in stages:  # the product of every stage's vote; the peers' stages vote as these do
            stage._inference_mode = mode.DYNAMIC if dynamic else mode.STATIC

    def send_meta(stage: Any, meta: Any, dst_stage: int) -> None:
        if isinstance(meta, torch_stage._StageForwardMeta):
            metas = tuple(meta.forward_metas)
            if not known:
                known.append(metas)
            elif metas != known[0]:
                raise BoundaryMismatch(f"stage {stage.stage_index} sends {metas}, the stand-in said {known[0]}")
            sent.append(metas)

    def recv_meta(stage: Any, src_stage: int) -> Any:
        if not known:
            raise BoundaryMismatch(f"stage {stage.stage_index} receives before any stage 0 has sent")
        if src_stage < stage.stage_index:
            return torch_stage._StageForwardMeta(forward_metas=known[0])
        return torch_stage._StageBackwardMeta(backward_metas=tuple(torch_stage._derive_grad_metas(known[0])))

    # torch's own methods, replaced for the simulation and put back after it
    torch_schedules._PipelineSchedule._warmup_p2p = vote  # type: ignore[method-assign, assignment]
    torch_stage.PipelineStage._recv_meta = recv_meta  # type: ignore[method-assign, assignment]
    torch_stage.PipelineStage._send_meta = send_meta  # type: ignore[method-assign, assignment]
    try:
        yield sent
    finally:
        (
            torch_schedules._PipelineSchedule._warmup_p2p,  # type: ignore[method-assign]
            torch_stage.PipelineStage._recv_meta,  # type: ignore[method-assign]
            torch_stage.PipelineStage._send_meta,  # type: ignore[method-assign]
        ) = saved
