"""Loading a DCP checkpoint into a layout whose vocabulary padding differs from the one that saved it.

The embedding is padded to a multiple of 64 x TP rows (`hpctrain.models.params.padded_vocab`), so a run saved
with tp=8 holds more rows than the same run resumed with tp=4 or exported as a plain model. DCP reshards
everything else but refuses a size change. Only rows differ, and the rows past the tokenizer's vocabulary are
zero (never looked up, cut from the logits, so their gradient and Adam moments stay zero): for each tensor
whose saved size differs from the target in its first dimension alone, the saved tensor is read whole into a
plain CPU tensor and its leading rows are copied into the target (a DTensor takes its own shard), the rest
zeroed. Every other tensor loads through DCP as usual.

DCP reads through `FastReader`, whose `read_metadata` and records never unpickle without a restriction (a
checkpoint may come from elsewhere): a crafted one fails the load with `UnsafeCheckpoint`, naming the file and
what it asked for, on every rank alike.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.utils import CheckpointException
from torch.distributed.tensor import DTensor, distribute_tensor

from hpctrain.checkpoint.integrity import UnsafeCheckpoint
from hpctrain.checkpoint.reader import FastReader


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any], str]]:
    """(DCP's flattened key, container, key) of every leaf of a nested state dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", tree, key


def _rows_differ(saved: Any, target: Any) -> bool:
    if not (isinstance(saved, TensorStorageMetadata) and isinstance(target, torch.Tensor)):
        return False
    size, shape = tuple(saved.size), tuple(target.shape)
    return len(size) == len(shape) >= 1 and size[0] != shape[0] and size[1:] == shape[1:]


def _copy_rows(target: torch.Tensor, saved: torch.Tensor) -> None:
    rows = min(saved.shape[0], target.shape[0])
    full = torch.zeros(tuple(target.shape), dtype=target.dtype)
    full[:rows] = saved[:rows]
    with torch.no_grad():
        if isinstance(target, DTensor):  # every rank holds the full value: take the own shard, no communication
            target.copy_(distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                           src_data_rank=None))
        else:
            target.copy_(full.to(target.device))


def files_read(state: dict[str, Any], metadata: Metadata) -> set[str]:
    """The checkpoint's files a `dcp.load` of `state` on this rank reads (DCP's own load plan for it)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def load_state(state: dict[str, Any], checkpoint_id: str, process_group: dist.ProcessGroup | None,
               no_dist: bool = False, before_read: Callable[[set[str]], None] | None = None,
               verify: bool = True) -> None:
    """`dcp.load` into `state` in place, tolerating a different number of (padding) rows per tensor.
    `before_read` is given the files this rank will read, first (a node-local tier fetches the missing ones).
    `verify` checks each record's CRC32C as it is read (`reader.py`): a damaged record fails the load with a
    `CorruptCheckpoint` (in DCP's `CheckpointException`, which gathers every rank's)."""
    reader = FastReader(checkpoint_id, verify=verify)  # named: DCP would otherwise import fsspec to probe (0.6 s)
    metadata = reader.read_metadata()  # restricted (`integrity.read_metadata`): never DCP's pickle.load
    saved_meta = metadata.state_dict_metadata
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for fqn, container, key in _leaves(state):
        saved = saved_meta.get(fqn)
        if _rows_differ(saved, container[key]):
            swapped.append((container, key, container[key]))
            container[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    if before_read is not None:
        before_read(files_read(state, metadata))
    try:
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=no_dist)
    except CheckpointException as err:  # every rank's errors, gathered: a crafted record is said as itself
        unsafe = [exc for exc, _ in err.failures.values() if isinstance(exc, UnsafeCheckpoint)]
        if unsafe:
            raise unsafe[0] from err
        raise
    for container, key, target in swapped:
        _copy_rows(target, container[key])
        container[key] = target
