"""Which nodes train and which wait as hot spares (issue 48, D6): the nodes holding this run's node-local
checkpoints train first, and every agent reaches the same roles through the rendezvous store. The decision is
a pure function; the holdings are read from real checkpoint directories (written by the manifest code, and by a
real training run); the exchange runs in real processes against a real TCP store on loopback."""

from __future__ import annotations

import multiprocessing as mp
import time
import types
from pathlib import Path
from typing import Any

import pytest

from hpctrain.checkpoint import integrity
from hpctrain.checkpoint.storage import step_dir, write_manifest
from hpctrain.distributed import roles, spares
from hpctrain.distributed.elastic import NodeAgent, _host_store
from hpctrain.distributed.roles import Held, choose_trainers, held_here, slot_of

META = integrity.METADATA


def held(step: int, *files: str, total: int = 3, tier: int = 0, version: str = "v") -> Held:
    return Held(step, tier, version, total, frozenset(files))


def test_a_job_that_holds_nothing_trains_on_its_first_nodes() -> None:
    assert choose_trainers([[], [], []], 2) == (0, 1)
    assert [slot_of((0, 1), n) for n in range(3)] == [0, 1, None]


def test_the_node_holding_the_only_copy_trains_instead_of_waiting_as_the_spare() -> None:
    """D6: the last node by index holds the whole newest RAM checkpoint (its shard and its peer's copy); by index
    it would be the spare and the checkpoint skipped. It trains, with the first node by index."""
    trainers = choose_trainers([[], [], [held(30, "__0_0.distcp", "__1_0.distcp", META)]], 2)
    assert trainers == (0, 2)
    assert [slot_of(trainers, n) for n in range(3)] == [0, None, 1]


def test_the_nodes_chosen_together_complete_the_newest_checkpoint() -> None:
    """More holders than training nodes: node 1 repeats node 0's files, node 2 has the one file neither holds.
    Taking the holders with the most files (0 and 1) would leave the checkpoint incomplete."""
    a, b, c = "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"
    nodes = [[held(8, a, META, total=4)], [held(8, a, META, total=4)], [held(8, c, b, total=4)], []]
    assert choose_trainers(nodes, 2) == (0, 2)
    assert choose_trainers(nodes, 3) == (0, 1, 2)  # the redundant holder next, before a node holding nothing


def test_the_newest_checkpoint_that_the_job_can_complete_decides() -> None:
    whole_10 = held(10, "a", "b", META)
    part_20 = held(20, "a", META, version="w")  # "b" of step 20 is on no node of this job
    assert choose_trainers([[], [whole_10], [held(20, "a", "b", META, version="w")]], 1) == (2,)  # newest first
    assert choose_trainers([[], [whole_10], [part_20]], 1) == (1,)  # step 20 cannot be resumed: step 10 can
    # Two saves of step 20 (a restart redid it): their files are not one checkpoint's.
    other = held(20, "b", META, version="x")
    assert choose_trainers([[], [whole_10], [part_20], [other]], 1) == (1,)


def test_an_older_shared_checkpoint_never_outranks_a_newer_node_local_one_and_ties_go_to_the_lower_index() -> None:
    """Every node holding the same step (a tier on shared storage gives every node the same view) changes
    nothing: the order by index. Between equal holdings, the lower index trains."""
    same = held(40, "a", "b", META, tier=1)
    assert choose_trainers([[same], [same], [same]], 2) == (0, 1)
    newer = held(50, "a", "b", META, tier=0, version="n")
    assert choose_trainers([[same], [same], [same, newer]], 2) == (0, 2)
    assert choose_trainers([[], [newer], [newer]], 1) == (1,)


def test_holdings_travel_through_the_store_as_text() -> None:
    items = [held(8, "__3_0.distcp", META, total=9, tier=1, version="abc")]
    assert roles.decode(roles.encode(items)) == items
    assert roles.decode("not json") == [] and roles.decode('[["x"]]') == []


# ---------------------------------------------------------------- holdings from real checkpoint directories
def _checkpoint(
    tier: Path, step: int, files: dict[str, int], held: set[str], run_id: str, shared: bool, save: str = "0"
) -> None:
    """A committed checkpoint as a node-local tier leaves it on one node: the manifest names every file of the
    checkpoint (with its sum: `save` tells two saves of one step apart), and its own time, as each node's leader
    writes it; the node holds some of the files (its own, its peer's copy)."""
    directory = step_dir(tier, step)
    directory.mkdir(parents=True)
    for name in held:
        (directory / name).write_bytes(b"x" * files[name])
    sums = {name: save for name in files}
    manifest = {
        "step": step,
        "run_id": run_id,
        "shared": shared,
        "time": time.time(),
        "files": files,
        integrity.ALGORITHM: sums,
    }
    write_manifest(directory, manifest)


def _task(root: Path, node: int, run_id: str = "r1") -> Any:
    """The task as an agent sees it: the tiers of the run's config; each node's RAM is a directory of its own."""
    config = {
        "run": {"id": run_id},
        "checkpoint": {
            "enabled": True,
            "tiers": [
                {"name": "ram", "path": str(root / "shm" / f"node{node}")},
                {"name": "shared", "path": "checkpoints"},
            ],
        },
    }
    return types.SimpleNamespace(config=config, run_dir=str(root / "run"))


FILES = {"__0_0.distcp": 10, "__1_0.distcp": 10, META: 4}


def test_a_node_lists_the_committed_node_local_checkpoints_of_its_run_and_the_files_it_holds_whole(
    tmp_path: Path,
) -> None:
    ram = tmp_path / "shm" / "node1" / "r1"
    _checkpoint(ram, 8, FILES, {"__1_0.distcp", "__0_0.distcp", META}, "r1", shared=False)
    _checkpoint(ram, 4, FILES, {"__1_0.distcp", META}, "r1", shared=False)
    (step_dir(ram, 4) / "__0_0.distcp").write_bytes(b"torn")  # a copy cut short: not held
    step_dir(ram, 12).with_name("step_00000012.partial").mkdir()  # a save cut short: not committed
    _checkpoint(tmp_path / "run" / "checkpoints", 8, FILES, set(FILES), "r1", shared=True)  # shared storage
    found = held_here(_task(tmp_path, 1).config, tmp_path / "run")
    assert sorted((h.step, h.tier, h.total, sorted(h.files)) for h in found) == [
        (4, 0, 3, [META, "__1_0.distcp"]),
        (8, 0, 3, [META, "__0_0.distcp", "__1_0.distcp"]),
    ]
    # One save, held in part by two nodes whose manifests differ in their time: one checkpoint. A save of the
    # same step redone (other sums) is another.
    _checkpoint(tmp_path / "shm" / "node2" / "r1", 8, FILES, {"__1_0.distcp"}, "r1", shared=False)
    _checkpoint(tmp_path / "shm" / "node3" / "r1", 8, FILES, {"__1_0.distcp"}, "r1", shared=False, save="1")
    (other,), (redone,) = (held_here(_task(tmp_path, n).config, tmp_path / "run") for n in (2, 3))
    assert other.version == found[1].version != redone.version
    assert held_here(_task(tmp_path, 0).config, tmp_path / "run") == []  # this node's RAM holds nothing of it
    assert held_here(_task(tmp_path, 1, run_id="r2").config, tmp_path / "run") == []  # another run's directory


def test_a_checkpoint_of_a_shared_tier_or_of_another_run_gives_no_node_a_claim(tmp_path: Path) -> None:
    ram = tmp_path / "shm" / "node0" / "r1"
    _checkpoint(ram, 8, FILES, set(FILES), "r1", shared=True)  # an absolute tier that was shared when written
    _checkpoint(ram, 9, FILES, set(FILES), "other", shared=False)  # copied from another run: the resume refuses it
    assert held_here(_task(tmp_path, 0).config, tmp_path / "run") == []
    disabled = _task(tmp_path, 0).config | {"checkpoint": {"enabled": False, "tiers": []}}
    assert held_here(disabled, tmp_path / "run") == []


# ---------------------------------------------------------------- the exchange: real processes, a real store
def _agent_main(root: str, node: int, job: str, delay: float, wait_s: float, out: Any, done: Any) -> None:
    """One node's agent: the store's host opens the store as `run_agent` does (and keeps it, as its agent would,
    until the test is done); every agent connects and takes its role through the store, as `_launch` does in the
    job's first launch."""
    agent = NodeAgent(job, node, nodes=2, workers=1, hosts=("127.0.0.1",) * 4, max_restarts=0, join_timeout_s=30)
    server = _host_store(agent) if node == agent.store_node else None
    time.sleep(delay)
    store = spares.connect(agent.store_host, agent.port, agent.join_timeout_s)
    started = time.monotonic()
    slot = roles.slot_by_holdings(store, agent, _task(Path(root), node), wait_s=wait_s)
    out.put((node, slot, time.monotonic() - started))
    if server is not None:
        done.wait(30)


def _run_agents(root: Path, delays: dict[int, float], wait_s: float) -> dict[int, tuple[int | None, float]]:
    """Each node's (slot, seconds its decision took), the agents in processes of their own."""
    job = f"roles-{time.time_ns() % 10**9}"
    ctx = mp.get_context("fork")
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_agent_main, args=(str(root), n, job, d, wait_s, out, done)) for n, d in delays.items()]
    for proc in procs:
        proc.start()
    try:
        results = {node: (slot, took) for node, slot, took in (out.get(timeout=40) for _ in procs)}
    finally:
        done.set()
        for proc in procs:
            proc.join(timeout=10)
    assert all(proc.exitcode == 0 for proc in procs)
    return results


@pytest.mark.slow  # agents in processes of their own, one waiting out a node that never comes
@pytest.mark.timeout(60)
def test_every_agent_reaches_the_same_roles_through_the_store_and_a_silent_node_holds_nothing(tmp_path: Path) -> None:
    """A job of 4 nodes, 2 train. Node 3 holds the whole newest RAM checkpoint, node 2 part of it; node 1 posts
    nothing in time (it starts after the decision). The store's host decides once its wait is over, from the
    nodes that posted: 2 and 3 train, 0 and 1 wait, on every node alike, the late one too."""
    _checkpoint(tmp_path / "shm" / "node3" / "r1", 8, FILES, set(FILES), "r1", shared=False)
    _checkpoint(tmp_path / "shm" / "node2" / "r1", 8, FILES, {"__1_0.distcp", META}, "r1", shared=False)
    wait_s = 2.0
    results = _run_agents(tmp_path, {0: 0.0, 2: 0.2, 3: 0.4, 1: 2 * wait_s + 1.0}, wait_s)
    assert {node: slot for node, (slot, _) in results.items()} == {0: None, 1: None, 2: 0, 3: 1}
    assert wait_s - 0.5 < results[0][1] < wait_s + 8  # the store's host waited out the silent node, not for it
    assert results[1][1] < wait_s  # the late node found the decision made


@pytest.mark.timeout(60)
def test_with_every_node_posting_the_decision_comes_at_once(tmp_path: Path) -> None:
    """The usual start: all nodes post, the store's host decides as the last one posts (not at the end of its
    30 s bound); a job holding nothing trains on its first two nodes."""
    results = _run_agents(tmp_path, dict.fromkeys(range(4), 0.0), 30.0)
    assert {node: slot for node, (slot, _) in results.items()} == {0: 0, 1: 1, 2: None, 3: None}
    assert max(took for _, took in results.values()) < 5.0


@pytest.mark.slow  # agents in processes of their own, waiting out a store host that does not decide
@pytest.mark.timeout(60)
def test_when_the_store_host_decides_late_the_order_by_index_stands_on_every_node(tmp_path: Path) -> None:
    """The store's host opened the store but comes to the exchange late (twice the others' bound): the others
    propose the order by index with a compare-and-set, and the host, whose own choice would differ (nodes 2 and 3
    hold the checkpoint: it would wait as a spare), takes theirs. Whichever decision came first, every node has
    the same."""
    for node in (2, 3):
        _checkpoint(tmp_path / "shm" / f"node{node}" / "r1", 8, FILES, set(FILES), "r1", shared=False)
    wait_s = 1.0
    results = _run_agents(tmp_path, {1: 0.0, 2: 0.0, 3: 0.0, 0: 2 * wait_s + 1.5}, wait_s)
    assert {node: slot for node, (slot, _) in results.items()} == {0: 0, 1: 1, 2: None, 3: None}
    assert all(2 * wait_s - 0.5 < results[n][1] < 2 * wait_s + 8 for n in (1, 2, 3))  # (bounds loose: 2 busy cores)


@pytest.mark.slow  # a real training run on gloo ranks
@pytest.mark.timeout(300)
def test_the_holdings_of_a_real_ram_tier_put_the_node_with_the_checkpoint_to_work(compose_cfg, tmp_path: Path) -> None:
    """Two simulated nodes train with a node-local RAM tier (each node's files copied to the other). In a job
    of three nodes after it, two training, with the second old node last by index and the first gone: its RAM
    holds the whole checkpoint (its own files and its peer's copy), so it trains and the spare is node 1."""
    from tests.checkpoint.test_checkpoint import config
    from tests.checkpoint.training import train

    tiers = (
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_steps: 2, keep_last: 2}},"
        f"{{name: shared, path: checkpoints, interval_steps: 100, keep_last: 1}}]"
    )
    cfg = config(compose_cfg, tmp_path, 2, "train.max_steps=4", "checkpoint.save_final=false", tiers)
    train(2, cfg, tmp_path / "run", node_local=["ram"])

    def on_node(node: int) -> list[Held]:
        here = cfg | {"checkpoint": cfg["checkpoint"] | {"tiers": [dict(t) for t in cfg["checkpoint"]["tiers"]]}}
        here["checkpoint"]["tiers"][0]["path"] = f"{tmp_path}/shm/node{node}"
        return held_here(here, tmp_path / "run")

    old = [on_node(n) for n in range(2)]
    assert [sorted(h.step for h in items) for items in old] == [[2, 4], [2, 4]]
    newest = [max(items, key=lambda h: h.step) for items in old]
    assert newest[0].version == newest[1].version and all(len(h.files) == h.total for h in newest)
    assert {f"__{r}_0.distcp" for r in range(2)} | {META} <= newest[1].files
    trainers = choose_trainers([[], [], old[1]], 2)  # new nodes 0 and 1 hold nothing; old node 1 is last
    assert trainers == (0, 2) and slot_of(trainers, 1) is None
