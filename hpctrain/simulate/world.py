"""The job's world on one machine: a fake process group of the job's size, this process as rank R.

The mesh and its sub-meshes are built here, before any fake tensor mode is on: a mesh's rank grid is host data
(DeviceMesh slices and concatenates it with ops a fake tensor cannot run), the same on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from hpctrain.config.layout import Layout
from hpctrain.parallel.dims import ParallelDims


@contextlib.contextmanager
def fake_world(layout: Layout, rank: int, device_type: str = "cpu") -> Iterator[ParallelDims]:
    """Rank `rank` of a fake world of layout.world_size ranks, and its mesh on `device_type`, built; torn down on
    exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a simulation needs a process of its own: torch.distributed is initialised already")
    if layout.world_size == 1:  # one process makes no group (hpctrain.distributed.environment): nor does this
        yield ParallelDims(layout, 1, device_type)
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        dims = ParallelDims(layout, layout.world_size, device_type)
        for built in ("mesh", "rank_grid", "dp_mesh", "fsdp_mesh"):
            getattr(dims, built)
        for dim in ("tp", "pp"):  # the meshes the engine reads where the dim is > 1
            if dims.dim_sizes[dim] > 1:
                getattr(dims, f"{dim}_mesh")
        yield dims
    finally:
        dist.destroy_process_group()


def groups_held() -> int:
    """Process groups this rank is a member of (the default group included; none in a world of one)."""
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


@contextlib.contextmanager
def counting_group_calls() -> Iterator[list[str]]:
    """The new_group / split_group calls made through torch.distributed while the block runs (hpctrain's own
    groups beyond the mesh; each is a world-wide communicator split on a device-bound NCCL world)."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("new_group", "split_group")}

    def counted(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
