"""Data parallelism for one model part: ZeRO stages 0-3 and HSDP, all from torch's own wrappers.

- ZeRO-0: DDP, gradients all-reduced in buckets of zero.reduce_bucket_size bytes while backward runs.
- ZeRO-1: DDP + ZeroRedundancyOptimizer (each DP rank steps and keeps the optimizer state of 1/dp of the
  parameters, then broadcasts them). overlap_with_ddp is not used: on gloo it can hang.
- ZeRO-2: FSDP2 with reshard_after_forward=False (parameters stay gathered from forward to backward).
- ZeRO-3: FSDP2 with full resharding. dp_replicate > 1 makes the FSDP mesh 2-D: HSDP.
- Offload (zero.offload_optimizer / offload_params): FSDP2's CPUOffloadPolicy keeps the sharded parameters,
  gradients and the optimizer step on the CPU (pinned memory only when a GPU exists).

DDP is used for pure data parallelism only. It cannot hold DTensor (TP) parameters, and under a pipeline
schedule (several forwards before their backwards, sync in the last one) torch 2.13's DDP either asserts in
its bucket rebuilding after the first step or, with static_graph, reduces wrong gradients. So with TP or PP
the ZeRO-0 layout is FSDP2's `replicate` (DDP semantics: replicated parameters, all-reduced gradients), and
ZeRO-1 runs as ZeRO-2 (FSDP2 with reshard_after_forward=False, which shards the gradients too for the same
communication volume: reduce-scatter + all-gather instead of all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpctrain.config.schema import PrecisionConfig, ZeroConfig
from hpctrain.parallel.precision import ddp_comm_hook, fsdp_mp_policy

if TYPE_CHECKING:
    from hpctrain.models import Transformer


def uses_fsdp(zero_stage: int, tp: int, pp: int) -> bool:
    """Whether this layout's DP goes through FSDP2 (parameters are materialised after wrapping)."""
    return zero_stage >= 2 or tp > 1 or pp > 1


def apply_fsdp(model: Transformer, mesh: DeviceMesh, zero: ZeroConfig, precision: PrecisionConfig,
               reshard_after_forward: bool) -> None:
    """fully_shard each block, then the root (embeddings, final norm, head): one all-gather per block."""
    # Pinned where the mesh is on GPUs (pinning initialises CUDA: a CPU run on a GPU machine must not).
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
                              if zero.offload_optimizer or zero.offload_params else OffloadPolicy())
    kwargs = dict(mesh=mesh, mp_policy=fsdp_mp_policy(precision), offload_policy=offload)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def apply_replicate(model: Transformer, mesh: DeviceMesh, precision: PrecisionConfig) -> None:
    """DDP semantics for DTensor (TP) parameters, from FSDP2's replicate."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model.layers.values():
        replicate(block, mesh=mesh, mp_policy=fsdp_mp_policy(precision))
    replicate(model, mesh=mesh, mp_policy=fsdp_mp_policy(precision))


def apply_ddp(model: nn.Module, mesh: DeviceMesh, zero: ZeroConfig,
              precision: PrecisionConfig) -> nn.parallel.DistributedDataParallel:
    group = mesh.get_group()
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=zero.reduce_bucket_size / 2**20,
        gradient_as_bucket_view=True)
    hook = ddp_comm_hook(precision, mesh.device_type)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    _settle_buckets(ddp)
    return ddp


def _settle_buckets(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Run one throwaway forward/backward so DDP rebuilds its buckets in gradient-ready order now.

    DDP reduces the first iteration in one bucket and later ones in rebuilt buckets; the element order in
    a bucket decides the summation order of the ring all-reduce. Without this, a resumed run's first step
    (un-rebuilt) would differ in the last bits from the same step of an uninterrupted run (rebuilt), and
    bit-identical resume on more than 2 ranks would be lost. Weights and optimizer are untouched.
    """
    module = ddp.module
    device = next(module.parameters()).device
    ddp(torch.zeros(1, 2, dtype=torch.long, device=device)).float().sum().backward()
    for p in ddp.parameters():
        p.grad = None


def zero1_optimizer(param_groups: list[dict[str, Any]], mesh: DeviceMesh, optimizer_class: type,
                    defaults: dict[str, Any]) -> ZeroRedundancyOptimizer:
    """ZeroRedundancyOptimizer over the DP group, keeping hpctrain's decay / no-decay groups."""
    return ZeroRedundancyOptimizer(param_groups, optimizer_class=optimizer_class, process_group=mesh.get_group(),
                                   parameters_as_bucket_view=False, **defaults)
