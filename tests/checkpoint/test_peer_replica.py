"""Node-local tiers outlive a node: each node's files are copied to the next node, and a resume fetches what
a node lacks from its peers. Real gloo ranks, each simulated node with a RAM directory of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.peers import (
    Nodes,
    Transfer,
    fetch_transfers,
    group_by_view,
    missing_from,
    replica_transfers,
    run_transfers,
)
from hpctrain.checkpoint.storage import Committed, verify
from tests.checkpoint.test_checkpoint import config, model_weights, steps_in
from tests.checkpoint.training import consumed_samples, losses_by_step, train
from tests.distributed_harness import DistributedTestError, run_distributed


def resumes(run_dir: Path) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == "resume"]


def test_the_ring_sends_each_ranks_files_to_the_next_node_and_metadata_everywhere() -> None:
    nodes = group_by_view([[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]])
    assert nodes.groups == ((0, 1), (2, 3), (4, 5)) and not nodes.shared and nodes.leader(3) == 2
    files = [{"__0_0.distcp": 5, ".metadata": 2}, {"__1_0.distcp": 6}, {"__2_0.distcp": 7}, {}, {}, {"__5_0.distcp": 8}]
    assert replica_transfers(files, nodes) == [
        Transfer(0, 2, ".metadata", 2),
        Transfer(0, 4, ".metadata", 2),
        Transfer(0, 2, "__0_0.distcp", 5),
        Transfer(1, 3, "__1_0.distcp", 6),
        Transfer(2, 4, "__2_0.distcp", 7),
        Transfer(5, 1, "__5_0.distcp", 8),
    ]


def test_a_node_fetches_only_what_it_reads_and_lacks_from_the_nearest_holder() -> None:
    nodes = Nodes(((0,), (1,), (2,)))
    required = {"a": 1, "b": 2, "c": 3}
    held = [{"a": 1, "c": 3}, {"b": 2, "a": 1}, {}]  # node 2 is a fresh spare
    assert missing_from(required, held) == []
    assert fetch_transfers(required, held, [{"a"}, {"a", "c"}, {"b", "c"}], nodes) == [
        Transfer(0, 1, "c", 3),
        Transfer(1, 2, "b", 2),
        Transfer(0, 2, "c", 3),
    ]
    assert missing_from(required, [{"a": 1}, {"b": 1}, {}]) == ["b", "c"]  # a torn copy does not count


def _move_in_pieces(rank: int, world: int, root: str) -> dict[str, bytes]:
    here = Path(root) / f"node{rank}"
    transfers = [
        Transfer(0, 1, "a", 23),
        Transfer(0, 2, "a", 23),
        Transfer(1, 2, "b", 7),
        Transfer(2, 0, "c", 0),
        Transfer(2, 1, "d", 5),
    ]
    received = run_transfers(transfers, rank, here, here, None, piece_bytes=4)  # 6 pieces for "a"
    assert received == sum(t.size for t in transfers if t.dst == rank)
    assert not list(here.glob(".*.incoming"))
    return {p.name: p.read_bytes() for p in sorted(here.iterdir())}


def test_files_move_between_nodes_in_pieces_whatever_their_sizes(tmp_path: Path) -> None:
    """Real gloo ranks: files of 23, 7, 5 and 0 bytes move in 4-byte pieces, from several senders to several
    receivers at once, and land whole and byte-exact (a shard is GBs: no rank holds one whole in memory)."""
    data = {"a": bytes(range(23)), "b": b"seven!!", "c": b"", "d": b"fifth"}
    owners = {"a": 0, "b": 1, "c": 2, "d": 2}
    for name, rank in owners.items():
        (tmp_path / f"node{rank}").mkdir(exist_ok=True)
        (tmp_path / f"node{rank}" / name).write_bytes(data[name])
    held = run_distributed(_move_in_pieces, 3, str(tmp_path), timeout=120)
    assert held == [
        {"a": data["a"], "c": b""},
        {"a": data["a"], "b": data["b"], "d": data["d"]},
        {"a": data["a"], "b": data["b"], "c": b"", "d": data["d"]},
    ]


@pytest.mark.timeout(400)
def test_a_lost_nodes_ram_comes_from_its_peer_and_the_run_continues_exactly(compose_cfg, tmp_path: Path) -> None:
    def cfg_for(root: Path, world: int, steps: int = 12, *extra: str) -> dict:
        tiers = (
            f"checkpoint.tiers=[{{name: ram, path: {root}/shm, interval_steps: 4, keep_last: 2}},"
            f"{{name: shared, path: checkpoints, interval_steps: 100, keep_last: 1}}]"
        )
        return config(
            compose_cfg,
            root,
            world,
            f"train.max_steps={steps}",
            "train.global_batch=12",
            "train.micro_batch=1",
            tiers,
            *extra,
        )

    local = {"node_local": ["ram"]}  # one rank per simulated node: 4 nodes
    straight = tmp_path / "a" / "run"
    train(4, cfg_for(tmp_path / "a", 4), straight, **local)
    stopped = tmp_path / "b" / "run"
    with pytest.raises(DistributedTestError, match="died"):  # rank 1 dies in step 12's save: RAM holds 4 and 8
        train(4, cfg_for(tmp_path / "b", 4), stopped, timeout=120, kill_rank_in_save=1, kill_step=12, **local)
    ram = [tmp_path / "b" / "shm" / f"node{n}" / "test" / "step_00000008" for n in range(4)]
    for n, step_dir in enumerate(ram):  # its own shard file, its predecessor's, and DCP's metadata
        names = {p.name for p in step_dir.iterdir()}
        assert {f"__{n}_0.distcp", f"__{(n - 1) % 4}_0.distcp", ".metadata", "manifest.json"} <= names, names
        assert not any(name.startswith(f"__{(n + 1) % 4}_") for name in names)  # no full copies
    manifest = json.loads((ram[0] / "manifest.json").read_text())
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(manifest["files"])
    assert verify(Committed("ram", 8, ram[0], manifest)) == []  # a node's copy checks what it holds
    shutil.copytree(tmp_path / "b", tmp_path / "c")

    shutil.rmtree(ram[2].parent)  # node 2 dies; a spare with empty RAM takes its place
    train(4, cfg_for(tmp_path / "b", 4), stopped, **local)
    resumed = resumes(stopped)
    assert resumed[-1]["tier"] == "ram" and resumed[-1]["step"] == 8 and resumed[-1]["fetched_bytes"] > 0, resumed
    a, b = losses_by_step(straight), losses_by_step(stopped)
    assert list(b) == list(range(1, 13)) and all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a]
    wa, wb = (model_weights(r / "checkpoints" / "step_00000012") for r in (straight, stopped))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert consumed_samples(stopped) == list(range(12 * 12))
    assert (ram[2] / "manifest.json").exists()  # the spare now holds a committed copy of what it read

    shrunk = tmp_path / "c" / "run"  # the same failure, node 3 dies, no spare: 3 nodes go on, DP 4 -> 3
    shutil.rmtree(tmp_path / "c" / "shm" / "node3")
    train(3, cfg_for(tmp_path / "c", 3), shrunk, **local)
    resumed = resumes(shrunk)
    assert resumed[-1]["tier"] == "ram" and resumed[-1]["step"] == 8, resumed
    assert list(losses_by_step(shrunk)) == list(range(1, 13))
    assert consumed_samples(shrunk) == list(range(12 * 12))


@pytest.mark.timeout(200)
def test_two_neighbours_lost_make_the_tier_unusable_and_the_resume_says_why(compose_cfg, tmp_path: Path, capfd) -> None:
    tiers = (
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_steps: 2, keep_last: 1}},"
        f"{{name: shared, path: checkpoints, interval_steps: 3, keep_last: 1}}]"
    )
    cfg = config(
        compose_cfg, tmp_path, 4, "train.max_steps=4", "checkpoint.save_final=false", "train.micro_batch=1", tiers
    )
    run_dir = tmp_path / "run"
    train(4, cfg, run_dir, node_local=["ram"])
    for n in (1, 2):
        shutil.rmtree(tmp_path / "shm" / f"node{n}")
    capfd.readouterr()
    cfg = config(
        compose_cfg, tmp_path, 4, "train.max_steps=5", "checkpoint.save_final=false", "train.micro_batch=1", tiers
    )
    train(4, cfg, run_dir, node_local=["ram"])
    logs = "".join(capfd.readouterr())
    assert "skipping tier ram step 4" in logs and "no node holds __1_0.distcp" in logs, logs[-3000:]
    assert "resumed from tier shared step 3" in logs
    assert consumed_samples(run_dir)[-8:] == list(range(4 * 8, 5 * 8))


@pytest.mark.timeout(200)
def test_a_stop_saves_where_a_job_on_other_nodes_finds_it(compose_cfg, tmp_path: Path) -> None:
    """USR2 (time limit, preemption): the requeued job may start on other nodes, whose RAM holds nothing, so
    the stop saves to the fastest shared tier, not to the node-local RAM."""
    tiers = (
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_steps: 2, keep_last: 1}},"
        f"{{name: shared, path: checkpoints, interval_steps: 100, keep_last: 1}}]"
    )
    run_dir = tmp_path / "run"
    first = train(
        2, config(compose_cfg, tmp_path, 2, "train.max_steps=6", tiers), run_dir, signal_at=2, node_local=["ram"]
    )
    assert all("preempted" in r and "step 3" in r["preempted"] for r in first), first
    assert steps_in(run_dir / "checkpoints") == [3] and steps_in(tmp_path / "shm" / "node0" / "test") == [2]
