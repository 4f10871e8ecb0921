"""Model-state memory per GPU: the ZeRO paper's accounting, and what hpctrain's torch wrappers really hold.

The paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
sec. 3.1, Fig. 1; `zero_model_states`): mixed-precision Adam holds 2 bytes/param of fp16/bf16 weights, 2 of
gradients and K = 12 of optimizer state (fp32 master weights, momentum, variance): 16 bytes/param, not the 8
that a "weights + Adam" shortcut suggests; fp32 training holds 4 + 4 + 8. Stage 1 shards the optimizer state
over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 also the weights.

hpctrain (`hpctrain_state_parts`; hpctrain/parallel/engine.py, data_parallel.py, precision.py) keeps the
parameters themselves in fp32 as the master weights ("Master weights and optimizer states stay fp32 in every
layout"): 4 bytes of weights + 4 of gradients + 8 of Adam (exp_avg, exp_avg_sq), plus working copies the
paper does not count. n = parameters on the GPU, N = ranks ZeRO shards over, c = compute-dtype bytes,
r = gradient-reduction dtype bytes (precision.reduce_dtype; 4 with the bf16 preset), M = micro-batches:
  * No DP, or DDP (ZeRO-0 without TP or PP): fp32 params 4 n and fp32 gradients 4 n, full, on every rank
    (DDP's buckets with gradient_as_bucket_view=True; `no_sync` accumulates into the same .grad), Adam 8 n.
    Forward runs under torch.autocast, which casts each weight to the compute dtype; the casts are cached for
    the whole forward (torch.autocast's weight-cast cache, cleared on exit) and the matmuls save them for
    backward: + c n.
  * FSDP2 (torch.distributed.fsdp.fully_shard: ZeRO-1/2/3; ZeRO-0 with TP or PP is FSDP2's `replicate`,
    N = 1): fp32 shards 4 n / N of params (the master weights) and Adam 8 n / N, plus the unsharded
    parameters in MixedPrecisionPolicy.param_dtype (c bytes):
      - ZeRO-1/2 (reshard_after_forward=False, and `set_reshard_after_backward(False)` on every micro-batch
        but the last: data_parallel.microbatch_sync), `replicate`, and any stage under PP: all c n, from the
        first forward to the last backward of the step;
      - ZeRO-3 without PP: the units being computed and prefetched. ZeRO-3 shards each block's attention and
        MLP as FSDP units of their own: backward holds a block's units (the MLP computed, the attention
        prefetched, the norms' unit) = one layer; with whole-block units it would be two layers.
      - Expert parallelism (Layout.ep > 1): n, a layer and a unit count this EP rank's experts only (n_experts /
        ep of them), which FSDP2 shards over the dp_shard / ep ranks an EP group leaves; the shards' 4 n / N and
        8 n / N are then the rank's shard parameters (`sharded`: dense / dp_shard + experts / (dp_shard / ep)).
    Gradients, `accumulates_unsharded`:
      - reduce-scattered in every micro-batch (ZeRO-2/3 by default, and every stage with M = 1): fp32 shards
        4 n / N. FSDP2's `foreach_reduce` adds each reduce-scatter's output to the sharded .grad.
      - summed unsharded across micro-batches and reduce-scattered once (ZeRO-1 always, ZeRO-2/3 with
        zero.accumulate_unsharded, `replicate` (no-sync), and every stage under PP: below): with
        set_requires_gradient_sync(False), `FSDPParamGroup.post_backward` (fsdp/_fully_shard/
        _fsdp_param_group.py, torch 2.13: `if not self.reduce_grads: ... to_accumulated_grad_if_needed();
        return`) skips the reduce-scatter and `FSDPParam.to_accumulated_grad_if_needed` (_fsdp_param.py)
        upcasts the *unsharded* gradient to reduce_dtype (with reduce_dtype == param_dtype it is clamped to
        None and the .grad itself accumulates); `accumulate_unsharded_grad_if_needed` adds the next ones.
        That is r n per GPU, full size (Megatron's gradient buffer), until the last backward reduce-scatters
        it unit by unit into the 4 n / N shards: the peak is max(r n, 4 n / N).
    In flight during backward: one unit's unsharded gradient (c) and its reduce-scatter input (r, copied in by
    `foreach_reduce`; `reduce_scatter_max_input_buffers` = 1 keeps one such buffer): (c + r) x the largest
    unit (a layer, or under ZeRO-3 a block's MLP).
Columns: the ZeRO paper (sec. 3, 6) separates *model states* (parameters, gradients, optimizer state) from
*residual states* (activations, temporary buffers, fragmentation), and torch's FSDPMemTracker names FSDP2's
all-gather and reduce-scatter buffers apart from parameters and gradients (fsdp2_mem_tracker._FSDPRefType). So
do the parts here: Part kind "buffers" holds pure collective staging (one unit's all-gather output while it is
copied out, one unit's reduce-scatter or all-reduce input); a fresh gradient stays a gradient and an unsharded
working parameter a parameter. Where gradients accumulate unsharded, a unit's fresh gradient is added in and
freed before the last micro-batch's reduce-scatter input is made: it counts under grads, the input beyond it
(r - c bytes per parameter) under buffers.
  * Under PP torch's schedules drive FSDP2 themselves: `_PipelineStageBase.backward_maybe_with_nosync`
    (torch/distributed/pipelining/stage.py, torch 2.13) calls set_is_last_backward(False),
    set_reshard_after_backward(False) and set_requires_gradient_sync(False) before *every* micro-batch's
    backward, the last included, and `perform_reduce_grad` (the schedule's REDUCE_GRAD action after all
    backwards) sets them back and runs each parameter group's post_backward by hand: one reduce-scatter a step
    of gradients accumulated unsharded in the reduce dtype, and a stage's parameters unsharded from its first
    backward on, whatever the ZeRO stage. hpctrain leaves that as it is (overriding the stage's backward would
    have to replace the hand-run post_backward and FSDP2's end-of-backward callback too, for every schedule)
    and counts it: unsharded gradients r n and unsharded parameters c n at any stage under PP.
  * CPU offload (any zero.offload_*: FSDP2's CPUOffloadPolicy; `offloads`) moves the fp32 shards of params,
    gradients and Adam state (16 n / N) and the optimizer step to host memory; working copies and unsharded
    gradients stay. With zero.offload_optimizer_device=nvme (Layout.offload_device, hpctrain/parallel/nvme.py)
    Adam's two moments (8 n / N) live in a file per rank on node-local NVMe instead (Part.nvme): host memory
    keeps the fp32 parameter shard (FSDP2 copies it to the GPU for every all-gather, so it must stay resident)
    and the gradient shard, 8 n / N; the NVMe holds 8 n / N per GPU. The chunks streamed through host memory
    at each step (zero.nvme_chunk_mb, a few per rank) are not counted. Traffic and time: offload.py.
  * Where gradients accumulate unsharded in a wider dtype over several micro-batches without PP (`fills_buffer`),
    the engine adds each gradient into the reduce-dtype accumulator as backward makes it, the tied head's too
    (hpctrain/parallel/grad_buffer.py, Megatron's main_grad hooks): no unit's fresh gradient and no held head
    gradient beside the buffer, one parameter's fresh gradient at a time, a temporary under buffers.
Each model-state column is its own peak over the step (what tests/parallel/test_zero_memory.py measures on gloo
ranks): ZeRO-1 holds 2 + 4 + 12/N bytes per parameter (Megatron's distributed optimizer), ZeRO-2 2 + 16/N,
ZeRO-3 16/N, ZeRO-2/3 plus the transients `_fsdp_parts` names; the buffers column is the collectives' staging those
peaks held (one all-gather in forward, one reduce-scatter in backward), so that the parts add up to the total.
docs/planner.md ("ZeRO's memory") has GPT-3 6.7B's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.layout import data_parallel_kind, fills_buffer  # noqa: F401 (the layout owns them)
from hpctrain.plan.types import Layout

MIXED_PRECISION_BYTES = (2, 2, 12)  # (params, grads, optimizer K) per param, ZeRO paper sec. 3.1
FP32_BYTES = (4, 4, 8)
MASTER, ADAM = 4, 8  # hpctrain: fp32 parameters are the master weights; Adam's two fp32 moments


@dataclass(frozen=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer state on one GPU."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Part:
    """One named piece of a GPU's memory: which column it adds to, and whether it sits in host memory."""

    kind: str  # "params" | "grads" | "optimizer" | "buffers" | "activations"
    name: str
    bytes: float
    cpu: bool = False  # in host memory
    nvme: bool = False  # in a file on node-local NVMe (offload_optimizer_device=nvme)

    @property
    def on_gpu(self) -> bool:
        return not (self.cpu or self.nvme)

    @property
    def where(self) -> str:
        return "nvme" if self.nvme else "cpu" if self.cpu else "gpu"


def bytes_per_param(dtype: str = "bf16", grad_bytes: int | None = None, k: int | None = None) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter for Adam in this dtype (ZeRO paper)."""
    p, g, opt = FP32_BYTES if dtype == "fp32" else MIXED_PRECISION_BYTES
    return p, (g if grad_bytes is None else grad_bytes), (opt if k is None else k)


def zero_model_states(
    n_params: float,
    dp: int,
    zero_stage: int,
    dtype: str = "bf16",
    grad_bytes: int | None = None,
    k: int | None = None,
) -> ModelStates:
    """Model-state bytes per GPU for n_params replicated over dp ranks under a ZeRO stage (ZeRO Fig. 1)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError("zero_stage must be 0..3")
    p, g, opt = bytes_per_param(dtype, grad_bytes, k)
    return ModelStates(
        params=p * n_params / (dp if zero_stage >= 3 else 1),
        grads=g * n_params / (dp if zero_stage >= 2 else 1),
        optimizer=opt * n_params / (dp if zero_stage >= 1 else 1),
    )


def offloads(layout: Layout) -> bool:
    """FSDP2's CPUOffloadPolicy is on: any zero.offload_* under fully_shard (data_parallel.apply_fsdp; `replicate`,
    plain modules and DDP get no offload policy, and the checks reject offload below ZeRO-2)."""
    return (layout.offload_optimizer or layout.offload_params) and data_parallel_kind(layout) == "fsdp"


def moments_on_nvme(layout: Layout) -> bool:
    """Adam's moments live on node-local NVMe (zero.offload_optimizer_device=nvme) rather than in host memory."""
    return offloads(layout) and layout.offload_device == "nvme"


def accumulates_unsharded(layout: Layout) -> bool:
    """Gradients are summed unsharded over the step's micro-batches and reduced once (module docstring): FSDP2 or
    `replicate` under PP (torch's schedules), or with M > 1 at ZeRO-0 (`replicate`), ZeRO-1, or ZeRO-2/3 with
    zero.accumulate_unsharded (data_parallel.accumulates_unsharded)."""
    kind = data_parallel_kind(layout)
    if kind not in ("fsdp", "replicate"):
        return False
    if layout.pp > 1:
        return True
    return layout.microbatches > 1 and (kind == "replicate" or layout.zero_stage == 1 or layout.accumulate_unsharded)


def gradient_reductions(layout: Layout) -> int:
    """Reduce-scatters (all-reduces at ZeRO-0) of the whole gradient per step: one, or one per micro-batch."""
    return 1 if layout.zero_stage == 0 or accumulates_unsharded(layout) else layout.microbatches


def split_units(layout: Layout) -> bool:
    """Each block's attention and MLP are FSDP units of their own (data_parallel.apply_fsdp: ZeRO-3)."""
    return data_parallel_kind(layout) == "fsdp" and layout.zero_stage == 3


def hpctrain_state_parts(
    n: float,
    layer: float,
    layout: Layout,
    unit: float | None = None,
    root: float = 0.0,
    sharded: float | None = None,
    largest: float = 0.0,
) -> list[Part]:
    """Parameters, gradients, optimizer state and collective buffers one GPU holds for n parameters, each column
    at its own peak
    (layer: one layer's share; unit: the largest block-level FSDP unit's, a layer unless `split_units`, None: a
    layer; root: the parameters outside the blocks, FSDP2's root unit; sharded: the parameters of the GPU's FSDP2
    shards, None: n / zero_shard; with expert parallelism the experts' shards are cut over dp_shard / ep ranks,
    memory.shard_params_per_gpu)."""
    kind = data_parallel_kind(layout)
    if kind in ("none", "ddp"):
        return _unsharded_parts(n, layout)
    if kind == "replicate":
        return _replicate_parts(n, layer, layout)
    return _fsdp_parts(
        n,
        layer,
        layer if unit is None else unit,
        root,
        layout,
        n / layout.zero_shard if sharded is None else sharded,
        largest,
    )


def _unsharded_parts(n: float, layout: Layout) -> list[Part]:
    """A plain module or DDP (ZeRO-0)."""
    c = layout.compute_bytes
    parts = [Part("params", "fp32 parameters (master weights)", MASTER * n)]
    if c < MASTER:
        parts.append(Part("params", f"{layout.dtype} autocast weight copies, saved for backward", c * n))
    buckets = " (DDP buckets)" if layout.dp * layout.cp > 1 else ""
    parts.append(Part("grads", "fp32 gradients, full" + buckets, MASTER * n))
    parts.append(Part("optimizer", "Adam moments", ADAM * n))
    return parts


def _replicate_parts(n: float, layer: float, layout: Layout) -> list[Part]:
    """FSDP2's replicate (ZeRO-0 with TP or PP): fp32 parameters and Adam whole, compute-dtype working copies."""
    c, r = layout.compute_bytes, layout.reduce_bytes
    held = r * n if accumulates_unsharded(layout) else 0.0
    return [
        Part("params", "fp32 parameters (master weights)", MASTER * n),
        Part(
            "params",
            f"{layout.dtype} unsharded parameters, whole stage kept from the first forward to the last backward",
            c * n,
        ),
        Part("optimizer", "Adam moments", ADAM * n),
        Part("grads", "fp32 gradients", max(held, MASTER * n)),
        Part("grads", "one layer's unsharded gradient", c * layer),
        Part("buffers", "one layer's all-reduce input", r * layer),
    ]


def _fsdp_parts(
    n: float, layer: float, unit: float, root: float, layout: Layout, sharded: float, largest: float
) -> list[Part]:
    """FSDP2 fully_shard over N = zero_shard ranks (ZeRO-1/2/3), with CPU offload when configured.

    Measured against real gloo ranks in tests/parallel/test_zero_memory.py (torch's MemTracker, each column's
    own peak). Forward all-gathers each unit into a flat buffer and copies it out (`foreach_all_gather_copy_out`):
    one unit's buffer on top of what is gathered (a "buffers" part, as each reduce-scatter input is). The root
    unit (embeddings, final norm, head) is gathered from the first forward to the end of the last backward, and
    its fresh gradient (the head's, where the embedding is tied) is held through each backward until the
    embedding's adds in and the root's post-backward reduces it."""
    shard = layout.zero_shard
    c, r = layout.compute_bytes, layout.reduce_bytes
    cpu = offloads(layout)
    nvme = moments_on_nvme(layout)
    gathered_units = layout.zero_stage == 3 and layout.pp == 1
    of = f", 1/{shard}" if shard > 1 else ""
    if layout.ep > 1:
        of += f" (this EP rank's experts: 1/{layout.dp_shard_mod_ep})"
    parts = [
        Part("params", f"fp32 parameter shard{of}", MASTER * sharded, cpu),
        Part(
            "params",
            f"{layout.dtype} unsharded parameters, "
            + (
                "the root unit and one block's units"
                if gathered_units
                else "whole stage kept from the first forward to the last backward"
            ),
            c * (root + layer if gathered_units else n),
        ),
        Part("buffers", "one unit's all-gather output while it is copied out", c * unit),
        Part("optimizer", f"Adam moments{of}", ADAM * sharded, cpu and not nvme, nvme),
    ]
    shards = MASTER * sharded
    unit_name = "MLP" if split_units(layout) else "layer"
    if accumulates_unsharded(layout):
        held = r * n if cpu else max(r * n, shards)  # the shards replace the accumulated gradients unit by unit
        parts.append(
            Part(
                "grads",
                f"unsharded {layout.reduce_dtype or layout.dtype} gradients, accumulated until "
                "the last micro-batch's reduce-scatter"
                + (" (the buffer each gradient is added into as backward makes it)" if fills_buffer(layout) else ""),
                held,
            )
        )
        if cpu:
            parts.append(Part("grads", f"fp32 gradient shard{of}", shards, True))
        if fills_buffer(layout):
            return parts + _filled_buffer_parts(layout, unit, largest, unit_name)
        # a unit's fresh gradient (a gradient: its own peak) is added in and freed before the last micro-batch's
        # reduce-scatter input is made; that input is staging, counted beyond the gradient it follows
        peak = (c * unit, max(r - c, 0) * unit, unit_name)
    else:
        parts.append(Part("grads", f"fp32 gradient shard{of}", shards, cpu))
        # a block unit's fresh gradient and reduce-scatter input, or at the end the root's own (its gradient is
        # then the one held)
        peak = max((c * unit, r * unit, unit_name), (0.0, r * root, "root unit"), key=lambda m: m[0] + m[1])
    fresh, staged, whose = peak
    parts.append(
        Part(
            "grads",
            "the root's gradient held through backward" + (f" + one {whose}'s unsharded gradient" if fresh else ""),
            c * root + fresh,
        )
    )
    if staged:
        beyond = f", beyond its {layout.dtype} gradient, freed before it" if accumulates_unsharded(layout) else ""
        parts.append(
            Part(
                "buffers", f"the {whose}'s reduce-scatter input ({layout.reduce_dtype or layout.dtype}{beyond})", staged
            )
        )
    return parts


def _filled_buffer_parts(layout: Layout, unit: float, largest: float, unit_name: str) -> list[Part]:
    """Beyond the gradient buffer where each gradient is added in as it is made (`fills_buffer`): one parameter's
    fresh gradient at a time (a temporary, as in Megatron without gradient-accumulation fusion), and in the last
    micro-batch one unit's reduce-scatter input, made while the rest of the buffer is still held. The root's
    input, at the very end, is made once every block's part of the buffer has become a shard, so it is no peak
    beside the buffer."""
    c, r = layout.compute_bytes, layout.reduce_bytes
    return [
        Part(
            "buffers", f"one parameter's fresh {layout.dtype} gradient while it is added into the buffer", c * largest
        ),
        Part("buffers", f"one {unit_name}'s reduce-scatter input ({layout.reduce_dtype})", r * unit),
    ]
