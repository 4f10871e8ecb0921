"""A restarted worker waits for its GPU to be left by the worker it replaces (torch's agent abandons one that
is stuck in the driver), and calls the node unhealthy when it is not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.health.gpu_free import (
    earlier_workers,
    parse_compute_apps,
    wait_for_earlier_workers,
    worker_restart,
)
from hpctrain.health.preflight import UnhealthyNodes

FIXTURES = Path(__file__).parent / "fixtures" / "node"
GPU3 = "GPU-00000000-0000-0000-0000-000000000003"
RESTARTS = {48211: 1, 48214: 0, 51007: 1}  # 48214: the abandoned worker of restart 0; 51007: a sibling's stray context


def apps():
    return parse_compute_apps((FIXTURES / "nvidia_smi_compute_apps_restart.csv").read_text())


def test_compute_apps_are_parsed_with_unknown_memory() -> None:
    found = apps()
    assert [(a.pid, a.used_mib) for a in found] == [(48211, 71234), (48214, 70980), (51007, 612), (39921, None)]
    assert found[1].gpu_uuid == GPU3


def test_only_this_runs_workers_of_an_earlier_restart_on_this_gpu_count() -> None:
    restart_of = lambda pid, run: RESTARTS.get(pid) if run == "77" else None  # noqa: E731
    assert earlier_workers(apps(), GPU3, "77", 1, restart_of) == [48214]
    assert earlier_workers(apps(), GPU3.removeprefix("GPU-"), "77", 1, restart_of) == [48214]  # torch's uuid form
    assert earlier_workers(apps(), GPU3, "other-run", 1, restart_of) == []  # another job's process: not ours to judge
    assert earlier_workers(apps(), "GPU-00000000-0000-0000-0000-000000000005", "77", 1, restart_of) == []


def test_a_stuck_worker_condemns_the_node_and_one_that_leaves_does_not() -> None:
    restart_of = lambda pid, run: RESTARTS.get(pid)  # noqa: E731
    with pytest.raises(
        UnhealthyNodes,
        match=r"n7: GPU .*03 is still held by worker\(s\) \[48214\] of an earlier "
        r"restart after 0 s",
    ) as caught:
        wait_for_earlier_workers(GPU3, "77", 1, "n7", 0.0, apps, restart_of)
    assert caught.value.hosts == ["n7"]
    polls = iter([apps(), [a for a in apps() if a.pid != 48214]])
    wait_for_earlier_workers(GPU3, "77", 1, "n7", 30.0, lambda: next(polls), restart_of)  # gone at the 2nd poll
    wait_for_earlier_workers(GPU3, "77", 1, "n7", 0.0, lambda: None, restart_of)  # no nvidia-smi: nothing to wait for


def test_a_workers_run_and_restart_are_read_from_its_environment() -> None:
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "77", "TORCHELASTIC_RESTART_COUNT": "2"}
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "up\n"  # its own environment now, not the one it was forked with
        assert worker_restart(child.pid, "77") == 2
        assert worker_restart(child.pid, "78") is None
    finally:
        child.kill()
        child.wait()
    assert worker_restart(child.pid, "77") is None  # gone
