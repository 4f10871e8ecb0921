"""`SameChunkPlanner` makes the plan DCP's default planner makes: request for request (index hints included),
on a real checkpoint's metadata, with the shortcut taken and with DCP's way for a split, resized or missing
tensor; its errors are DCP's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlanner

from hpctrain.checkpoint.reader import FastReader
from hpctrain.checkpoint.reshard import SameChunkPlanner


def _saved(tmp_path: Path) -> Metadata:
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3)},
        "optim": {"state.w.step": torch.tensor(2.0)},
        "extra": {"rank1": torch.randn(2)},
        "note": 5,
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return FastReader(str(tmp_path)).read_metadata()


def _target() -> dict[str, Any]:
    return {
        "model": {"w": torch.empty(4, 3), "b": torch.empty(3)},
        "optim": {"state.w.step": torch.tensor(0.0)},
        "note": 0,
    }


def _plan(planner: LoadPlanner, state: dict[str, Any], metadata: Metadata) -> list[tuple[Any, ...]]:
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return [
        (
            i.type,
            i.dest_index.fqn,
            i.dest_index.offset,
            i.dest_index.index,
            i.dest_offsets,
            i.storage_index.fqn,
            i.storage_index.offset,
            i.storage_index.index,
            i.storage_offsets,
            i.lengths,
        )
        for i in planner.create_local_plan().items
    ]


def test_the_shortcut_makes_dcps_plan(tmp_path: Path) -> None:
    """Whole saved tensors (and a 0-d one) by the shortcut, a byte value by DCP; a saved key this rank does not load
    (another rank's RNG) is left out alike."""
    metadata = _saved(tmp_path)
    ours = _plan(SameChunkPlanner(), _target(), metadata)
    assert ours == _plan(DefaultLoadPlanner(), _target(), metadata)
    assert len(ours) == 4


def test_a_split_or_resized_tensor_goes_dcps_way(tmp_path: Path) -> None:
    metadata = _saved(tmp_path)
    w = metadata.state_dict_metadata["model.w"]
    assert isinstance(w, TensorStorageMetadata)
    halves = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
    ]
    metadata.state_dict_metadata["model.w"] = dataclasses.replace(w, chunks=halves)  # saved by two ranks
    ours = _plan(SameChunkPlanner(), _target(), metadata)
    assert ours == _plan(DefaultLoadPlanner(), _target(), metadata)
    assert [item[1] for item in ours].count("model.w") == 2
    resized = _target()
    resized["model"]["w"] = torch.empty(5, 3)
    for planner in (SameChunkPlanner(), DefaultLoadPlanner()):
        with pytest.raises(ValueError, match="Size mismatch"):
            _plan(planner, resized, metadata)


def test_a_key_the_checkpoint_lacks_fails_as_in_dcp(tmp_path: Path) -> None:
    metadata = _saved(tmp_path)
    state = _target()
    state["model"]["new"] = torch.empty(2)
    for planner in (SameChunkPlanner(), DefaultLoadPlanner()):
        with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: model.new"):
            _plan(planner, state, metadata)
    partial = _plan(SameChunkPlanner(allow_partial_load=True), state, metadata)
    assert partial == _plan(DefaultLoadPlanner(allow_partial_load=True), state, metadata)
