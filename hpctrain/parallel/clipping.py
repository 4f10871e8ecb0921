"""Global gradient norm and clipping across every parallel dim (DP, FSDP, TP, PP), with no collective of its own.

Stock `clip_grad_norm_` fails on TP without sequence parallelism (plain and DTensor gradients mixed) and on
FSDP + TP (DTensors on different meshes), knows nothing of pipeline stages, and issues one all-reduce per mesh
dim plus a host sync. Here each rank computes its *share* of the squared norm: every local gradient (shard)
divided by the number of ranks of its pipeline stage that hold the very same values (replicas over DP, copies
over TP). Summed over all ranks, the shares give the squared norm of every parameter counted exactly once, so
the engine adds the share to the one all-reduce it does every step anyway (with the loss and the control
flags) on its own device, and the clip coefficient is computed there from the reduced value: clipping reads
nothing back to the host. That also works when the gradients live on the CPU (FSDP2 offload) while the groups
are NCCL: the share is moved to the engine's device before any collective sees it.

Gradients that TP leaves `Partial` (sequence-parallel LayerNorm weights: each rank saw its sequence slice)
are reduced first, bucketed: one all-reduce per (mesh, placements) group, not one per parameter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def reduce_partial_grads_(params: Iterable[torch.Tensor]) -> None:
    """Sum TP-partial gradients over their mesh dims, one flat all-reduce per (mesh, placements) group."""
    groups: dict[tuple, list[tuple[torch.Tensor, DTensor]]] = defaultdict(list)  # (parameter, its gradient)
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            groups[(g.device_mesh, tuple(g.placements), g.dtype)].append((p, g))
    for (mesh, placements, _), members in groups.items():
        locals_ = [g.to_local() for _, g in members]
        # On the mesh's device: offloaded (CPU) gradients must not meet the mesh's NCCL groups as CPU tensors.
        flat = torch.cat([t.reshape(-1) for t in locals_]).to(mesh.device_type)
        for dim, pl in enumerate(placements):
            if isinstance(pl, Partial):
                op = dist.ReduceOp.AVG if pl.reduce_op == "avg" else dist.ReduceOp.SUM
                dist.all_reduce(flat, op=op, group=mesh.get_group(dim))
        flat = flat.to(locals_[0].device)
        reduced = tuple(Replicate() if isinstance(pl, Partial) else pl for pl in placements)
        for (p, g), local, chunk in zip(members, locals_, flat.split([t.numel() for t in locals_])):
            p.grad = DTensor.from_local(
                chunk.view_as(local), mesh, reduced, run_check=False, shape=g.shape, stride=g.stride()
            )


def copies(grad: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of one pipeline stage hold exactly this local gradient."""
    if not isinstance(grad, DTensor):
        return ranks_per_stage
    shards = math.prod(grad.device_mesh.size(d) for d, pl in enumerate(grad.placements) if not pl.is_replicate())
    return ranks_per_stage // shards


def squared_norm_share(params: Iterable[torch.Tensor], ranks_per_stage: int, device: torch.device) -> torch.Tensor:
    """This rank's share of the global squared gradient norm, as a 0-d float64 tensor on `device`.

    `params` are this rank's parameters, each counted once per pipeline stage (a tied weight held by two
    stages must be passed by one only); Partial gradients must have been reduced (`reduce_partial_grads_`).
    """
    groups: dict[tuple[int, torch.device], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        groups[(copies(g, ranks_per_stage), local.device)].append(local)
    share = torch.zeros((), dtype=torch.float64, device=device)
    for (count, _), tensors in groups.items():
        norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in tensors], 2.0)
        share += torch.stack(norms).double().pow(2).sum().to(device, non_blocking=True) / count
    return share


def scale_grads_(params: Iterable[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every gradient by `factor` in place: one foreach kernel per (device, dtype), not one per tensor.
    A 0-d tensor factor stays on the device (no host read); it is moved to each gradient's device (FSDP2's
    offload keeps gradients on the host, where the optimizer steps anyway). To the host only by a blocking copy:
    a non_blocking one returns before the value lands, and the host's kernel would read what the buffer held
    (the engine steps host optimizers by the values it read instead: no copy at all)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups[(local.device, local.dtype)].append(local)
    with torch.no_grad():
        for (device, _), tensors in groups.items():
            torch._foreach_mul_(
                tensors,
                factor.to(device, non_blocking=device.type != "cpu") if isinstance(factor, torch.Tensor) else factor,
            )


def clip_coefficient(squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) from the reduced squared norm, on its device (torch's clip_grad_norm_
    coefficient, computed in float64 as a Python float would be: the same bits after the cast to the
    gradients' dtype). NaN for a NaN norm; the step it belongs to is not applied then."""
    return (max_norm / (squared_norm.sqrt() + 1e-6)).clamp(max=1.0)


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, squared_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most max_norm, without a host sync (max_norm <= 0: off)."""
    if max_norm > 0:
        scale_grads_(params, clip_coefficient(squared_norm, max_norm))
