"""Loading a DCP checkpoint into a layout whose vocabulary padding differs from the one that saved it.

The embedding is padded to a multiple of 64 x TP rows (`hpctrain.models.params.padded_vocab`), so a run saved
with tp=8 holds more rows than the same run resumed with tp=4 or exported as a plain model. DCP reshards
everything else but refuses a size change. Only rows differ, and the rows past the tokenizer's vocabulary are
zero (never looked up, cut from the logits, so their gradient and Adam moments stay zero): for each tensor
whose saved size differs from the target in its first dimension alone, the saved tensor is read whole into a
plain CPU tensor and its leading rows are copied into the target (a DTensor takes its own shard), the rest
zeroed. Every other tensor loads through DCP as usual.

Tensors renamed or re-laid out since a checkpoint was written load through their family's `legacy_source`
(today: Llama's SwiGLU, whose interleaved `mlp.fc.weight` became `mlp.gate.weight` and `mlp.up.weight`): where
the target's key is missing from the checkpoint and the old key is there, the old tensor is loaded in the
target's own layout (a DTensor with its mesh and placements, so each rank reads its share) and converted one
tensor at a time: gathered whole on its mesh, cut, each rank keeping its own shard. A rank holds one old tensor's
shard beside each target while DCP reads, and one whole old tensor at a time while converting. Model weights and
optimizer state (Adam's moments follow their weight's layout) alike.

DCP reads through `FastReader`, whose `read_metadata` and records never unpickle without a restriction (a
checkpoint may come from elsewhere): a crafted one fails the load with `UnsafeCheckpoint`, naming the file and
what it asked for, on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.utils import CheckpointException
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty

from hpctrain.checkpoint.integrity import UnsafeCheckpoint
from hpctrain.checkpoint.reader import FastReader
from hpctrain.models.llama import model as llama

# Per model family: a state-dict key -> (the key an older checkpoint holds it under, how to take it from that).
LEGACY_SOURCES: tuple[Callable[[str], tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None], ...] = (
    llama.legacy_source,
)


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any], str]]:
    """(DCP's flattened key, container, key) of every leaf of a nested state dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", tree, key


def _rows_differ(saved: Any, target: Any) -> TypeGuard[TensorStorageMetadata]:
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
            target.copy_(
                distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
            )
        else:
            target.copy_(full.to(target.device))


@dataclass
class _Legacy:
    """One old tensor loaded in place of the new ones taken from it (a Llama's gate and up share one)."""

    container: dict[str, Any]
    old_key: str
    targets: list[tuple[str, Any, Callable[[torch.Tensor], torch.Tensor]]] = field(default_factory=list)


def legacy_source(key: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """The older key `key` is found under in a checkpoint, and how to take it from there (LEGACY_SOURCES)."""
    return next((found for source in LEGACY_SOURCES if (found := source(key)) is not None), None)


def _placeholder(saved: Any, target: Any) -> Any:
    """What DCP loads the old tensor into: the target's layout (mesh, placements, device) at the saved size."""
    if not (isinstance(saved, TensorStorageMetadata) and isinstance(target, torch.Tensor)):
        return target  # a non-tensor value: loaded as saved, taken as it is
    size, dtype = tuple(saved.size), saved.properties.dtype
    if isinstance(target, DTensor):
        return dtensor_empty(size, dtype=dtype, device_mesh=target.device_mesh, placements=target.placements)
    return torch.empty(size, dtype=dtype, device=target.device)


def _convert(legacy: _Legacy) -> None:
    """Fill the new tensors from the loaded old one (gathered whole on its mesh first: every rank of the mesh
    converts the same tensors in the same order) and put them back in the state under their own keys."""
    loaded = legacy.container.pop(legacy.old_key)
    whole = loaded.full_tensor() if isinstance(loaded, DTensor) else loaded
    for key, target, take in legacy.targets:
        if not isinstance(whole, torch.Tensor):  # a non-tensor value: shared as saved
            legacy.container[key] = whole
            continue
        part = take(whole).to(device=target.device, dtype=target.dtype)
        with torch.no_grad():
            if isinstance(target, DTensor):
                target.copy_(distribute_tensor(part, target.device_mesh, target.placements, src_data_rank=None))
            else:
                target.copy_(part)
        legacy.container[key] = target


class SameChunkPlanner(DefaultLoadPlanner):
    """DCP's default load planner with a shortcut for a plain tensor saved whole, as one chunk of its own size (a
    resume of a replicated or one-process layout): its one read request is made here, without DCP's search for
    the overlaps of every saved chunk with the local one, which gives the same request (`test_reshard.py` compares
    the plans) at a tenth of a 92M-parameter model's resume. Every other value, and every check, goes DCP's way."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner gives the metadata first"
        saved = self.metadata.state_dict_metadata
        if self.flatten_state_dict and (missing := saved.keys() - self.state_dict.keys()):
            _version._derived_version = "2_3"  # DCP's test for a checkpoint written by torch 2.3 or before
            try:
                old_keys = flatten_state_dict(self.original_state_dict)[0].keys()
            finally:
                _version._derived_version = None
            if old_keys & missing:
                return super().create_local_plan()
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            item = _whole_chunk_read(fqn, saved.get(fqn), obj)
            items += (
                [item]
                if item is not None
                else create_default_local_load_plan({fqn: obj}, self.metadata, not self.allow_partial_load).items
            )
        return LoadPlan(items)


def _whole_chunk_read(fqn: str, saved: Any, obj: Any) -> ReadItem | None:
    """The request that reads a plain tensor from the one saved chunk that is all of it; None for anything else."""
    if type(obj) is not torch.Tensor or not isinstance(saved, TensorStorageMetadata) or len(saved.chunks) != 1:
        return None
    chunk = saved.chunks[0]
    if saved.size != obj.size() or chunk.sizes != obj.size() or any(chunk.offsets):
        return None
    zeros = torch.Size([0] * obj.dim())
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, zeros, 0),
        dest_offsets=zeros,
        storage_index=MetadataIndex(fqn, chunk.offsets, 0),
        storage_offsets=zeros,
        lengths=obj.size(),
    )


def files_read(state: dict[str, Any], metadata: Metadata) -> set[str]:
    """The checkpoint's files a `dcp.load` of `state` on this rank reads (DCP's own load plan for it)."""
    planner = SameChunkPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def load_state(
    state: dict[str, Any],
    checkpoint_id: str,
    process_group: dist.ProcessGroup | None,
    no_dist: bool = False,
    before_read: Callable[[set[str]], None] | None = None,
    verify: bool = True,
) -> None:
    """`dcp.load` into `state` in place, tolerating a different number of (padding) rows per tensor.
    `before_read` is given the files this rank will read, first (a node-local tier fetches the missing ones).
    `verify` checks each record's CRC32C as it is read (`reader.py`): a damaged record fails the load with a
    `CorruptCheckpoint` (in DCP's `CheckpointException`, which gathers every rank's)."""
    reader = FastReader(checkpoint_id, verify=verify)  # named: DCP would otherwise import fsspec to probe (0.6 s)
    metadata = reader.read_metadata()  # restricted (`integrity.read_metadata`): never DCP's pickle.load
    saved_meta = metadata.state_dict_metadata
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    legacy: dict[tuple[int, str], _Legacy] = {}
    for fqn, container, key in list(_leaves(state)):
        saved = saved_meta.get(fqn)
        source = legacy_source(key) if saved is None else None
        old_saved = saved_meta.get(fqn[: len(fqn) - len(key)] + source[0]) if source else None
        if source and old_saved is not None:
            old_key, take = source
            entry = legacy.setdefault((id(container), old_key), _Legacy(container, old_key))
            if not entry.targets:
                container[old_key] = _placeholder(old_saved, container[key])
            entry.targets.append((key, container.pop(key), take))
        elif _rows_differ(saved, container[key]):
            swapped.append((container, key, container[key]))
            container[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    if before_read is not None:
        before_read(files_read(state, metadata))
    try:
        dcp.load(state, storage_reader=reader, planner=SameChunkPlanner(), process_group=process_group, no_dist=no_dist)
    except CheckpointException as err:  # every rank's errors, gathered: a crafted record is said as itself
        unsafe = [exc for exc, _ in err.failures.values() if isinstance(exc, UnsafeCheckpoint)]
        if unsafe:
            raise unsafe[0] from err
        raise
    for container, key, target in swapped:
        _copy_rows(target, container[key])
        container[key] = target
    for entry in legacy.values():
        _convert(entry)
