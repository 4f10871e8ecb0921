"""The goodput a configured run can expect (hpctrain/goodput/expected.py) and the dry-run plan's line for it: the run's
tiers and recovery mode read from the config, the model fed from them, restart against replica groups."""

from __future__ import annotations

import json

import pytest

from hpctrain.config.schema import TierConfig
from hpctrain.goodput.expected import node_local, run_failures, run_goodput, run_policy, run_replicas
from hpctrain.goodput.model import CheckpointPolicy, TierCost, expected_goodput, replica_loss
from hpctrain.launch.cli import run

GB = 1e9
STATE = 175e9 * 14  # bytes: bf16 weights, fp32 master, Adam


@pytest.mark.parametrize(
    "path, local",
    [
        ("checkpoints", False),  # inside the run directory: shared storage
        ("/lustre/ckpt", False),
        ("/dev/shm/hpctrain", True),
        ("/local_ssd/hpctrain", True),
        ("/tmp/ckpt", True),
    ],
)
def test_node_local_tiers_by_path(path: str, local: bool) -> None:
    assert node_local(TierConfig(name="t", path=path)) is local


def test_the_175b_runs_tiers_as_the_models_two(compose_cfg) -> None:
    cfg = compose_cfg("+experiment=175b")  # ram every 20 min, local every 60, shared every 120; 512 nodes
    m = run_failures(cfg).mtbf_s
    assert m == pytest.approx(86400 / (0.001 * 4096))
    node = STATE / 512  # 4.79 GB per node
    stage = node / (4 * GB)
    assert run_policy(cfg, 175e9, 10.0, m) == CheckpointPolicy(
        TierCost(pytest.approx(stage), pytest.approx(STATE / (40 * GB)), pytest.approx(STATE / (40 * GB))),
        7200.0,
        TierCost(pytest.approx(stage), pytest.approx(node / (10 * GB)), pytest.approx(node / (10 * GB))),
        1200.0,  # the RAM tier saves more often than the local disk
    )
    # replica groups each save a whole copy: twice the bytes per node and through the file system
    mine = run_policy(cfg, 175e9, 10.0, m, copies=2)
    assert mine is not None and mine.slow.blocked_s == pytest.approx(2 * stage)
    assert mine.slow.write_s == pytest.approx(2 * STATE / (40 * GB))
    # a tier by steps: 500 steps of 3 s is sooner than 120 min
    steps = compose_cfg("+experiment=175b", "checkpoint.tiers.2.interval_steps=500")
    assert run_policy(steps, 175e9, 3.0, m).tau_slow_s == 1500.0
    assert run_policy(compose_cfg("+experiment=175b", "checkpoint=none"), 175e9, 3.0, m) is None


def test_restart_and_replicas_expected_goodput(compose_cfg) -> None:
    restart_cfg = compose_cfg("+experiment=175b")
    restart = run_goodput(restart_cfg, 175e9, 10.0)
    failures = run_failures(restart_cfg)
    assert failures.restart_s == pytest.approx(0.3 * 10 + 0.7 * 300)  # crashes and hangs restart in the allocation
    assert restart["mode"] == "restart" and restart["goodput"] == restart["restart_goodput"]
    assert restart["goodput"] == pytest.approx(
        expected_goodput(run_policy(restart_cfg, 175e9, 10.0, 21093.75), failures)
    )

    cfg = compose_cfg("+experiment=175b", "recovery=replicas", "cluster.spare_nodes=1")
    replicas = run_goodput(cfg, 175e9, 10.0)
    groups = run_replicas(cfg, 175e9, 10.0)
    assert (groups.groups, groups.p_spare, groups.detect_s, groups.sync_every) == (2, 1.0, 1.0, 1)
    assert groups.heal_s == pytest.approx(STATE / 256 / (10 * GB))  # a node's shard of a whole copy, 256 per group
    own = run_policy(cfg, 175e9, 10.0, run_failures(cfg).mtbf_s, copies=2)
    assert replicas["goodput"] == pytest.approx(replica_loss(own, run_failures(cfg), groups).goodput)
    assert replicas["goodput"] > 0.99 > 0.9 > replicas["restart_goodput"]  # 2 h of shared interval redone
    assert "hint" not in replicas

    # without a spare a group that lost a node waits for the requeue: half the 48 h time limit
    alone = compose_cfg("+experiment=175b", "recovery=replicas")
    assert run_replicas(alone, 175e9, 10.0).requeue_s == 24 * 3600
    stuck = run_goodput(alone, 175e9, 10.0)
    assert stuck["dominant"] == "groups out" and "spare_nodes" in stuck["hint"]

    diloco = run_replicas(compose_cfg("+experiment=175b", "recovery=diloco"), 175e9, 10.0)
    assert diloco.sync_every == 20 and diloco.sync_s == pytest.approx(175e9 * 4 / 256 / (10 * GB))


def test_the_dry_run_plan_says_the_mode_and_its_goodput(compose_cfg, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ("+experiment=175b", "recovery=replicas", "cluster.spare_nodes=1", "dry_run=true")
    assert run(compose_cfg(*overrides)).code == 0
    lines = capsys.readouterr().out.splitlines()
    recovery = next(line for line in lines if line.startswith("  recovery"))
    assert "recovery=replicas: 2 replica groups synced every step" in recovery
    goodput = next(line for line in lines if line.startswith("  goodput"))
    assert "with recovery=replicas (restart: " in goodput and "a failure every 5.86 h" in goodput
    assert run(compose_cfg(*overrides, "plan.format=json")).code == 0
    expected = json.loads(capsys.readouterr().out)["expected_goodput"]
    assert expected["mode"] == "replicas" and f"expected {expected['goodput']:.1%}" in goodput
    assert run(compose_cfg("+experiment=175b", "checkpoint=none", "dry_run=true")).code == 0
    assert "  goodput         not estimated: no shared checkpoint tier" in capsys.readouterr().out
