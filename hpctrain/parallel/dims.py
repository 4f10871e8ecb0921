"""The parallel degrees of a run and the named device mesh they make (torchtitan's ParallelDims, in small).

Mesh order, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp") (torchtitan's). TP is innermost so a
TP group is consecutive ranks (the GPUs of one node, on NVLink); CP next, its all-gathers of keys and values in
every attention the next busiest traffic; PP is outermost so only point-to-point activations cross the slowest
links. CP ranks read the same samples (each a part of every sequence), so the data rank is the (dp_replicate,
dp_shard) coordinate, while gradients are averaged, and FSDP shards parameters, over dp_shard x cp.

Size-1 dims are kept: every slice below exists in every layout, which keeps the callers free of special cases,
and a size-1 group costs nothing at run time. The exception is "cp", in the mesh only with context parallelism
(cp > 1): each dim is one more world-wide communicator split at start-up on a device-bound world, and nothing
reads a cp dim of one rank.

With expert parallelism (ep > 1) dp_shard is built as ("dp_shard_mod_ep", "ep") and flattened back to "dp_shard"
(torchtitan's layout): an EP group is ep consecutive DP ranks of one shard group (nearest each other after TP),
and FSDP shards each expert's weights over the dp_shard_mod_ep ranks holding the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")  # no cp: cp > 1 with ep > 1 is refused


class ParallelDimsError(ValueError):
    """The degrees do not fit together; the message says which and how to fix it."""


def _of_layout(name: str) -> property:
    return property(lambda self: getattr(self.layout, name), doc=f"Layout.{name}")


@dataclass(frozen=True)
class ParallelDims:
    """The mesh of a validated `Layout` (hpctrain.config.layout owns the degrees and their rules) on the
    processes this job really has."""

    layout: Layout
    world_size: int  # processes in the job (1 without a process group)
    device_type: str = "cpu"  # the engine's device ("cuda" on GPUs): the mesh's tensors live there

    def __post_init__(self) -> None:
        if self.world_size > 1 and self.layout.world_size != self.world_size:
            lay = self.layout
            raise ParallelDimsError(
                f"dp x tp x pp x cp = {lay.dp} x {lay.tp} x {lay.pp} x {lay.cp} = {lay.world_size} ranks, but there "
                f"are {self.world_size} processes: change parallel.dp / parallel.tp / parallel.pp / parallel.cp so "
                "their product is the number of processes")

    dp_replicate = _of_layout("dp_replicate")
    dp_shard = _of_layout("dp_shard")
    tp = _of_layout("tp")
    pp = _of_layout("pp")
    virtual_stages = _of_layout("virtual_stages")
    dp = _of_layout("dp")
    ep = _of_layout("ep")
    cp = _of_layout("cp")

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (model chunks): pp ranks x virtual stages per rank."""
        return self.pp * self.virtual_stages

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The world mesh; built on first use (a collective: every rank must ask for it).

        Its device type is the engine's device, never guessed from the backend's name (a default group
        created as "cpu:gloo,cuda:nccl" is not called "nccl")."""
        if not dist.is_initialized():
            raise RuntimeError("a device mesh needs torch.distributed to be initialised")
        if self.ep == 1:
            sizes = dict(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp)
            names = tuple(name for name in MESH_DIMS if name != "cp" or self.cp > 1)
            return init_device_mesh(self.device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        mesh = init_device_mesh(self.device_type, (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep,
                                                   self.tp), mesh_dim_names=EP_MESH_DIMS)
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh

    @cached_property
    def rank_grid(self) -> list:
        """The world mesh's ranks as nested lists (pp, dp_replicate, dp_shard, cp, tp): host data, read once."""
        return self.mesh.mesh.reshape(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp).tolist()

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks as one dim: the ranks that read different samples."""
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    @cached_property
    def grad_mesh(self) -> DeviceMesh:
        """The ranks whose gradients are averaged (what DDP reduces over): the DP ranks and, with context
        parallelism, their CP peers, which saw other parts of the same sequences."""
        if self.cp == 1:
            return self.dp_mesh
        return self.mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    @cached_property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: 1-D (shard) or, for HSDP, 2-D (replicate x shard); with context parallelism the shard
        dim is dp_shard x cp (torchtitan's dp_shard_cp)."""
        if self.cp == 1:
            return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]
        flat = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return self.mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else flat

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The ranks one sequence is split over (context parallelism: cp > 1 only)."""
        return self.mesh["cp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks one MoE layer's experts are split over (ep > 1 only)."""
        return self.mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for expert weights (ep > 1): the shard-group ranks holding the same experts (x replicas)."""
        return self.mesh["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1 else self.mesh["dp_shard_mod_ep"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    def coordinate(self, dim: str) -> int:
        """This rank's index along a mesh dim (0 when not distributed)."""
        return self.mesh[dim].get_local_rank() if self.distributed else 0

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads: TP and PP peers share it."""
        return self.dp_mesh.get_local_rank() if self.distributed else 0

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tp")

    @property
    def cp_rank(self) -> int:
        """Which chunks of every sequence this rank holds (hpctrain.parallel.context_parallel.chunk_ids)."""
        return self.coordinate("cp") if self.cp > 1 else 0
