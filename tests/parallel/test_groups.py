"""Process groups beyond the mesh are made in O(1) calls: on GPUs each `new_group` is a world-wide communicator
split that every rank joins, so a group per (DP, TP) coordinate was 512 splits in a row for 175B. The mesh
itself holds only the dims > 1 (issue 45): each mesh dim is such a split too, size 1 or not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from hpctrain import schedules
from hpctrain.config.layout import Layout, resolve_layout
from hpctrain.parallel import groups
from hpctrain.parallel.dims import ParallelDims, ParallelDimsError
from hpctrain.simulate.world import fake_world, groups_held


@pytest.fixture
def world_175b(compose_cfg) -> Any:
    """Rank 3 of the 175B job's 4,096 ranks on a fake process group (no peers), and the job's rank grid."""
    layout = resolve_layout(compose_cfg("+experiment=175b"))
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4096)
    try:
        grid = torch.arange(4096).reshape(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
        last = next(
            r
            for r in range(layout.pp)
            if layout.pp * layout.virtual_stages - 1
            in schedules.get(layout.schedule).stage_ids(r, layout.pp, layout.virtual_stages)
        )
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
    assert sorted(r for pair in pairs for r in pair) == sorted(
        grid[0].flatten().tolist() + grid[last].flatten().tolist()
    )

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


# ---- the mesh: only dims > 1 make groups (issue 45) -----------------------------------------------------------


@contextlib.contextmanager
def _counting_mesh_groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts, while the block runs: "splits", the mesh dims and flattenings that made a group (one world-wide
    `split_group` each on a device-bound NCCL world; one spanning the world takes the default group), and
    "calls", the new_group / split_group calls (on a world without a bound device, as this one, one new_group
    per subgroup, each a call every rank makes)."""
    import torch.distributed.device_mesh as device_mesh

    counts = {"splits": 0, "calls": 0}

    def counted(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts["calls"] += 1
            return original(*args, **kwargs)

        return call

    for module in (dist, device_mesh):  # the mesh calls them through its own module's names
        for name in ("new_group", "split_group"):
            monkeypatch.setattr(module, name, counted(getattr(module, name)))
    one = DeviceMesh._init_one_process_group

    def made(*args: Any, **kwargs: Any) -> Any:
        name = one(*args, **kwargs)
        counts["splits"] += name != dist.distributed_c10d._get_default_group().group_name
        return name

    monkeypatch.setattr(DeviceMesh, "_init_one_process_group", staticmethod(made))
    yield counts


@pytest.mark.parametrize(
    "experiment, before, after",
    [
        # PP 8 x DP 64 x TP 8 on 4,096 ranks: dp_replicate (1) and the DP flattening (dp_replicate x dp_shard) gone
        ("175b", (5, 5248, 6), (3, 1088, 4)),
        ("llama3_8b_4node", (5, 84, 6), (2, 18, 3)),  # DP 16 x TP 2 on 32 ranks: pp and dp_replicate gone too
    ],
)
def test_a_layout_with_size_1_dims_makes_fewer_groups(
    experiment: str, before: tuple, after: tuple, compose_cfg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(splits, calls, groups held) of rank 3's mesh and the slices the engine reads, against a mesh of every dim
    as ParallelDims built it before (size-1 dims too, cp only when > 1, and the DP dims flattened)."""
    layout = resolve_layout(compose_cfg(f"+experiment={experiment}"))
    with monkeypatch.context() as patch, _counting_mesh_groups(patch) as counts:
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=layout.world_size)
        try:
            names = ("pp", "dp_replicate", "dp_shard", "tp")
            mesh = init_device_mesh("cpu", tuple(getattr(layout, n) for n in names), mesh_dim_names=names)
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            assert (counts["splits"], counts["calls"], groups_held()) == before
        finally:
            dist.destroy_process_group()
    with monkeypatch.context() as patch, _counting_mesh_groups(patch) as counts, fake_world(layout, 3) as dims:
        for name in ("grad_mesh", "fsdp_mesh"):  # fake_world builds the rest
            getattr(dims, name)
        assert dims.mesh.mesh_dim_names == tuple(n for n in names if getattr(layout, n) > 1)
        assert (counts["splits"], counts["calls"], groups_held()) == after
        assert dims.fsdp_mesh == dims.dp_mesh == dims.grad_mesh == dims.mesh["dp_shard"]  # one group, not three


def test_size_1_dims_are_left_out_but_fsdp2_shard_dims_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    """EP 2 over a shard group of 2 (dp_shard_mod_ep 1) on 2 ranks: pp, dp_replicate and tp (1 each) are not in the
    mesh; FSDP2's shard dims stay at any size (the expert mesh is this rank alone), and dp_shard, their flattening
    over the whole world, is the default group. A left-out dim's mesh is an error that says why."""
    layout = Layout(dp=2, tp=1, pp=1, ep=2)
    with monkeypatch.context() as patch, _counting_mesh_groups(patch) as counts, fake_world(layout, 1) as dims:
        assert dims.mesh.mesh_dim_names == ("dp_shard_mod_ep", "ep")
        assert (dims.pp_rank, dims.dp_rank, dims.tp_rank, dims.cp_rank, dims.coordinate("ep")) == (0, 1, 0, 0, 1)
        experts = dims.expert_fsdp_mesh
        assert (experts.shape, experts.mesh.tolist(), dims.coordinate("dp_shard_mod_ep")) == ((1,), [1], 0)
        assert dist.get_process_group_ranks(experts.get_group()) == [1]
        assert dims.fsdp_mesh.get_group() == dist.group.WORLD and dims.ep_mesh.mesh.tolist() == [0, 1]
        for name in ("tp_mesh", "pp_mesh", "cp_mesh"):
            with pytest.raises(ParallelDimsError, match="has one rank in this layout"):
                getattr(dims, name)
        assert (counts["splits"], groups_held()) == (1, 2)  # dp_shard_mod_ep's; ep spans the world (the default)


def test_hsdp_over_one_rank_shards_keeps_its_2d_mesh() -> None:
    """dp_replicate = dp: FSDP2's mesh is still (replicate 4, shard 1), its shard group this rank alone."""
    with fake_world(Layout(dp=4, tp=1, pp=1, dp_replicate=4, zero_stage=3), 2) as dims:
        mesh = dims.fsdp_mesh
        assert (mesh.mesh_dim_names, mesh.shape, mesh.mesh.tolist()) == (
            ("dp_replicate", "dp_shard"),
            (4, 1),
            [[0], [1], [2], [3]],
        )
        assert [dist.get_process_group_ranks(g) for g in mesh.get_all_groups()] == [[0, 1, 2, 3], [2]]
        assert mesh.get_coordinate() == (2, 0) and dims.dp_rank == 2


@pytest.mark.parametrize("rank", range(8))
def test_ranks_keep_their_place_without_size_1_dims(rank: int) -> None:
    """DP 2 x CP 2 x TP 2 (pp, dp_replicate 1): TP innermost, then CP, then DP; FSDP over dp_shard x cp."""
    with fake_world(Layout(dp=2, tp=2, pp=1, cp=2), rank) as dims:
        dp, cp, tp = rank // 4, rank // 2 % 2, rank % 2
        assert (dims.pp_rank, dims.dp_rank, dims.cp_rank, dims.tp_rank) == (0, dp, cp, tp)
        assert dims.rank_grid == [[[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]]
        assert dims.fsdp_mesh.mesh.tolist() == dims.grad_mesh.mesh.tolist() == [tp, 2 + tp, 4 + tp, 6 + tp]
        assert dims.cp_mesh.mesh.tolist() == [4 * dp + tp, 4 * dp + 2 + tp]


def test_a_world_of_one_makes_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch, _counting_mesh_groups(patch) as counts:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        try:
            dims = ParallelDims(Layout(dp=1, tp=1, pp=1), 1)
            assert dims.mesh.mesh_dim_names == ("dp_shard",) and dims.rank_grid == [[[[[0]]]]]
            assert (dims.dp_rank, dims.pp_rank, dims.tp_rank, dims.cp_rank) == (0, 0, 0, 0)
            assert dims.fsdp_mesh.size() == dims.dp_mesh.size() == 1
            assert (counts["calls"], groups_held()) == (0, 1)
        finally:
            dist.destroy_process_group()
