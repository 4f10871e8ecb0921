"""Process groups beyond the mesh are made in O(1) calls: on GPUs each `new_group` is a world-wide communicator
split that every rank joins, so a group per (DP, TP) coordinate was 512 splits in a row for 175B."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hpctrain import schedules
from hpctrain.config.layout import resolve_layout
from hpctrain.parallel import groups


@pytest.fixture
def world_175b(compose_cfg) -> Any:
    """Rank 3 of the 175B job's 4,096 ranks on a fake process group (no peers), and the job's rank grid."""
    layout = resolve_layout(compose_cfg("+experiment=175b"))
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4096)
    try:
        grid = torch.arange(4096).reshape(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
        last = next(r for r in range(layout.pp) if layout.pp * layout.virtual_stages - 1 in
                    schedules.get(layout.schedule).stage_ids(r, layout.pp, layout.virtual_stages))
        yield grid, last
    finally:
        dist.destroy_process_group()


def _count(monkeypatch: pytest.MonkeyPatch, name: str, result: Any = None) -> list[tuple]:
    calls: list[tuple] = []
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return result if result is not None else original(*args, **kwargs)
    monkeypatch.setattr(dist, name, counted)
    return calls


def test_175b_tied_embedding_groups_take_one_call(world_175b, monkeypatch: pytest.MonkeyPatch) -> None:
    grid, last = world_175b
    pairs = groups.tied_embedding_pairs(grid.tolist(), last)
    assert len(pairs) == 512 and pairs[3] == [3, 7 * 512 + 3]  # one pair per (DP, TP) coordinate
    assert sorted(r for pair in pairs for r in pair) == sorted(grid[0].flatten().tolist() + grid[last].flatten().tolist())

    new, split = _count(monkeypatch, "new_group"), _count(monkeypatch, "split_group", result="split")
    group = groups.own_group(pairs)  # gloo (no bound device): the members alone make their group
    assert len(new) == 1 and not split and new[0][0][0] == [3, 3587] and new[0][1]["use_local_synchronization"]
    assert dist.get_process_group_ranks(group) == [3, 3587]

    monkeypatch.setattr(groups, "splits_in_one_call", lambda: True)  # NCCL with a bound device: one split
    assert groups.own_group(pairs) == "split"
    assert len(split) == 1 and split[0][1]["split_ranks"] == pairs and len(new) == 1


def test_a_rank_outside_every_pair_makes_no_group(world_175b, monkeypatch: pytest.MonkeyPatch) -> None:
    grid, last = world_175b
    new = _count(monkeypatch, "new_group")
    assert groups.own_group([[0, 1], [8, 9]]) is None and not new  # rank 3 in neither
