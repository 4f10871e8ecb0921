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
r = gradient-reduction dtype bytes (precision.reduce_dtype; 4 with the bf16 preset):
  * No DP, or DDP (ZeRO-0/1 without TP or PP): fp32 params 4 n and fp32 gradients 4 n, full, on every rank
    (DDP's buckets with gradient_as_bucket_view=True; `no_sync` accumulates into the same .grad). ZeRO-1 is
    torch.distributed.optim.ZeroRedundancyOptimizer: it shards only Adam's state, 8 n / N. Forward runs under
    torch.autocast, which casts each weight to the compute dtype; the casts are cached for the whole forward
    (torch.autocast's weight-cast cache, cleared on exit) and the matmuls save them for backward: + c n.
  * FSDP2 (torch.distributed.fsdp.fully_shard: ZeRO-2/3, and ZeRO-1 with TP or PP, which hpctrain runs as
    ZeRO-2; ZeRO-0 with TP or PP is FSDP2's `replicate`, N = 1): fp32 shards 4 n / N of params and of
    gradients, Adam 8 n / N, plus the unsharded parameters in MixedPrecisionPolicy.param_dtype (c bytes):
      - reshard_after_forward=False (ZeRO-2, replicate): all c n, from forward to backward;
      - ZeRO-3 without PP: the layer being computed and the prefetched one;
      - any stage under PP: torch/distributed/pipelining/stage.py `backward_maybe_with_nosync` (torch 2.13,
        lines 844-847) calls set_reshard_after_backward(False) and set_requires_gradient_sync(False) before
        every micro-batch's backward (`perform_reduce_grad`, lines 1173-1177, restores both after the last
        one, which schedules.py calls at the end of each step), so once a stage has run a backward its
        parameters stay unsharded: c n.
    Gradient accumulation (the engine calls set_requires_gradient_sync(False) on all but the last
    micro-batch) and PP (above) skip the reduce-scatter: `FSDPParamGroup.post_backward` (fsdp/_fully_shard/
    _fsdp_param_group.py, lines 607-612: `if not self.reduce_grads: ... return`) returns early and
    `FSDPParam.to_accumulated_grad_if_needed` (_fsdp_param.py, lines 802-813) upcasts the *unsharded* gradient
    to reduce_dtype (with reduce_dtype == param_dtype it is clamped to None and the .grad itself accumulates);
    `accumulate_unsharded_grad_if_needed` (lines 815-820) adds the next ones.
    That is r n per GPU, full size, until the last backward reduce-scatters it, layer by layer, into the
    4 n / N shards: the peak is max(r n, 4 n / N). One layer's unsharded gradient (c) and its reduce-scatter
    input (r) are in flight during backward.
  * CPU offload (any zero.offload_*: FSDP2's CPUOffloadPolicy; `offloads`) moves the fp32 shards of params,
    gradients and Adam state (16 n / N) and the optimizer step to host memory; working copies and unsharded
    gradients stay. With zero.offload_optimizer_device=nvme (Layout.offload_device, hpctrain/parallel/nvme.py)
    Adam's two moments (8 n / N) live in a file per rank on node-local NVMe instead (Part.nvme): host memory
    keeps the fp32 parameter shard (FSDP2 copies it to the GPU for every all-gather, so it must stay resident)
    and the gradient shard, 8 n / N; the NVMe holds 8 n / N per GPU. The chunks streamed through host memory
    at each step (zero.nvme_chunk_mb, a few per rank) are not counted. Traffic and time: offload.py.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    kind: str  # "params" | "grads" | "optimizer" | "activations"
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
    n_params: float, dp: int, zero_stage: int, dtype: str = "bf16", grad_bytes: int | None = None,
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


def data_parallel_kind(layout: Layout) -> str:
    """The wrapper hpctrain's engine uses: "none", "ddp", "fsdp" or "replicate" (engine.py, data_parallel.uses_fsdp)."""
    if layout.dp == 1:
        return "none"
    if layout.zero_stage >= 2 or layout.tp > 1 or layout.pp > 1:
        return "fsdp" if layout.zero_stage > 0 else "replicate"
    return "ddp"


def effective_zero_stage(layout: Layout) -> int:
    """The ZeRO stage that runs: ZeRO-1 with TP or PP is FSDP2 with reshard_after_forward=False, i.e. ZeRO-2
    (hpctrain/parallel/data_parallel.py docstring); without DP nothing is sharded."""
    if layout.dp == 1:
        return 0
    if layout.zero_stage == 1 and (layout.tp > 1 or layout.pp > 1):
        return 2
    return layout.zero_stage


def offloads(layout: Layout) -> bool:
    """FSDP2's CPUOffloadPolicy is on: any zero.offload_* under fully_shard (data_parallel.apply_fsdp; `replicate`,
    plain modules and DDP get no offload policy, and the checks reject offload below ZeRO-2)."""
    return (layout.offload_optimizer or layout.offload_params) and data_parallel_kind(layout) == "fsdp"


def moments_on_nvme(layout: Layout) -> bool:
    """Adam's moments live on node-local NVMe (zero.offload_optimizer_device=nvme) rather than in host memory."""
    return offloads(layout) and layout.offload_device == "nvme"


def accumulates(layout: Layout) -> bool:
    """Gradients of several micro-batches are summed before they are reduced (accumulation, or any PP)."""
    return layout.microbatches > 1 or layout.pp > 1


def hpctrain_state_parts(n: float, layer: float, layout: Layout) -> list[Part]:
    """Parameters, gradients and optimizer state one GPU holds for n parameters (layer: one layer's share)."""
    kind = data_parallel_kind(layout)
    if kind in ("none", "ddp"):
        return _unsharded_parts(n, layout)
    return _fsdp_parts(n, layer, layout, layout.zero_shard if kind == "fsdp" else 1)


def _unsharded_parts(n: float, layout: Layout) -> list[Part]:
    """A plain module or DDP, with ZeroRedundancyOptimizer for ZeRO-1."""
    c = layout.compute_bytes
    zero1 = layout.dp > 1 and layout.zero_stage == 1
    parts = [Part("params", "fp32 parameters (master weights)", MASTER * n)]
    if c < MASTER:
        parts.append(Part("params", f"{layout.dtype} autocast weight copies, saved for backward", c * n))
    parts.append(Part("grads", "fp32 gradients, full" + (" (DDP buckets)" if layout.dp > 1 else ""), MASTER * n))
    name = f"Adam moments, 1/{layout.dp} (ZeroRedundancyOptimizer)" if zero1 else "Adam moments"
    parts.append(Part("optimizer", name, ADAM * n / (layout.dp if zero1 else 1)))
    return parts


def _fsdp_parts(n: float, layer: float, layout: Layout, shard: int) -> list[Part]:
    """FSDP2 fully_shard (shard = N) or replicate (shard = 1), with CPU offload when configured."""
    c, r = layout.compute_bytes, layout.reduce_bytes
    cpu = offloads(layout)
    nvme = moments_on_nvme(layout)
    gathered_layers = effective_zero_stage(layout) == 3 and layout.pp == 1
    of = f", 1/{shard}" if shard > 1 else ""
    parts = [
        Part("params", f"fp32 parameter shard{of}", MASTER * n / shard, cpu),
        Part("params", f"{layout.dtype} unsharded parameters, " + ("2 layers gathered" if gathered_layers else
             "whole stage kept from forward to backward"), c * (2 * layer if gathered_layers else n)),
        Part("optimizer", f"Adam moments{of}", ADAM * n / shard, cpu and not nvme, nvme),
    ]
    shards = MASTER * n / shard
    if accumulates(layout):
        held = r * n if cpu else max(r * n, shards)  # the shards replace the accumulated gradients layer by layer
        parts.append(Part("grads", f"unsharded {layout.reduce_dtype or layout.dtype} gradients, accumulated until "
                          "the last micro-batch's reduce-scatter", held))
        if cpu:
            parts.append(Part("grads", f"fp32 gradient shard{of}", shards, True))
    else:
        parts.append(Part("grads", f"fp32 gradient shard{of}", shards, cpu))
    parts.append(Part("grads", "one layer's unsharded gradient + reduce-scatter input", (c + r) * layer))
    return parts
