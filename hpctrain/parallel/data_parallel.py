"""Data parallelism for one model part: ZeRO stages 0-3 and HSDP, all from torch's own wrappers.

- ZeRO-0: DDP, gradients all-reduced in buckets of zero.reduce_bucket_size bytes while backward runs.
- ZeRO-1..3: FSDP2 (`fully_shard`). Its sharded fp32 parameter is the master weight the optimizer steps, so
  the fp32 master and Adam's moments are sharded over the DP ranks at every stage; what differs is what lives
  between micro-batches (`microbatch_sync`):
  - ZeRO-1 (Megatron's distributed optimizer: compute-dtype working parameters, a reduce-dtype gradient
    buffer, fp32 master + Adam sharded): reshard_after_forward=False, parameters kept unsharded across the
    step's micro-batches (one all-gather a step), gradients accumulated unsharded in the reduce dtype without
    communication and reduce-scattered once, in the last micro-batch's backward.
  - ZeRO-2: parameters as ZeRO-1, gradients reduce-scattered in every micro-batch's backward, so they stay
    sharded across micro-batches (DeepSpeed's and torchtitan's gradient accumulation).
  - ZeRO-3: parameters resharded after forward and after backward (all-gathered twice per micro-batch), the
    attention and the MLP of each block sharded as FSDP units of their own (the transients of a unit, its
    unsharded gradient and its reduce-scatter input, are then an MLP's, two thirds of a block's).
  zero.accumulate_unsharded=true gives ZeRO-2/3 ZeRO-1's accumulation (one reduce-scatter a step, unsharded
  reduce-dtype gradients between micro-batches). dp_replicate > 1 makes the FSDP mesh 2-D: HSDP.
- Offload (zero.offload_optimizer / offload_params): FSDP2's CPUOffloadPolicy keeps the sharded parameters,
  gradients and the optimizer step on the CPU (pinned memory only when a GPU exists).

DDP is used for pure data parallelism at ZeRO-0 only. It cannot hold DTensor (TP) parameters, and under a
pipeline schedule (several forwards before their backwards, sync in the last one) torch 2.13's DDP either
asserts in its bucket rebuilding after the first step or, with static_graph, reduces wrong gradients. So with
TP or PP the ZeRO-0 layout is FSDP2's `replicate` (DDP semantics: replicated parameters, all-reduced gradients).
Under PP torch's schedules drive FSDP2 themselves (hpctrain.plan.states explains what they force).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from hpctrain.config.schema import PrecisionConfig, ZeroConfig
from hpctrain.models import as_module
from hpctrain.models.common.moe import GroupedExperts, MoE
from hpctrain.parallel.precision import ddp_comm_hook, fsdp_mp_policy

if TYPE_CHECKING:
    from hpctrain.models.family import FamilyModule


def uses_fsdp(zero_stage: int, tp: int, pp: int, ep: int = 1) -> bool:
    """Whether this layout's DP goes through FSDP2 (parameters are materialised after wrapping): DDP cannot hold
    DTensor parameters (TP's, EP's experts) nor run under a pipeline schedule."""
    return zero_stage >= 1 or tp > 1 or pp > 1 or ep > 1


def accumulates_unsharded(zero_stage: int, accumulate_unsharded: bool) -> bool:
    """Whether gradients are summed unsharded over the step's micro-batches and reduce-scattered once (ZeRO-1,
    or zero.accumulate_unsharded) rather than reduce-scattered in every micro-batch (ZeRO-2/3)."""
    return zero_stage == 1 or accumulate_unsharded


def apply_fsdp(
    model: FamilyModule,
    mesh: DeviceMesh,
    zero: ZeroConfig,
    precision: PrecisionConfig,
    zero_stage: int,
    experts: ExpertSharding | None = None,
) -> None:
    """fully_shard each block (ZeRO-3: its attention and MLP as units of their own first), then the root
    (embeddings, final norm, head). ZeRO-1/2 keep the parameters gathered from forward to backward. Under expert
    parallelism each MoE layer's experts are a unit of their own first, over `experts.mesh`."""
    root = as_module(model)
    # Pinned where the mesh is on GPUs (pinning initialises CUDA: a CPU run on a GPU machine must not).
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
        if zero.offload_optimizer or zero.offload_params
        else OffloadPolicy()
    )
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        mp_policy=fsdp_mp_policy(precision),
        offload_policy=offload,
        reshard_after_forward=zero_stage == 3,
        shard_placement_fn=expert_placement(root, mesh),
    )
    for block in model.layers.values():
        if experts is not None:
            experts.wrap(
                block,
                lambda unit, mesh: fully_shard(
                    unit, **{**kwargs, "mesh": mesh, "shard_placement_fn": expert_placement(unit, mesh)}
                ),
            )
        if zero_stage == 3:
            fully_shard(block.get_submodule("attn"), **kwargs)
            fully_shard(block.get_submodule("mlp"), **kwargs)
        fully_shard(block, **kwargs)
    fully_shard(root, **kwargs)


def expert_placement(module: nn.Module, mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard | None]:
    """Where FSDP2 shards the stacked experts' weights ([experts here, ...]) over `mesh`: dim 1 (an expert's own
    rows) when the experts here do not divide over the ranks sharding them. FSDP2 pads dim 0 to a multiple of
    the ranks, so each would otherwise hold a whole expert and padding: Qwen3-235B's 16 experts per EP 8 rank
    over the 32 ranks holding them took twice the planner's memory (dry_run=simulate). torchtitan does the same.
    Every other parameter keeps FSDP2's dim 0."""
    shard = mesh.size(mesh.ndim - 1)  # an HSDP mesh shards over its last dimension
    stacked = {id(p) for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters(False)}

    def place(param: nn.Parameter) -> Shard | None:
        if id(param) not in stacked:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(1) if local.shape[0] % shard and not local.shape[1] % shard else None

    return place


@dataclass(frozen=True)
class ExpertSharding:
    """How the data-parallel wrapper treats expert-parallel experts: a unit of their own over `mesh`, the DP
    ranks holding the same experts (hpctrain.parallel.expert_parallel)."""

    mesh: DeviceMesh

    def wrap(self, block: nn.Module, wrapper: Callable[[nn.Module, DeviceMesh], Any]) -> None:
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, MoE):
            wrapper(mlp.experts, self.mesh)


def microbatch_sync(model: FSDPModule, zero_stage: int, accumulate_unsharded: bool, last: bool) -> None:
    """Set FSDP2 up for the next micro-batch's backward (the accumulation loop; PP schedules do their own).

    Reduce-scatter in this backward unless gradients accumulate unsharded (`accumulates_unsharded`) and this
    is not the last micro-batch; ZeRO-1/2 keep parameters unsharded until the last backward (one all-gather a
    step), ZeRO-3 reshards after every backward. ZeRO-0 (`replicate`) all-reduces once, in the last one."""
    if zero_stage == 0:
        model.set_requires_gradient_sync(last)
        return
    model.set_requires_gradient_sync(last or not accumulates_unsharded(zero_stage, accumulate_unsharded))
    model.set_reshard_after_backward(last or zero_stage == 3)


def apply_replicate(
    model: FamilyModule, mesh: DeviceMesh, precision: PrecisionConfig, experts: ExpertSharding | None = None
) -> None:
    """DDP semantics for DTensor (TP, EP) parameters, from FSDP2's replicate."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model.layers.values():
        if experts is not None:
            experts.wrap(block, lambda unit, mesh: replicate(unit, mesh=mesh, mp_policy=fsdp_mp_policy(precision)))
        replicate(block, mesh=mesh, mp_policy=fsdp_mp_policy(precision))
    replicate(as_module(model), mesh=mesh, mp_policy=fsdp_mp_policy(precision))


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, zero: ZeroConfig, precision: PrecisionConfig
) -> nn.parallel.DistributedDataParallel:
    group = mesh.get_group()
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=zero.reduce_bucket_size / 2**20, gradient_as_bucket_view=True
    )
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
