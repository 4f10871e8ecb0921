"""Global gradient norm and clipping across every parallel dim (DP, FSDP, TP, PP).

Stock `clip_grad_norm_` fails on TP without sequence parallelism (plain and DTensor gradients mixed) and on
FSDP + TP (DTensors on different meshes), and knows nothing of pipeline stages. Here gradients are grouped by
(mesh, placements): a group's squared norm is summed locally, then all-reduced over exactly the mesh dims its
gradients are sharded on (replicated dims hold copies and must not be counted twice). The per-stage total is
then summed over the pipeline group, where each rank holds different layers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def _squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in tensors], 2.0)
    return torch.stack(norms).pow(2).sum()


def global_grad_norm(params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm of all gradients of the model (every rank gets the same value, as a 0-d fp32 tensor).

    `params` are this rank's parameters, each counted once per pipeline stage (a tied weight held by two
    stages must be passed by one only).
    """
    plain: list[torch.Tensor] = []
    groups: dict[tuple[DeviceMesh, tuple], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                               for pl in g.placements])
            groups[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            plain.append(g)
    device = next((locals_[0].device for locals_ in groups.values()), torch.device("cpu"))
    total = _squared_norm(plain) if plain else torch.zeros((), device=device)
    for (mesh, placements), locals_ in groups.items():
        sq = _squared_norm(locals_).to(total.device)
        for dim, placement in enumerate(placements):
            if not placement.is_replicate() and mesh.size(dim) > 1:  # Shard or _StridedShard
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale gradients so their global norm is at most max_norm (same coefficient as torch's clip_grad_norm_)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
