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
out of the model as a DTensor split by vocabulary, `Shard(-1)`, and stay split: the loss is computed on the
shards (loss parallelism, `vocab_parallel_cross_entropy`), and no rank ever holds the full-vocabulary logits.
Position embeddings and the embedding dropout stay replicated: dropout > 0 with TP relies on TP peers seeding
their RNG alike (the engine seeds by DP rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
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
from hpctrain.parallel.sequence_parallel import ColwiseKeepingShard, GatherKeepingShard

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


def block_plan(sequence_parallel: bool, family: str, keep_shards: bool = False) -> dict[str, Any]:
    """The TP plan of one transformer block of model family `family` (submodule name -> style), from the family's
    `tp_dims`: a weight split along dim 0 is column-parallel, along dim 1 row-parallel (its output reduced, or
    reduce-scattered along the sequence under SP). A per-head norm (`tp_head_norms`) keeps its weight whole on
    every rank while its input holds this rank's heads (dim 2 of [B, T, heads, head_dim]): as a replicated DTensor
    its gradient, a partial sum over the local heads, is all-reduced over TP (torchtitan's Qwen3 does the same).
    `keep_shards` (with SP; `Layout.sp_keeps_shards`): the attention's and the MLP's column-parallel Linears save
    their gathered input as this rank's slice and gather it again in backward (hpctrain.parallel.sequence_parallel).
    """
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
        if keep_shards:
            for owner in ("attn", "mlp"):
                if owner in entry.tp_whole:
                    continue
                plan[owner] = GatherKeepingShard()
                for name, style in plan.items():
                    if name.startswith(f"{owner}.") and type(style) is ColwiseParallel:
                        plan[name] = ColwiseKeepingShard()
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


def apply_tp(model: FamilyModule, tp_mesh: DeviceMesh, sequence_parallel: bool, keep_shards: bool = False) -> None:
    """Split a (possibly pipeline-pruned) model across the TP mesh, in place; works on the meta device.
    `keep_shards`: see `block_plan`."""
    if model.tok_emb is not None:
        parallelize_module(
            model.tok_emb, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
    for index, block in model.layers.items():
        plan = block_plan(sequence_parallel, model.family, keep_shards)
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
        if not model.tied_embeddings:  # a head of its own, `output`: its logits stay a vocabulary-sharded DTensor
            parallelize_module(
                as_module(model).get_submodule("output"), tp_mesh, ColwiseParallel(use_local_output=False)
            )


# The loss works on chunks of whole tokens whose fp32 working copy holds at most this many logits (64 MiB).
# hpctrain.plan.activations.LOSS_CHUNK_ELEMENTS is the planner's copy (the planner imports no torch).
LOSS_CHUNK_ELEMENTS = 2**24


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy over the first `vocab_size` columns of `logits` [..., columns], plain or a DTensor split
    by vocabulary over a 1-D TP mesh (`Shard(-1)`: each rank holds its slice and never the full logits).

    Why a Function of our own rather than torch's `loss_parallel()` (which runs F.cross_entropy on the DTensor):
    the vocabulary padding columns (index >= vocab_size) must be left out, which on a DTensor means slicing
    across the shard boundary (a redistribution: the gather this avoids); torch's version also materialises
    log-softmax in fp32 for the whole local shard and saves it for backward. Here (Megatron-LM's
    _VocabParallelCrossEntropy, chunked over tokens) the forward keeps only the input logits and one fp32
    logsumexp per token; the fp32 working copy is one chunk of LOSS_CHUNK_ELEMENTS; backward recomputes the
    softmax chunk by chunk on the local shard, without communication. Collectives, forward only, on the logits'
    device and the caller's thread: a max all-reduce of [tokens] and a sum all-reduce of [2, tokens] (sum of
    exponentials and the target's logit), as functional collectives; none without a mesh."""
    group: DeviceMesh | None = None
    offset = 0
    if isinstance(logits, DTensor):
        mesh, placement = logits.device_mesh, logits.placements[0]
        if mesh.ndim != 1 or not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
            raise ValueError(f"vocabulary-parallel loss needs logits Shard(-1) on a 1-D mesh, got {logits.placements}")
        local = logits.to_local()
        step = -(-logits.shape[-1] // mesh.size())  # Shard's split (torch.chunk): the last shard may be short
        group, offset = mesh, min(mesh.get_local_rank() * step, logits.shape[-1])
        logits = local
    columns = logits.shape[-1]
    valid = min(max(vocab_size - offset, 0), columns)  # this shard's real (not padding) columns
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, columns), targets.reshape(-1), offset, valid, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on a vocabulary shard: columns [offset, offset + valid) of the vocabulary are this rank's
    `logits[:, :valid]` (the rest of its columns are padding); `group` None: one rank holds the whole vocabulary."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        offset: int,
        valid: int,
        group: DeviceMesh | None,
    ) -> torch.Tensor:
        n = logits.shape[0]
        real = logits[:, :valid]
        local = targets - offset
        here = (local >= 0) & (local < valid)  # the target's column is on this rank
        index = local.clamp(0, max(valid - 1, 0)).unsqueeze(1)
        if valid:
            top = real.amax(dim=1).float()  # exact in any dtype: no fp32 copy needed
            picked = real.gather(1, index).squeeze(1).float() * here
        else:  # a shard of padding only
            top = logits.new_full((n,), float("-inf"), dtype=torch.float32)
            picked = torch.zeros(n, dtype=torch.float32, device=logits.device)
        if group is not None:
            top = funcol.wait_tensor(funcol.all_reduce(top, "max", group))
        sums = torch.zeros(n, dtype=torch.float32, device=logits.device)
        for rows in _chunks(n, valid):  # one statement: a chunk's fp32 copy is freed before the next is made
            sums[rows] = real[rows].to(torch.float32, copy=True).sub_(top[rows].unsqueeze(1)).exp_().sum(dim=1)
        if group is not None:
            both = funcol.wait_tensor(funcol.all_reduce(torch.stack([sums, picked]), "sum", group))
            sums, picked = both[0], both[1]
        lse = top + sums.log()
        ctx.save_for_backward(logits, lse, index, here)
        ctx.valid = valid
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """softmax - one-hot on this rank's columns, times the mean's 1/tokens; zero on padding columns."""
        logits, lse, index, here = ctx.saved_tensors
        valid = ctx.valid
        n = logits.shape[0]
        out = torch.zeros_like(logits)
        scale = grad.float() / n
        for rows in _chunks(n, valid):
            out[rows, :valid] = _softmax_minus_target(logits[rows, :valid], lse[rows], index[rows], here[rows], scale)
        return out, None, None, None, None


def _softmax_minus_target(
    logits: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, here: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """(softmax - one-hot(target)) x scale of a chunk of tokens, in a fresh fp32 tensor that the caller's statement
    frees (the one-hot only where the target's column is on this rank)."""
    work = logits.to(torch.float32, copy=True).sub_(lse.unsqueeze(1)).exp_()
    return work.scatter_add_(1, index, -here.unsqueeze(1).float()).mul_(scale)


def _chunks(tokens: int, columns: int) -> list[slice]:
    """Token ranges whose [rows, columns] fp32 copy holds at most LOSS_CHUNK_ELEMENTS (one row at least)."""
    if not columns:
        return []
    rows = max(1, LOSS_CHUNK_ELEMENTS // columns)
    return [slice(i, min(i + rows, tokens)) for i in range(0, tokens, rows)]
