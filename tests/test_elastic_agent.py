"""The elastic agent's settings and a worker's view of the job (the agents run for real in tests/e2e and
tests/slurm), and the check that stops a restart loop inside the allocation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpctrain.distributed.elastic import NodeAgent
from hpctrain.distributed.environment import discover, port_for_job
from hpctrain.records.failures import read_failures, record_failure
from hpctrain.train.loop import repeated_failure


def test_the_agents_avoid_the_documented_traps() -> None:
    """A fixed node count with a 1 s last call (else every rendezvous waits 30 s), node 0 hosts the store,
    and the rendezvous port is not the one a job without agents uses for its process group."""
    hosts = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    agent = NodeAgent(job_id="42", node=0, nodes=3, workers=8, hosts=hosts, max_restarts=3, join_timeout_s=600)
    config = agent.launch_config(3)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (3, 3, 8, 3)
    assert config.rdzv_backend == "c10d" and config.run_id == "42"
    assert config.rdzv_configs["is_host"] and config.rdzv_configs["last_call_timeout"] == 1
    assert config.rdzv_configs["join_timeout"] == 600
    assert config.rdzv_endpoint.startswith("10.0.0.1:") and config.rdzv_endpoint != f"10.0.0.1:{port_for_job('42')}"
    other = NodeAgent(job_id="42", node=2, nodes=3, workers=8, hosts=hosts, max_restarts=3, join_timeout_s=600)
    assert not other.launch_config(3).rdzv_configs["is_host"] and other.endpoint == agent.endpoint
    assert config.rdzv_configs["read_timeout"] == 10  # a dead store host is given up on in 10 s, not 60


def test_a_worker_reads_its_place_and_its_restart_from_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # the agent's own variables are inherited: ignored
    for key, value in {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",
        "MASTER_ADDR": "10.0.0.3",
        "MASTER_PORT": "4242",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_RUN_ID": "77",
        "HPCTRAIN_JOB_ID": "77",
    }.items():
        monkeypatch.setenv(key, value)
    env = discover()
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == (5, 1, 8, 2, 4)
    assert (env.master_addr, env.master_port, env.job_id, env.restart, env.attempt) == (
        "10.0.0.3",
        4242,
        "77",
        2,
        "77.2",
    )


def test_the_same_failure_in_two_restarts_in_a_row_stops_the_next(tmp_path: Path) -> None:
    class Env:
        job_id = "7"
        requeue = 0

        def __init__(self, restart: int) -> None:
            self.restart = restart

    assert repeated_failure(tmp_path, Env(1)) is None  # the first restart always runs
    record_failure(tmp_path, "7", 1, 15, ValueError("bad shape"))
    record_failure(tmp_path, "7.1", 1, 12, ValueError("bad shape"))
    assert repeated_failure(tmp_path, Env(2)) is None  # another step: not deterministic
    record_failure(tmp_path, "7.2", 1, 12, ValueError("bad shape"))
    report = repeated_failure(tmp_path, Env(3))
    assert report and report["job_id"] == "7" and report["restarts"] == 2 and "step 12" in report["why"]


def test_a_job_that_may_shrink_lets_the_rendezvous_close_with_fewer_nodes(compose_cfg) -> None:
    agent = NodeAgent(
        job_id="42", node=1, nodes=4, workers=2, hosts=("h",) * 4, max_restarts=3, join_timeout_s=600, min_nodes=2
    )
    config = agent.launch_config(3)
    assert (config.min_nodes, config.max_nodes) == (2, 4) and config.rdzv_configs["last_call_timeout"] == 3

    from hpctrain.config.layout import layout_on_nodes, resolve_layout

    cfg = compose_cfg("cluster=dev", "cluster.nodes=4", "train.global_batch=32", "train.micro_batch=4")
    full, half = resolve_layout(cfg), layout_on_nodes(cfg, 2)
    assert (full.dp, full.grad_accum, half.dp, half.grad_accum) == (8, 1, 4, 2)
    assert full.global_batch == half.global_batch == 32


def test_the_supervisor_leaves_a_completed_run_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """srun --no-kill reports the lost node's task as failed after the others trained the run to its end."""
    from omegaconf import OmegaConf

    from hpctrain.config.schema import Config
    from hpctrain.launch.supervise import main
    from hpctrain.records.jobs import append_job, write_completed

    OmegaConf.save(OmegaConf.structured(Config), tmp_path / "config.yaml")
    append_job(tmp_path, "5", "slurm")
    write_completed(tmp_path, "5", 100)
    assert main([str(tmp_path), "5", "1"]) == 0
    assert "trained the run to step 100" in capsys.readouterr().out
    assert not (tmp_path / "attempts.jsonl").exists()


def test_a_restart_after_a_condemned_node_leaves_the_allocation(tmp_path: Path) -> None:
    from hpctrain.records.failures import condemned_hosts, last_attempt

    record_failure(tmp_path, "7", 0, 0, RuntimeError("pre-flight: n2 is slow"), peer=False, blame=["n2"])
    record_failure(tmp_path, "7", 1, 0, RuntimeError("Connection closed by peer"))
    assert condemned_hosts(tmp_path, "7", 0) == [] and condemned_hosts(tmp_path, "7", 1) == ["n2"]
    (tmp_path / "failures" / "7.1").mkdir()  # the restart that left at once: a host map, no records
    (tmp_path / "failures" / "7.1" / "hosts.json").write_text("[]")
    assert last_attempt(tmp_path, "7") == "7"  # the supervisor decides from the attempt that failed


def test_the_store_moves_to_the_next_node_that_answers(tmp_path: Path) -> None:
    """The rendezvous store's host died: every agent walks the same line of nodes after it; a live node opens
    the moved store (a new port per move), one that does not answer is skipped, and the agent next in line
    after a dead candidate hosts it itself."""
    import datetime
    from dataclasses import replace

    from torch.distributed import TCPStore

    from hpctrain.distributed.elastic import next_store

    hosts = ("127.0.0.1",) * 4
    agent = NodeAgent(job_id="9", node=3, nodes=4, workers=1, hosts=hosts, max_restarts=3, join_timeout_s=60)
    moved = replace(agent, store_node=1, generation=1)
    server = TCPStore(
        "127.0.0.1", moved.port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )  # node 1 noticed first and opened the new store
    assert next_store(agent, wait_s=2) == moved and moved.port != agent.port
    del server
    skipped = next_store(agent, wait_s=0.5)  # node 1 does not answer now: node 2 neither, node 3 is this one
    assert (skipped.store_node, skipped.generation) == (3, 3)


def test_a_store_that_failed_a_call_is_given_up_on_at_once_when_nothing_answers() -> None:
    """After a failed call, an agent asks whether the store still answers before moving it: a refused port
    says no at once (a store client would retry it for seconds), a port that takes connections but answers
    nothing (a process in its last moments) says no within the probe's wait, a live store says yes."""
    import datetime
    import socket
    import time

    from torch.distributed import TCPStore

    from hpctrain.distributed.elastic import _still_answers

    agent = NodeAgent(
        job_id="11", node=1, nodes=2, workers=1, hosts=("127.0.0.1",) * 2, max_restarts=3, join_timeout_s=60
    )
    start = time.monotonic()
    assert not _still_answers(agent)
    assert time.monotonic() - start < 0.5
    mute = socket.create_server(("127.0.0.1", agent.port))  # listens, never accepts, never answers
    start = time.monotonic()
    assert not _still_answers(agent, wait_s=1.0)
    assert time.monotonic() - start < 5
    mute.close()
    server = TCPStore(
        "127.0.0.1", agent.port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    assert _still_answers(agent)
    del server


def test_a_spare_takes_the_slot_nobody_took_in_a_moved_store() -> None:
    """In the store a dead host's successor opened, the slots start empty: the live agents take theirs at once
    (compare-and-set), and the dead node's stays empty; the spare claims it VACANT_S later, never a held one."""
    import datetime

    from torch.distributed import TCPStore

    from hpctrain.distributed import spares

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    assert spares.hold(store, "5", 1, node=1) and not spares.hold(store, "5", 1, node=7)  # one owner per slot
    beat = spares.Heartbeat("127.0.0.1", store.port, "5", 1, 1, 5).start()
    try:
        assert spares.wait_for_vacancy(store, "5", 2, node=2, moved=True) == 0  # slot 0's node died
    finally:
        beat.stop()
    assert not spares.hold(store, "5", 0, node=0)  # the dead node, back late, finds its slot taken: a spare


def test_a_store_whose_host_goes_silent_fails_its_clients_in_seconds_not_never(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that loses power leaves its store's clients with silence, not a closed socket. torch's TCPStore
    client then never returns: its read times out, but it blocks for good in the cancellation of its wait.
    The spares' clients (here: a spare waiting for a vacancy) and torch's c10d rendezvous backend (the agent's
    every state read) give each call a bound instead, and a client that missed it fails every later call at
    once. The store's host here is a stopped process (SIGSTOP): its connections stay open, nothing answers."""
    import datetime
    import signal
    import subprocess
    import sys
    import time

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from hpctrain.distributed import elastic, spares

    monkeypatch.setattr(spares, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(C10dRendezvousBackend, "_call_store", C10dRendezvousBackend._call_store)  # undone after
    elastic._bound_rendezvous_store_calls(2.0)
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from torch.distributed import TCPStore\n"
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(host.stdout.readline())
        spare = spares.connect("127.0.0.1", port, 600)  # 600 s to connect (the join timeout), 1 + 2 s a call
        spare.set("hpctrain/1/alive/0", "0:1")
        agent = TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=1)
        )
        backend = C10dRendezvousBackend(agent, "1")
        assert backend.get_state() is None  # a live store: the calls go through
        host.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(spares.StoreSilent):
            spares.wait_for_vacancy(spare, "1", 2, node=2)
        with pytest.raises(RendezvousConnectionError, match="did not answer"):
            backend.get_state()
        assert time.monotonic() - start < 10  # 3 s + 2 s, where the unbounded clients would wait for ever
        start = time.monotonic()
        with pytest.raises(spares.StoreSilent):
            spare.check(["hpctrain/1/ended"])
        with pytest.raises(RendezvousConnectionError, match="earlier"):
            backend.set_state(b"state")
        assert time.monotonic() - start < 0.5  # given up on: no second wait
    finally:
        host.send_signal(signal.SIGCONT)
        host.kill()
        host.wait()


# ---- what a restart waits for (bench/bench_restart.py measures it; these check the decisions) ----------------


def test_the_rendezvous_reads_its_state_at_the_agents_pace_not_every_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's c10d rendezvous waits 1 s between state reads and serves a 1 s old cached state: the agents'
    hook makes both the job's poll period (about 500 reads a second at any size, torch's 1 s from 500 nodes),
    and a real rendezvous built by torch's registry runs with it."""
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from hpctrain.distributed.elastic import _poll_rendezvous_every, rendezvous_poll_s

    assert (rendezvous_poll_s(2), rendezvous_poll_s(100), rendezvous_poll_s(500), rendezvous_poll_s(4000)) == (
        0.05,
        0.2,
        1.0,
        1.0,
    )
    waits: list = []
    monkeypatch.setattr(rdzv, "_delay", lambda seconds: waits.append(seconds))  # torch's, recording
    monkeypatch.setattr(rdzv, "_BackendRendezvousStateHolder", rdzv._BackendRendezvousStateHolder)  # restored after
    _poll_rendezvous_every(0.05)
    _poll_rendezvous_every(0.05)  # each launch of the agent calls it again: wrapped once
    rdzv._delay(seconds=1)
    rdzv._delay(seconds=(0, 0.3))  # the first round's random skew is left alone
    assert waits == [0.05, (0, 0.3)]

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    handler = get_rendezvous_handler(
        RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{server.port}",
            run_id="poll",
            min_nodes=1,
            max_nodes=1,
            is_host=False,
            last_call_timeout=1,
        )
    )
    assert handler._state_holder._cache_duration == 0.05
    info = handler.next_rendezvous()  # torch's own join, on the hooked state holder
    assert (info.rank, info.world_size) == (0, 1)
    handler.shutdown()


def test_a_rank_waits_for_rank_0s_store_to_listen_instead_of_backing_off(tmp_path: Path) -> None:
    """Every rank but 0 starts before rank 0's store listens after a restart; torch's client, refused, backs
    off about 0.5 s: `wait_for_listener` polls the port instead, and leaves a store that never comes to
    torch's own connect (and its error)."""
    import datetime
    import socket
    import threading

    from torch.distributed import TCPStore

    from hpctrain.distributed.environment import wait_for_listener

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started: list = []
    opener = threading.Timer(
        0.3, lambda: started.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
    )
    opener.start()
    wait_for_listener("127.0.0.1", port, timeout_s=30)
    opener.join()
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert started[0].get("k") == b"v"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        unused = probe.getsockname()[1]
    wait_for_listener("127.0.0.1", unused, timeout_s=0.2)  # returns: torch's connect reports it


def test_the_failure_path_imports_nothing_the_agent_did_not(tmp_path: Path) -> None:
    """A worker forked from the agent loads a checkpoint, and the agent logs the failed worker's traceback,
    without importing anything new: DCP, left to choose its reader, imports fsspec (0.6 s), and torch's log
    formatter imports torch._dynamo for a traceback (1.1 s), each time in every new worker or agent."""
    import subprocess
    import sys

    script = f"""
import logging, sys
import torch
import torch.distributed.checkpoint as dcp
import hpctrain.train.worker  # what the agent imports before forking its workers
from hpctrain.checkpoint.reshard import load_state
from hpctrain.distributed.elastic import _plain_torch_log_format

before = set(sys.modules)
dcp.save({{"w": torch.arange(4.0)}}, storage_writer=dcp.FileSystemWriter({str(tmp_path)!r}), no_dist=True)
state = {{"w": torch.zeros(4)}}
load_state(state, {str(tmp_path)!r}, None, no_dist=True)
assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
_plain_torch_log_format()
try:
    raise RuntimeError("a worker failed")
except RuntimeError:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").exception("failed (exitcode: 1)")
print(sorted({{m.split(".")[0] + ("._dynamo" if m.startswith("torch._dynamo") else "")
              for m in set(sys.modules) - before}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a worker failed" in proc.stderr  # the traceback is still logged
    new = proc.stdout.strip()
    assert "fsspec" not in new and "torch._dynamo" not in new, new


def test_an_agent_restarts_its_workers_when_a_peer_node_goes_silent_and_only_then() -> None:
    """A job that may shrink (to 1 of 3 nodes) and has no spare: each training agent watches the others' beats.
    A slot whose beats stop (a node that lost power: its peers block, nothing fails) makes the agent stop its
    workers, once; not when its workers already changed since that slot's last beat (the group restarted on its
    own, as after a death that closed the connections)."""
    import datetime
    import time

    from torch.distributed import TCPStore

    from hpctrain.distributed import spares

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    beats = {slot: spares.Heartbeat("127.0.0.1", store.port, "7", slot, slot, 5).start() for slot in (0, 1, 2)}
    told: list[int] = []
    workers = {"pids": {101, 102}}
    watch = spares.PeerWatch(
        "127.0.0.1", store.port, "7", 3, 0, 5, lambda: set(workers["pids"]), lambda _, slot, __: told.append(slot), 1
    )
    watch.start()
    time.sleep(1.0)
    beats[1].stop()  # node 1 goes silent
    time.sleep(spares.VACANT_S + 1.5)
    assert told == [1]  # once, though it stays silent
    workers["pids"] = {201, 202}  # node 2 then dies, and the group restarts on its own first
    beats[2].stop()
    time.sleep(spares.VACANT_S + 1.5)
    assert told == [1]
    watch.stop()
    beats[0].stop()


def test_an_agent_stopped_with_its_job_judges_no_heartbeat_until_the_others_could_beat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`scontrol suspend` stops every agent; after `scontrol resume` the first to sync saw every beat 30 s old and
    dropped every node from torch's rendezvous, itself included, and the job lost its workers (a CI run). The
    hooked state holder notices its own syncs 30 s apart and judges no heartbeat for one window (3 s): the
    nodes stay; a node still silent after it is dropped as before. Without the stop it judges at once."""
    import datetime
    import types

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from hpctrain.distributed import elastic

    monkeypatch.setattr(rdzv, "_BackendRendezvousStateHolder", rdzv._BackendRendezvousStateHolder)  # restored after
    elastic._poll_rendezvous_every(0.05)
    clock = {"now": 1000.0}
    monkeypatch.setattr(elastic, "time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    settings = rdzv.RendezvousSettings("suspend", 2, 2, rdzv.RendezvousTimeout(), datetime.timedelta(seconds=1), 3)

    def holder_with_beats(age_s: float) -> Any:
        holder = rdzv._BackendRendezvousStateHolder(C10dRendezvousBackend(server, f"run{age_s}"), settings, 0)
        beat = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=age_s)
        nodes = [rdzv._NodeDesc(f"n{i}", 100 + i, 0) for i in range(2)]
        holder.state.participants.update({node: i for i, node in enumerate(nodes)})
        holder.state.last_heartbeats.update({node: beat for node in nodes})
        holder.state.complete = True
        return holder

    def sync_at(holder: Any, now: float) -> int:
        clock["now"] = now
        holder.mark_dirty()
        holder.sync()
        return len(holder.state.participants)

    awake = holder_with_beats(30)
    assert sync_at(awake, 1000.0) == 0  # syncing all along: 30 s old beats are dead nodes, dropped at once
    stopped = holder_with_beats(0)
    assert sync_at(stopped, 1000.0) == 2
    stopped.state.last_heartbeats.update(
        {n: v - datetime.timedelta(seconds=30) for n, v in stopped.state.last_heartbeats.items()}
    )
    assert sync_at(stopped, 1030.5) == 2  # its own syncs 30.5 s apart: it was stopped too, it judges no one
    assert sync_at(stopped, 1032.0) == 2  # still within the window the others have to beat again
    assert sync_at(stopped, 1033.6) == 0  # no beat in that window either: dead, dropped


def test_the_heartbeat_judge_waits_one_window_after_its_own_stop() -> None:
    from hpctrain.distributed.elastic import HeartbeatJudge

    judge = HeartbeatJudge(3.0)
    assert [judge.may_judge(t) for t in (0.0, 1.0, 3.9)] == [True, True, True]  # 2.9 s apart: awake
    assert [judge.may_judge(t) for t in (40.0, 41.0, 42.9, 43.1, 44.0)] == [False, False, False, True, True]


# ---- replica groups (recovery=replicas) and the agents' watch (issue 48) ----------------------------------------


def test_replica_groups_each_run_their_own_rendezvous_and_share_the_lighthouse() -> None:
    """Four training slots in two groups of 2: a group's agents meet in their own rendezvous (run id
    `<job>-replica<g>`, a fixed 2 nodes, however many the job has), on the one store; the lighthouse is on the
    store's host, on a port of its own that moves with the store. Without groups: the job's run id."""
    from dataclasses import replace

    hosts = tuple(f"10.0.0.{i}" for i in range(1, 6))
    agent = NodeAgent(
        job_id="42", node=4, nodes=4, workers=2, hosts=hosts, max_restarts=3, join_timeout_s=600, groups=2
    )
    assert agent.spares == 0 and agent.group_nodes == 2 and agent.watched
    for slot, group in ((0, 0), (1, 0), (2, 1), (3, 1)):
        config = agent.launch_config(3, slot)
        assert config.run_id == f"42-replica{group}" and agent.group_of(slot) == group
        assert (config.min_nodes, config.max_nodes, config.rdzv_configs["last_call_timeout"]) == (2, 2, 1)
        assert config.rdzv_endpoint == agent.endpoint and not config.rdzv_configs["is_host"]
    assert agent.lighthouse_url == f"http://10.0.0.1:{agent.lighthouse_port}" and agent.lighthouse_port != agent.port
    moved = replace(agent, store_node=1, generation=1)
    assert moved.lighthouse_url == f"http://10.0.0.2:{moved.lighthouse_port}"
    assert moved.lighthouse_port != agent.lighthouse_port
    plain = replace(agent, groups=1)
    assert plain.launch_config(3, 2).run_id == "42" and plain.launch_config(3, 2).max_nodes == 4
    single = NodeAgent(job_id="42", node=0, nodes=1, workers=2, hosts=hosts[:1], max_restarts=3, join_timeout_s=600)
    assert not single.watched  # one node, no spare: no beats, no watch
    assert (agent.name_of(3), replace(agent, names=("n1", "n2", "n3", "n4", "n5")).name_of(3)) == ("10.0.0.4", "n4")


AGENT = r"""
import json, os, sys, time
from dataclasses import dataclass
from hpctrain.distributed.elastic import NodeAgent, NodesLost, run_agent

job, node, nodes, spare_nodes, groups, run_dir, behaviour = sys.argv[1:8]


@dataclass
class Task:
    run_dir: str
    config: dict


def worker(task):
    env = {k: os.environ.get(k) for k in ("HPCTRAIN_REPLICA_GROUP", "HPCTRAIN_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE",
                                          "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
    if behaviour == "groups":
        if env["HPCTRAIN_REPLICA_GROUP"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise RuntimeError("group 1's worker fails once")
        if env["HPCTRAIN_REPLICA_GROUP"] == "0":
            time.sleep(6)  # group 1 restarts meanwhile: this worker must not be restarted with it
        import urllib.request
        env["lighthouse_answers"] = urllib.request.urlopen(env["TORCHFT_LIGHTHOUSE"], timeout=10).status == 200
        return env
    print(json.dumps({"worker": os.getpid()}), flush=True)
    time.sleep(25 if behaviour == "train 25 s" else 600)  # trains until then, its node dies, or its agent ends it
    return os.getpid()


count = int(nodes) + int(spare_nodes)
agent = NodeAgent(job_id=job, node=int(node), nodes=int(nodes), workers=1, hosts=("127.0.0.1",) * count,
                  max_restarts=1, join_timeout_s=60, spares=int(spare_nodes), groups=int(groups),
                  names=tuple(f"n{i}" for i in range(count)))
print(json.dumps({"agent": os.getpid()}), flush=True)
try:
    results = run_agent(agent, Task(run_dir, {"run": {"id": "t"}, "checkpoint": {"tiers": []}}), worker)
    print(json.dumps({"results": {str(k): v for k, v in results.items()}}), flush=True)
except NodesLost as lost:
    print(json.dumps({"lost": str(lost), "time": time.monotonic()}), flush=True)
    sys.exit(1)
"""


class Agent:
    """A node's agent in a child process of its own (its workers forked from it), its stdout as JSON lines."""

    def __init__(self, job: str, node: int, nodes: int, spare_nodes: int, groups: int, run_dir: Path, how: str):
        import queue
        import subprocess
        import sys
        import threading

        repo = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, job, str(node), str(nodes), str(spare_nodes), str(groups), str(run_dir), how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=repo,
            env={**__import__("os").environ, "PYTHONPATH": str(repo)},
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(
            target=lambda: [self.lines.put(__import__("json").loads(x)) for x in self.proc.stdout], daemon=True
        ).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def next(self, key: str, timeout: float) -> dict[str, Any]:
        """Its next line that has `key`."""
        import queue
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if key in line:
                return line
        raise AssertionError(f"no {key!r} from the agent in {timeout:.0f} s:\n{''.join(self.err)[-4000:]}")

    def die(self, workers: list[int]) -> None:
        """The node dies: its agent and its workers at once."""
        import os
        import signal

        for pid in [self.proc.pid, *workers]:
            os.kill(pid, signal.SIGKILL)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.mark.timeout(240)
def test_one_replica_groups_failure_restarts_only_its_own_workers(tmp_path: Path) -> None:
    """Two agents as two 1-node replica groups (loopback): each group's worker learns its group, the group count
    and the lighthouse (which answers, hosted by node 0's agent) from its agent; group 1's worker fails once and
    is restarted in its own rendezvous while group 0's worker runs on, never restarted."""
    import secrets

    job = f"g{secrets.token_hex(3)}"
    agents = [Agent(job, node, 2, 0, 2, tmp_path, "groups") for node in (0, 1)]
    try:
        results = [a.next("results", 180)["results"]["0"] for a in agents]
    finally:
        for a in agents:
            a.end()
    lighthouse = results[0]["TORCHFT_LIGHTHOUSE"]
    assert lighthouse.startswith("http://127.0.0.1:") and results[1]["TORCHFT_LIGHTHOUSE"] == lighthouse
    for group, result in enumerate(results):
        assert result["HPCTRAIN_REPLICA_GROUP"] == str(group) and result["HPCTRAIN_REPLICA_GROUPS"] == "2"
        assert result["TORCHELASTIC_RUN_ID"] == f"{job}-replica{group}" and result["WORLD_SIZE"] == "1"
        assert result["lighthouse_answers"]
    assert [r["TORCHELASTIC_RESTART_COUNT"] for r in results] == ["0", "1"]


@pytest.mark.timeout(300)
def test_a_second_node_death_after_the_spare_was_used_ends_the_job_in_seconds(tmp_path: Path) -> None:
    """D1 on loopback: 2 training agents and a spare. Node 1 dies (agent and worker): the spare takes its slot
    and the job goes on. Then the spare's node dies too: the agent left must not wait in the rendezvous for its
    600 s join timeout; it ends within seconds with a failure record in the attempt's folder naming both dead
    nodes (they are to blame: a resubmission leaves them out)."""
    import json
    import secrets
    import time

    from hpctrain.records.failures import diagnose, read_hosts

    job = f"d{secrets.token_hex(3)}"
    agents = [Agent(job, node, 2, 1, 1, tmp_path, "sleep") for node in (0, 1, 2)]
    try:
        workers = {node: agents[node].next("worker", 120)["worker"] for node in (0, 1)}
        agents[1].die([workers[1]])
        workers[2] = agents[2].next("worker", 60)["worker"]  # the spare's: it took slot 1, the group restarted
        agents[0].next("worker", 60)
        time.sleep(1.0)
        agents[2].die([workers[2]])
        died = time.monotonic()
        line = agents[0].next("lost", 60)
        lost, ended = line["lost"], line["time"]
        assert agents[0].proc.wait(30) == 1
    finally:
        for a in agents:
            a.end()
    assert ended - died < 10, ended - died  # 3 s of silence, then the record and the exit
    assert "node(s) n1,n2 " in lost and "no hot spare left" in lost
    records = [r for folder in (tmp_path / "failures").iterdir() for r in read_failures(tmp_path, folder.name)]
    mine = [r for r in records if r["type"] == "NodesLost"]
    assert mine and mine[0]["blame"] == ["n1", "n2"] and not mine[0]["peer"], json.dumps(records)
    key = mine[0]["job_id"]
    assert diagnose(read_failures(tmp_path, key), read_hosts(tmp_path, key))[0] == ["n1", "n2"]


def test_the_watch_stands_down_once_slurm_ends_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scancel or a requeue sends every agent SIGTERM, and some stop before the others: the agents note the
    signal (through torch's own termination handler, still raising its SignalException), and a silence seen
    after it is no lost node: no record, no requeue, no verdict for the main thread."""
    import signal
    import threading
    import types

    from torch.distributed.elastic.multiprocessing import api

    from hpctrain.distributed import elastic, spares

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # restored after
    monkeypatch.setattr(elastic, "ENDING", threading.Event())
    elastic._note_termination()
    elastic._note_termination()  # each run of the agent hooks again: wrapped once
    assert not elastic.ENDING.is_set()
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert elastic.ENDING.is_set()
    agent = NodeAgent(
        job_id="13", node=0, nodes=2, workers=1, hosts=("127.0.0.1",) * 2, max_restarts=1, join_timeout_s=5
    )
    elastic.Verdicts(agent, types.SimpleNamespace(run_dir=str(tmp_path)), 0)(spares.FAIL, 1, (1,))
    assert not elastic._PENDING and not (tmp_path / "failures").exists()


@pytest.mark.timeout(300)
def test_a_replica_group_that_loses_a_node_leaves_and_the_other_group_trains_on(tmp_path: Path) -> None:
    """Two replica groups of 2 agents each (loopback), no spare. A node of group 0 dies: the other agent of group
    0 leaves the run (exit 0, a record naming the dead node) but, as the store's and the lighthouse's host,
    serves them on until group 1, never disturbed, trains to its end."""
    import secrets

    job = f"l{secrets.token_hex(3)}"
    agents = [Agent(job, node, 4, 0, 2, tmp_path, "train 25 s") for node in range(4)]
    try:
        workers = {node: agents[node].next("worker", 120)["worker"] for node in range(4)}
        agents[1].die([workers[1]])
        group_1 = [agents[node].next("results", 120)["results"] for node in (2, 3)]
        assert agents[0].next("results", 60)["results"] == {} and agents[0].proc.wait(30) == 0
    finally:
        for a in agents:
            a.end()
    # torch keys a worker's result by its rank in the group: the first workers, never restarted
    assert sorted(pid for results in group_1 for pid in results.values()) == sorted([workers[2], workers[3]])
    log = "".join(agents[0].err)
    assert "replica group 0 lost node(s) n1" in log and "hosting the rendezvous store and the lighthouse" in log
    records = [r for folder in (tmp_path / "failures").iterdir() for r in read_failures(tmp_path, folder.name)]
    assert [r["blame"] for r in records if r["type"] == "NodesLost"] == [["n1"]]
