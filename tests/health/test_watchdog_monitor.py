"""The hang watchdog (in a real subprocess, since it ends the process) and the in-run monitor's decisions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from omegaconf import OmegaConf

from hpctrain.config.schema import Config
from hpctrain.health import monitor as monitor_module
from hpctrain.health.monitor import RunMonitor, slope
from hpctrain.health.watchdog import EXIT_HANG

SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hpctrain.health.watchdog import Watchdog
    run_dir = Path(sys.argv[1])
    dog = Watchdog(run_dir, "job1", 0, timeout_s=1.0, factor=5.0, startup_timeout_s=2.0, poll_s=0.1).start()
    for step in range(1, 6):      # steps that keep beating: no alarm
        time.sleep(0.3)
        dog.beat(step, 0.3)
    time.sleep(30)                # then a hang outside any collective
""")


def test_watchdog_dumps_stacks_records_and_exits(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_HANG, proc.stderr
    dump = (tmp_path / "hangs" / "job1" / "rank0.txt").read_text()
    assert "no step completed" in dump and "after step 5" in dump and "time.sleep" in SCRIPT
    assert 'File "<string>"' in dump  # the main thread's stack, where it hung
    record = json.loads((tmp_path / "failures" / "job1" / "rank0.json").read_text())
    assert record["type"] == "Hang" and record["step"] == 6 and record["peer"] is False


FAILING = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hpctrain.health.watchdog import Watchdog
    from hpctrain.records.failures import record_failure
    run_dir = Path(sys.argv[1])
    dog = Watchdog(run_dir, "job1", 0, timeout_s=1.0, factor=5.0, startup_timeout_s=2.0, poll_s=0.1).start()
    dog.beat(1, 0.1)
    try:
        raise RuntimeError("[gloo] Connection closed by peer")
    except RuntimeError as exc:   # the loop's failure path, slower than the hang limit (a slow shared disk)
        dog.stand_down()
        time.sleep(3)
        record_failure(run_dir, "job1", 0, 2, exc)
    sys.exit(1)
""")


def test_a_rank_failing_on_its_own_is_not_called_hung(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", FAILING, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert not (tmp_path / "hangs").exists()
    record = json.loads((tmp_path / "failures" / "job1" / "rank0.json").read_text())
    assert record["type"] == "RuntimeError" and record["peer"] is True


SIGNALLED = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from hpctrain.health.watchdog import Watchdog
    from hpctrain.train.preemption import StopFlag
    rank, port, run_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dog = Watchdog(run_dir, "job1", rank, timeout_s=120.0, factor=5.0, startup_timeout_s=120.0, poll_s=0.1).start()
    stop = StopFlag(on_signal=lambda _: dog.stop_signalled()).install()
    for step in range(1, 4):      # healthy steps; a stop signal in the middle of one is acted on at its end
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        dist.all_reduce(torch.ones(2))
        dog.beat(step, 0.05)
    assert stop.signum == signal.SIGTERM  # flagged, not fatal: the stop would be agreed here
    print("boundary reached", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(2))  # rank 1 never comes: its peer is gone, as after a crash
    else:  # the peer that is gone: its own watchdog must not end it first (its stop signal may be relayed late)
        dog.stop()
        time.sleep(60)
""")


def test_a_rank_told_to_stop_that_cannot_reach_the_step_boundary_leaves_at_once(tmp_path: Path) -> None:
    """An agent restarting the group sends SIGTERM to workers whose peers are gone. The flag alone would
    leave them waiting in a collective for the hang limit (120 s here; the agent SIGKILLs after 30 s): the
    watchdog gives the step a few step times (3 s at least), then records and ends the rank."""
    import os
    import signal
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SIGNALLED, str(r), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    # the signal in a healthy step ended nothing: the rank reached the boundary (else it printed nothing)
    assert procs[0].stdout.readline().strip() == "boundary reached"
    time.sleep(1)
    os.kill(procs[0].pid, signal.SIGTERM)  # the agent's teardown, while rank 0 waits for rank 1
    _, err = procs[0].communicate(timeout=60)
    procs[1].kill()
    procs[1].communicate()
    assert procs[0].returncode == EXIT_HANG, err
    record = json.loads((tmp_path / "failures" / "job1" / "rank0.json").read_text())
    assert record["type"] == "Hang" and record["peer"] is True and "a stop signal came" in record["message"]


def cfg(**health: float) -> object:
    return OmegaConf.merge(OmegaConf.structured(Config), {"health": health})


def test_slope() -> None:
    assert slope([1.0, 2.0, 3.0, 4.0]) == 1.0 and slope([5.0, 5.0, 5.0]) == 0.0


def test_steady_memory_growth_is_reported(monkeypatch) -> None:
    values = iter(float(i * 2**20) for i in range(1000))  # +1 MiB per step
    monkeypatch.setattr(monitor_module, "memory_bytes", lambda device: next(values))
    mon = RunMonitor(cfg(memory_window=50, leak_mb=20, straggler_every=0).health, 0, torch.device("cpu"))
    events = [e for step in range(1, 101) for e in mon.after_step(step, 0.1)[1]]
    assert [e["event"] for e in events] == ["memory_leak", "memory_leak"]
    assert abs(events[0]["mb_per_window"] - 50) < 1e-6


def test_flat_memory_is_not_a_leak(monkeypatch) -> None:
    monkeypatch.setattr(monitor_module, "memory_bytes", lambda device: 1e9)
    mon = RunMonitor(cfg(memory_window=20, leak_mb=1, straggler_every=0).health, 0, torch.device("cpu"))
    assert not [e for step in range(1, 61) for e in mon.after_step(step, 0.1)[1]]


def test_a_persistently_slow_rank_is_a_straggler() -> None:
    mon = RunMonitor(cfg(straggler_patience=2, straggler_factor=1.3).health, 0, torch.device("cpu"))

    def probes(slow: float) -> list[dict]:
        return [
            {"rank": r, "host": f"n{r // 2}", "probe_s": 0.010 + 0.0002 * r + (slow if r == 5 else 0), "step_s": 0.1}
            for r in range(8)
        ]

    _, first = mon._judge(probes(0.02), 10)
    metrics, second = mon._judge(probes(0.02), 20)
    assert first == [] and [e["rank"] for e in second] == [5] and second[0]["host"] == "n2"
    assert metrics["health/probe_max_over_median"] > 2
    _, third = mon._judge(probes(0.0), 30)  # recovered: the count starts over
    assert third == [] and mon.flags == {}


def test_a_rank_saving_for_a_stop_is_not_hung_when_the_requeue_signals_it(tmp_path: Path) -> None:
    """After the loop took a stop at the boundary (`leave`), the SIGTERM of the requeue that ends the job is
    expected: no boundary deadline is set, and the hang clock restarts for the save."""
    from hpctrain.health.watchdog import Watchdog

    dog = Watchdog(tmp_path, "job1", 0, timeout_s=60, factor=5, startup_timeout_s=60)
    dog.beat(7, 0.1)
    dog.stop_signalled()
    assert dog.boundary_due is not None  # a rank that must reach the boundary soon
    dog.leave()
    dog.stop_signalled()
    assert dog.boundary_due is None and dog.leaving


SUSPENDED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hpctrain.health.watchdog import Watchdog
    dog = Watchdog(Path(sys.argv[1]), "job1", 0, timeout_s=1.0, factor=5.0, startup_timeout_s=2.0, poll_s=0.1).start()
    print("up", flush=True)
    for step in range(1, 40):     # steady steps; the test stops this process for longer than the limit
        time.sleep(0.25)
        dog.beat(step, 0.25)
""")


def test_a_suspended_process_is_not_a_hang(tmp_path: Path) -> None:
    """SIGSTOP (what `scontrol suspend` sends) for 8 s, four times the hang limit: the monotonic clock runs on,
    but the process did not hang, and the watchdog must not fire when it is continued."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", SUSPENDED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(8.0)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=60) == 0
    assert not (tmp_path / "hangs").exists()
