"""Megatron-style tensor parallelism for hpctrain's models, with DTensor's `parallelize_module`.

Per block, the plan is the model family's `tp_dims` (hpctrain.models.registry): QKV and MLP-in are split by
columns (each TP rank owns whole heads, or whole KV groups of Llama's grouped-query attention, thanks to the QKV
row layout; Llama's SwiGLU gate and up are two weights, split alike, so each rank holds matching gate and up rows),
the attention and MLP output projections by rows, so each block costs one all-reduce forward and one backward per
sub-layer. With sequence parallelism the norm/dropout regions are split along the sequence instead of
replicated: the all-reduces become reduce-scatter + all-gather (same volume) and those activations take 1/tp
of the memory.

The token embedding is split by vocabulary rows (masked lookup + all-reduce); GPT's tied output head reuses
that sharded weight, Llama's own head (`output`) is split by vocabulary rows the same way, so the logits come
out split by vocabulary and are gathered on the way out of the model.
(Loss parallelism would save that gather, but the pipeline schedule hands its loss function plain tensors,
and on the vocabularies used here the gather is small next to the layers.) Position embeddings and the
embedding dropout stay replicated: dropout > 0 with TP relies on TP peers seeding their RNG alike (the
engine seeds by DP rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpctrain.models import as_module, registry
from hpctrain.parallel.float8 import float8_tp_plan

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


def block_plan(sequence_parallel: bool, family: str) -> dict[str, Any]:
    """The TP plan of one transformer block of model family `family` (submodule name -> style), from the family's
    `tp_dims`: a weight split along dim 0 is column-parallel, along dim 1 row-parallel (its output reduced, or
    reduce-scattered along the sequence under SP). A per-head norm (`tp_head_norms`) keeps its weight whole on
    every rank while its input holds this rank's heads (dim 2 of [B, T, heads, head_dim]): as a replicated DTensor
    its gradient, a partial sum over the local heads, is all-reduced over TP (torchtitan's Qwen3 does the same)."""
    out = Shard(1) if sequence_parallel else Replicate()
    styles: dict[int, Callable[[], ParallelStyle]] = {
        0: ColwiseParallel,
        1: lambda: RowwiseParallel(output_layouts=out),
    }
    entry = registry.get(family)
    plan: dict[str, Any] = {
        name.removesuffix(".weight"): styles[dim]()
        for name, dim in entry.block_tp_dims().items()
        if name.endswith(".weight")
    }
    plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in entry.tp_head_norms})
    if sequence_parallel:
        plan.update(
            {
                "norm1": SequenceParallel(),
                "norm2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
        # A module TP leaves whole (an MoE layer) runs on the gathered sequence as plain tensors; its output,
        # the same on every TP rank, is cut back to this rank's slice (backward: all-gathered).
        plan.update(
            {
                name: PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                    use_local_output=True,
                )
                for name in entry.tp_whole
            }
        )
    return plan


def apply_tp(model: FamilyModule, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split a (possibly pipeline-pruned) model across the TP mesh, in place; works on the meta device."""
    if model.tok_emb is not None:
        parallelize_module(
            model.tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
    for index, block in model.layers.items():
        plan = block_plan(sequence_parallel, model.family)
        parallelize_module(block, tp_mesh, float8_tp_plan(block, plan))  # FP8 styles
        if sequence_parallel and model.embeds and index == next(iter(model.layers)):
            # The embedding is replicated: the first block takes its own sequence slice (no communication).
            parallelize_module(
                block,
                tp_mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            )
    if model.norm_f is not None:
        if sequence_parallel:
            parallelize_module(model.norm_f, tp_mesh, SequenceParallel())
        # The head multiplies by a vocabulary-sharded weight: its input must be a replicated DTensor.
        parallelize_module(
            model.norm_f,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Shard(1) if sequence_parallel else Replicate(),
                desired_output_layouts=Replicate(),
                use_local_output=False,
            ),
        )
        module = as_module(model)
        if not model.tied_embeddings:  # a head of its own, `output`
            parallelize_module(module.get_submodule("output"), tp_mesh, ColwiseParallel(use_local_output=False))
        module.register_forward_hook(_gather_logits)


def _gather_logits(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Vocabulary-sharded logits -> the full logits as a plain tensor (backward takes the local slice)."""
    return output.full_tensor() if isinstance(output, DTensor) else output
