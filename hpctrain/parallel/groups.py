"""Process groups beyond the device mesh, made in a number of calls that does not grow with the job.

With the default group bound to a device (`init_process_group(device_id=...)`, what hpctrain does on GPUs),
every `dist.new_group` is an NCCL communicator split that every rank of the world must join, members or not,
one after another: a group per (DP, TP) coordinate costs 512 world-wide splits for 175B's tied embeddings.
`split_group` makes all of them in one split; DeviceMesh makes its own dimensions the same way. Without a bound
device (gloo, the CPU tests) a group needs only its members (`use_local_synchronization`), so each rank makes
its own group and no other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def splits_in_one_call() -> bool:
    """Whether this world makes subgroups by splitting its device communicator (DeviceMesh's own test)."""
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None and torch.accelerator.is_available()


def own_group(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    """This rank's group among the disjoint `rank_lists` (None when it is in none), in one call at most.

    Every rank must call it with the same lists (the split is collective over the world)."""
    if splits_in_one_call():
        return dist.split_group(split_ranks=rank_lists)
    rank = dist.get_rank()
    mine = next((ranks for ranks in rank_lists if rank in ranks), None)
    return None if mine is None else dist.new_group(mine, use_local_synchronization=True)


def tied_embedding_pairs(mesh_ranks: list, last_rank: int) -> list[list[int]]:
    """The (first stage, last stage) rank pairs that hold the same DP/TP coordinates of a tied embedding.

    `mesh_ranks` is the world mesh's rank grid (pp, dp_replicate, dp_shard, tp); `last_rank` the pipeline
    rank that holds the last stage."""
    first, last = _flat(mesh_ranks[0]), _flat(mesh_ranks[last_rank])
    return [[a, b] for a, b in zip(first, last)]


def _flat(grid: list | int) -> list[int]:
    return [r for row in grid for r in _flat(row)] if isinstance(grid, list) else [grid]
