"""Activation checkpointing (parallel.recompute), applied per transformer block (docs/recompute.md).

- full: each block keeps only its input; the whole block is recomputed in backward (Chen et al. 2016;
  Narayanan 2021 eq. 3 counts this as a fourth forward pass).
- selective: an op-level policy for flash attention (torch's selective activation checkpointing, in the spirit
  of torchtitan's `_save_list`). With SDPA there is no s x s attention matrix left for Korthikanti et al. 2022's
  selective recomputation to drop, so saving "every matmul and collective" kept more than no recomputation under
  TP + SP (the row-parallel partial sums, full size on every rank). The policy instead saves the outputs of
  what is costly to rerun or must not rerun, and recomputes the element-wise rest:
    saved      the attention kernels' outputs (SDPA's and the fused ones context parallelism's mask calls
               directly: the attention is never recomputed), the matmuls (mm, addmm, bmm,
               FP8's _scaled_mm and its amax reduction, MoE's _grouped_mm), and the TP collectives' outputs
               (all-gather, reduce-scatter, all-reduce, and their waits), so recomputation never communicates
               over TP;
    not saved  a matmul that contracts over a TP-sharded dimension (a row-parallel Linear: its output is a
               Partial DTensor, a full-size partial sum that a reduce-scatter or all-reduce always follows; that
               collective's output is saved instead, at 1/t of the size under SP). Recomputation reruns the
               attention's output projection for it (the MLP's is past the last tensor backward needs, and the
               non-reentrant checkpoint stops before it); the norms, RoPE, GELU/SiLU and products, residual adds
               and dropout (from the saved RNG state) are rerun from the saved tensors.
  The rule reads the matmul's output (a Partial DTensor), not module names or widths: a column-parallel
  output can have the residual width (GPT's MLP at t = 4), so a shape rule would misjudge it. Under
  torch.compile the policy can run on the graph's plain local tensors (AOTAutograd takes DTensors apart), see no
  placement, and save those partial sums too (more memory, same result). MoE's all-to-alls are not saved: a
  recomputed MoE layer reruns its count exchange and communicates over EP whatever the policy (hpctrain.plan.comm
  counts the two extra all-to-alls).

Both modes replay a block's host reads in its recomputation (hpctrain.models.common.host_reads): the sizes an MoE
layer reads to the host (EP's all-to-all split sizes, the expert loop's segment sizes) come from the routing, which
the recomputation repeats exactly, so the forward's values serve again instead of a second stop of a GPU's queue.

The composable `checkpoint` keeps parameter names unchanged (no `_checkpoint_wrapped_module` prefix), so
weight initialisation and checkpoints see the same names in every layout.
"""

from __future__ import annotations

import contextlib
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from hpctrain.models.common.host_reads import host_read_contexts

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule

_aten, _c10d = torch.ops.aten, torch.ops._c10d_functional


def _ops(namespace: Any, *names: str) -> set[Any]:
    """The `.default` overloads of the named ops this torch build has (the GPU kernels and _grouped_mm are
    missing from some builds)."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default}
_MATMULS |= _ops(_aten, "_grouped_mm")
# SDPA's kernels, and the fused kernels context parallelism's bottom-right causal mask calls directly
# (`CausalBias._dispatch`: flash through `_scaled_dot_product_flash_attention`, but memory-efficient attention,
# fp32's kernel, through `_efficient_attention_forward`; `_flash_attention_forward` for completeness), so the
# attention is saved in every dtype and kernel CP takes (docs/context_parallel.md). SDPA's math fallback has no
# op of its own: its two bmm are saved as matmuls.
_ATTENTION = _ops(
    _aten,
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_efficient_attention_forward",
    "_flash_attention_forward",
)
_COLLECTIVES = _ops(_c10d, "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
_WAIT = _c10d.wait_tensor.default
_AMAX = {_aten.max.default}  # FP8's tensorwise scale: a reduction over the whole tensor (torchtitan saves it)
SAVED_OPS = frozenset(_MATMULS | _ATTENTION | _COLLECTIVES | _AMAX)
# Outputs of the saved collectives not yet waited on: their wait is saved too, and only theirs (an all-to-all
# reruns, and so must its wait, or the rerun collective would never be waited on).
_saved_unwaited: dict[int, weakref.ref[torch.Tensor]] = {}


# Profiler ranges are not cached, nor counted: FSDP2's post-forward hook on a unit inside the block (the experts
# under expert parallelism) opens a different number of them in forward and in recomputation, which SAC would
# refuse as a nondeterministic region (torch's own list ignores detach for the same reason).
SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter_new.default,
        *(
            getattr(torch.ops.profiler._record_function_exit, o)
            for o in torch.ops.profiler._record_function_exit.overloads()
        ),
    }
)


def is_partial_sum(output: Any) -> bool:
    """Whether a matmul's output is a Partial DTensor: it contracted over a TP-sharded dimension (a row-parallel
    Linear), and a reduce-scatter or all-reduce follows."""
    return isinstance(output, DTensor) and any(p.is_partial() for p in output.placements)


def save_for_flash_attention(
    ctx: SelectiveCheckpointContext,
    op: Any,
    *args: Any,
    **kwargs: Any,
) -> CheckpointPolicy:
    """The selective policy (module docstring): save attention, matmul and TP collective outputs, except partial
    sums. torch calls it in forward only, after the op ran (`ctx.op_output`)."""
    if op is _WAIT:
        ref = _saved_unwaited.pop(id(args[0]), None)
        saved = ref is not None and ref() is args[0]
    else:
        saved = op in SAVED_OPS and not (op in _MATMULS and is_partial_sum(ctx.op_output))
        if saved and op in _COLLECTIVES:
            _saved_unwaited[id(ctx.op_output)] = weakref.ref(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class _Both:
    """Two contexts as one, entered in order, re-enterable as torch enters a recomputation's context."""

    def __init__(self, first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> None:
        self.contexts = (first, second)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stack = stack.pop_all()

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return self._stack.__exit__(kind, err, tb)


def _selective_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The selective policy's caching contexts, with the host reads' replay."""
    forward, recompute = create_selective_checkpoint_contexts(save_for_flash_attention)
    record, replay = host_read_contexts()
    return _Both(forward, record), _Both(recompute, replay)


def apply_recompute(model: FamilyModule, mode: str) -> None:
    """Checkpoint every block of `model` ("none" | "selective" | "full"), in place."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"parallel.recompute must be none, selective or full, got {mode!r}")
    for block in model.layers.values():
        checkpoint(block, context_fn=host_read_contexts if mode == "full" else _selective_contexts)
