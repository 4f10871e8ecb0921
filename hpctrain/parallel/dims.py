"""The parallel degrees of a run and the named device mesh they make (torchtitan's ParallelDims, in small).

Mesh order, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp") (torchtitan's). TP is innermost so a
TP group is consecutive ranks (the GPUs of one node, on NVLink); CP next, its all-gathers of keys and values in
every attention the next busiest traffic; PP is outermost so only point-to-point activations cross the slowest
links. CP ranks read the same samples (each a part of every sequence), so the data rank is the (dp_replicate,
dp_shard) coordinate, while gradients are averaged, and FSDP shards parameters, over dp_shard x cp.

Only the dims of size > 1 are in the mesh (torchtitan's `build_mesh` drops degree-1 dims too): in torch 2.13 every
mesh dim makes a process group, on a device-bound NCCL world a communicator split every rank joins at start-up,
size 1 or not. The exceptions are the dims FSDP2 shards over, kept at one rank (a one-rank shard group is FSDP2's
mesh under HSDP, or over an expert's sole holder): "dp_shard", and with EP "dp_shard_mod_ep" and "ep". Dropping a
size-1 dim keeps every rank's place, so the rank grid is the same; a dim that is not in the mesh has coordinate 0,
and its mesh (`tp_mesh` at tp 1...) is an error that says so: callers read those only at > 1. Most layouts save two
splits at start-up: dp_replicate, and the flattening of (dp_replicate, dp_shard) into "dp" without HSDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")  # no cp: cp > 1 with ep > 1 is refused
SHARD_DIMS = ("dp_shard", "dp_shard_mod_ep", "ep")  # in the mesh at any size: FSDP2 shards over them


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
                "their product is the number of processes"
            )

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
    def dim_sizes(self) -> dict[str, int]:
        """Every dim of the rank grid, outermost first (MESH_DIMS, or EP_MESH_DIMS with ep > 1), with its size."""
        if self.ep == 1:
            return dict(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        return dict(zip(EP_MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)))

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dims: those of size > 1, and FSDP2's shard dims whatever their size (SHARD_DIMS)."""
        return tuple(name for name, size in self.dim_sizes.items() if size > 1 or name in SHARD_DIMS)

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The world mesh (`mesh_dims`); built on first use (a collective: every rank must ask for it).

        Its device type is the engine's device, never guessed from the backend's name (a default group
        created as "cpu:gloo,cuda:nccl" is not called "nccl")."""
        if not dist.is_initialized():
            raise RuntimeError("a device mesh needs torch.distributed to be initialised")
        names = self.mesh_dims
        mesh = init_device_mesh(self.device_type, tuple(self.dim_sizes[n] for n in names), mesh_dim_names=names)
        if self.ep > 1:
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh

    def _dim(self, name: str) -> DeviceMesh:
        """One dim's mesh; a dim of one rank is not in the mesh, and asking for it is a mistake of the caller's."""
        if name not in self.mesh_dims:
            raise ParallelDimsError(
                f"mesh dim {name!r} has one rank in this layout, so the mesh leaves it out "
                "(hpctrain.parallel.dims): read it only where it is > 1"
            )
        return self.mesh[name]

    @cached_property
    def rank_grid(self) -> list:
        """The world mesh's ranks as nested lists (pp, dp_replicate, dp_shard, cp, tp): host data, read once."""
        return self.mesh.mesh.reshape(self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp).tolist()

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks as one dim: the ranks that read different samples."""
        if self.dp_replicate == 1:
            return self.mesh["dp_shard"]
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    @cached_property
    def grad_mesh(self) -> DeviceMesh:
        """The ranks whose gradients are averaged (what DDP reduces over): the DP ranks and, with context
        parallelism, their CP peers, which saw other parts of the same sequences."""
        if self.cp == 1:
            return self.dp_mesh
        names = ("dp_replicate", "dp_shard", "cp") if self.dp_replicate > 1 else ("dp_shard", "cp")
        return self.mesh[names]._flatten("dp_cp")

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
        return self._dim("cp")

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks one MoE layer's experts are split over (ep > 1 only)."""
        return self._dim("ep")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh for expert weights (ep > 1): the shard-group ranks holding the same experts (x replicas)."""
        return self.mesh["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1 else self.mesh["dp_shard_mod_ep"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self._dim("tp")

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self._dim("pp")

    def coordinate(self, dim: str) -> int:
        """This rank's index along a mesh dim (0 when not distributed, and along a dim of one rank)."""
        if not self.distributed or self.dim_sizes.get(dim, getattr(self.layout, dim, None)) == 1:
            return 0
        return self.mesh[dim].get_local_rank()

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
        return self.coordinate("cp")
