"""Megatron-style tensor parallelism for hpctrain's GPT, with DTensor's `parallelize_module`.

Per block: QKV and MLP-in are split by columns (each TP rank owns whole heads, thanks to the head-major QKV
layout of the model), the attention and MLP output projections by rows, so each block costs one all-reduce
forward and one backward per sub-layer. With sequence parallelism the LayerNorm/dropout regions are split
along the sequence instead of replicated: the all-reduces become reduce-scatter + all-gather (same volume)
and those activations take 1/tp of the memory.

The token embedding is split by vocabulary rows (masked lookup + all-reduce); the tied output head reuses
that sharded weight, so the logits come out split by vocabulary and are gathered on the way out of the model.
(Loss parallelism would save that gather, but the pipeline schedule hands its loss function plain tensors,
and on the vocabularies used here the gather is small next to the layers.) Position embeddings and the
embedding dropout stay replicated: dropout > 0 with TP relies on TP peers seeding their RNG alike (the
engine seeds by DP rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpctrain.models.gpt import GPT

# Which weight dim each TP-split parameter is cut along (used by the plan's per-rank parameter counts).


def block_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The TP plan of one transformer block (submodule name -> style)."""
    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=out),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        plan.update({
            "norm1": SequenceParallel(),
            "norm2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def apply_tp(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split a (possibly pipeline-pruned) GPT across the TP mesh, in place; works on the meta device."""
    if model.tok_emb is not None:
        parallelize_module(model.tok_emb, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for index, block in model.layers.items():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
        if sequence_parallel and model.pos_emb is not None and index == next(iter(model.layers)):
            # The embedding sum is replicated: the first block takes its own sequence slice (no communication).
            parallelize_module(block, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    if model.norm_f is not None:
        if sequence_parallel:
            parallelize_module(model.norm_f, tp_mesh, SequenceParallel())
        # The tied head multiplies by the vocabulary-sharded embedding: its input must be a replicated DTensor.
        parallelize_module(model.norm_f, tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1) if sequence_parallel else Replicate(),
            desired_output_layouts=Replicate(), use_local_output=False))
        model.register_forward_hook(_gather_logits)


def _gather_logits(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Vocabulary-sharded logits -> the full logits as a plain tensor (backward takes the local slice)."""
    return output.full_tensor() if isinstance(output, DTensor) else output


