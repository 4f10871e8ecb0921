"""The parallel degrees of a run and the named device mesh they make (torchtitan's ParallelDims, in small).

Mesh order, outermost first: ("pp", "dp_replicate", "dp_shard", "tp"). TP is innermost so a TP group is
consecutive ranks (the GPUs of one node, on NVLink); PP is outermost so only point-to-point activations
cross the slowest links. Size-1 dims are kept: every slice below exists in every layout, which keeps the
callers free of special cases, and a size-1 group costs nothing at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpctrain.config.layout import Layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class ParallelDimsError(ValueError):
    """The degrees do not fit together; the message says which and how to fix it."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    virtual_stages: int
    world_size: int
    device_type: str = "cpu"  # the engine's device ("cuda" on GPUs): the mesh's tensors live there

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "virtual_stages", "world_size"):
            if getattr(self, name) < 1:
                raise ParallelDimsError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp
        if product != self.world_size:
            raise ParallelDimsError(
                f"dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} = {product} ranks, but there are {self.world_size} processes: change parallel.dp / "
                "parallel.tp / parallel.pp so their product is the number of processes")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ParallelDimsError(f"virtual_stages={self.virtual_stages} without pipeline parallelism (pp=1): "
                                    "set parallel.pp>1 or parallel.virtual_stages=1")

    @classmethod
    def from_layout(cls, layout: Layout, world_size: int, device_type: str = "cpu") -> ParallelDims:
        if layout.dp % layout.dp_replicate:
            raise ParallelDimsError(f"dp={layout.dp} is not divisible by parallel.dp_replicate="
                                    f"{layout.dp_replicate}: use a dp_replicate that divides dp")
        return cls(dp_replicate=layout.dp_replicate, dp_shard=layout.dp // layout.dp_replicate, tp=layout.tp,
                   pp=layout.pp, virtual_stages=layout.virtual_stages, world_size=world_size,
                   device_type=device_type)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

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
        return init_device_mesh(self.device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=MESH_DIMS)

    @cached_property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks as one dim (what DDP and ZeroRedundancyOptimizer reduce over)."""
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP2's mesh: 1-D (shard) or, for HSDP, 2-D (replicate x shard)."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

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
