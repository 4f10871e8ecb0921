"""Replica groups (`recovery=replicas`) on real processes: two groups of one rank each, a real torchft lighthouse,
the real task function (hpctrain.train.loop.train) in each group, gloo across them. One group is SIGKILLed in
the middle of the run and started again: the other trains on alone (steps with one participant, no step lost),
the restarted group heals from its live peer over the network (not from disk) and rejoins, and both end with
the same weights, bit for bit."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.checkpoint.inspect import export_model, find
from hpctrain.config.layout import resolve_layout
from hpctrain.config.schema import to_plain
from hpctrain.distributed.lighthouse import LighthouseProcess
from tests.conftest import _compose
from tests.gpu_rules import environment as rules_environment

torchft = pytest.importorskip("torchft")
pytestmark = pytest.mark.slow  # two groups of real processes, a minute or more each

STEPS = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Groups:
    """The two groups' processes, started and restarted as their agents would."""

    def __init__(self, tmp_path: Path, lighthouse: str, *overrides: str) -> None:
        cfg = _compose(
            "+experiment=smoke",
            "cluster.nodes=2",
            "cluster.gpus_per_node=1",
            f"train.max_steps={STEPS}",
            "train.log_every=1000",
            "optim.warmup_steps=2",
            "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 1000, keep_last: 1}]",
            f"run.root={tmp_path}",
            "run.id=replicas",
            *overrides,
        )
        self.run_dir = tmp_path / "smoke" / "replicas"
        self.run_dir.mkdir(parents=True)
        OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)  # as the launcher does
        self.tmp, self.lighthouse = tmp_path, lighthouse
        self.config = to_plain(cfg)
        self.layout = dataclasses.asdict(resolve_layout(cfg))
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.started = 0

    def start(self, group: int, restart: int = 0) -> None:
        args = {
            "config": self.config,
            "run_dir": str(self.run_dir),
            "layout": self.layout,
            "group": group,
            "groups": 2,
            "lighthouse": self.lighthouse,
            "port": _free_port(),
            "job_id": "4242",
            "restart": restart,
        }
        path = self.tmp / f"args.{group}.{restart}.json"
        path.write_text(json.dumps(args))
        log = open(self.tmp / f"group{group}.{restart}.log", "w")
        env = rules_environment({**os.environ, "WANDB_MODE": "offline"})
        self.procs[group] = subprocess.Popen(
            [sys.executable, "-m", "tests.replicas.group_worker", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )

    def metrics(self, group: int) -> list[dict[str, Any]]:
        return _metrics(self._dir(group) / "metrics.jsonl")

    def events(self, group: int) -> list[dict[str, Any]]:
        return _events(self._dir(group) / "events.jsonl")

    def _dir(self, group: int) -> Path:
        return self.run_dir if group == 0 else self.run_dir / "replicas" / f"g{group}"

    def final_weights(self, group: int) -> dict[str, torch.Tensor]:
        ckpt = find(self._dir(group), tier="shared")
        return torch.load(export_model(ckpt, self.tmp / f"export{group}" / "model.pt")[0])

    def log(self, group: int, restart: int = 0) -> str:
        return (self.tmp / f"group{group}.{restart}.log").read_text()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def lighthouse() -> Any:
    served = LighthouseProcess.start("[::]:0", 1, 1000, 1000)
    yield served.address
    served.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "mode", [["recovery=replicas"], ["recovery=diloco", "recovery.sync_every=5"]], ids=lambda m: m[0]
)
def test_a_killed_group_is_left_out_then_heals_from_its_peer_and_weights_end_equal(
    tmp_path: Path, lighthouse: str, mode: list[str]
) -> None:
    """recovery=diloco: the same, with the groups meeting every 5 steps (a round); the loss falls as it trains."""
    groups = Groups(tmp_path, lighthouse, *mode)
    try:
        groups.start(0)
        groups.start(1)
        _wait("group 1 at step 12", lambda: any(m["step"] >= 12 for m in groups.metrics(1)), 200)
        groups.procs[1].send_signal(signal.SIGKILL)
        groups.procs[1].wait()
        killed_at = max(m["step"] for m in groups.metrics(1))
        # group 0 goes on alone: steps with one participant
        _wait(
            "group 0 alone for 5 steps",
            lambda: sum(m["participants"] == 1 for m in groups.metrics(0)) >= 5,
            120,
        )
        groups.start(1, restart=1)
        assert groups.procs[0].wait(timeout=300) == 0, groups.log(0)
        assert groups.procs[1].wait(timeout=60) == 0, groups.log(1, 1)
    finally:
        groups.stop()
    rows = groups.metrics(0)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # group 0 never lost or repeated a step
    # alone from the step after the kill (and perhaps at the start, before group 1's first quorum)
    alone = [r["step"] for r in rows if r["participants"] == 1 and r["step"] > killed_at]
    every = 5 if "recovery=diloco" in mode else 1  # DiLoCo: group 0 goes on alone from the next round
    assert alone and alone[0] <= killed_at + every + 2, (alone, killed_at)
    assert rows[-1]["participants"] == 2  # the restarted group rejoined
    heals = [e for e in groups.events(1) if e["event"] == "replica_heal"]
    rejoin = heals[-1]
    assert rejoin["step"] > killed_at and rejoin["step"] > rejoin["from_step"], heals  # healed past its last save
    quorums = [e for e in groups.events(0) if e["event"] == "replica_quorum"]
    assert [q["participants"] for q in quorums][:2] == [1, 2], quorums
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    w0, w1 = groups.final_weights(0), groups.final_weights(1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


def _serve_lighthouse() -> LighthouseProcess:
    """A lighthouse in a process of its own, as the node agent hosting the store runs it, to kill as its host dies."""
    return LighthouseProcess.start(f"[::]:{_free_port()}", 1, 1000, 1000)


@pytest.mark.timeout(400)
def test_a_lost_lighthouse_stops_the_quorums_and_a_new_one_resumes_every_group(tmp_path: Path) -> None:
    """The lighthouse is one process (in the node agent that hosts the rendezvous store). When it dies no quorum
    forms: each group's step fails within `recovery.quorum_timeout_s` and its workers exit with an error. Their
    agents restart them with the new lighthouse's address (the store's next host runs one); every group resumes
    from its own newest checkpoint, the quorum brings them to one step and state, and they finish with equal
    weights: the run survives, with the steps since the checkpoint trained again."""
    first = _serve_lighthouse()
    groups = Groups(
        tmp_path,
        first.address,
        "recovery=replicas",
        "recovery.quorum_timeout_s=10",
        "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 10, keep_last: 2}]",
    )
    second = None
    try:
        groups.start(0)
        groups.start(1)
        _wait(
            "both groups at step 25", lambda: all(any(m["step"] >= 25 for m in groups.metrics(g)) for g in (0, 1)), 200
        )
        first.proc.kill()
        first.proc.wait()
        lost = time.monotonic()
        codes = [groups.procs[g].wait(timeout=120) for g in (0, 1)]
        failed_after = time.monotonic() - lost
        assert all(code != 0 for code in codes), codes
        stopped_at = max(m["step"] for m in groups.metrics(0))
        assert stopped_at < STEPS
        second = _serve_lighthouse()
        groups.lighthouse = second.address
        groups.start(0, restart=1)
        groups.start(1, restart=1)
        assert groups.procs[0].wait(timeout=300) == 0, groups.log(0, 1)
        assert groups.procs[1].wait(timeout=60) == 0, groups.log(1, 1)
    finally:
        groups.stop()
        for served in (first, second):
            if served is not None:
                served.stop()
    print(f"\nthe lighthouse lost at step {stopped_at}: both groups' workers exited {failed_after:.1f} s later")
    assert failed_after < 10 + 30, failed_after  # the quorum timeout, not the run's hang limit
    rows = groups.metrics(0)
    assert rows[-1]["step"] == STEPS and rows[-1]["participants"] == 2
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))  # no step skipped (those since the save redone)
    w0, w1 = groups.final_weights(0), groups.final_weights(1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.timeout(400)
def test_a_run_that_ends_while_group_0_is_out_is_completed_by_the_group_that_finished(
    tmp_path: Path, lighthouse: str
) -> None:
    """Group 0 (the run's own files) is killed and not restarted; group 1 trains on alone to the last step. The
    run is complete: its COMPLETED.json names group 1's folder, whose checkpoints hold the end, and a group 0
    started afterwards has nothing to train."""
    groups = Groups(tmp_path, lighthouse, "recovery=replicas")
    try:
        groups.start(0)
        groups.start(1)
        _wait("group 0 at step 12", lambda: any(m["step"] >= 12 for m in groups.metrics(0)), 200)
        groups.procs[0].send_signal(signal.SIGKILL)
        groups.procs[0].wait()
        assert groups.procs[1].wait(timeout=300) == 0, groups.log(1)
        done = json.loads((groups.run_dir / "COMPLETED.json").read_text())
        assert done["step"] == STEPS and done["replica_dir"] == "replicas/g1", done
        assert groups.metrics(1)[-1]["step"] == STEPS
        groups.start(0, restart=1)
        assert groups.procs[0].wait(timeout=120) == 0, groups.log(0, 1)
    finally:
        groups.stop()
    assert '"completed": true' in groups.log(0, 1)  # the worker's result: the run was complete already
    assert max(m["step"] for m in groups.metrics(0)) < STEPS  # group 0 trained nothing more
