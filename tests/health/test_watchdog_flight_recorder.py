"""Who the hang watchdog blames, decided from torch's flight recorder: real gloo dumps captured with torch 2.13
and NCCL dumps built in the same format (tests/health/fixtures/flight_recorder, with the scripts that made
them), and a real two-process gloo hang where the waiting rank has no torch.distributed frame on its stack."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from hpctrain.health.watchdog import EXIT_HANG, TRACE_SUFFIX, Watchdog, decide, merge_traces, pending_collectives

FIXTURES = Path(__file__).parent / "fixtures" / "flight_recorder"
NOW_NS = 1796038000_000000000 + 612_000_000_000  # 612 s after the NCCL fixtures' first entry

# The main thread of a rank waiting for a peer under NCCL: blocked in .item(), no torch.distributed frame.
ITEM_STACK = '  File "hpctrain/train/loop.py", line 171, in _train\n    loss_value = loss.item()\n'
SLEEP_STACK = '  File "hpctrain/data/loader.py", line 88, in next_batch\n    time.sleep(1)\n'
C10D_STACK = (
    '  File "torch/distributed/distributed_c10d.py", line 4820, in _store_based_barrier\n    time.sleep(0.01)\n'
)
DCP_STACK = '  File "torch/distributed/checkpoint/filesystem.py", line 412, in write_data\n    stream.write(data)\n'
GLOO_STACK = '  File "torch/distributed/distributed_c10d.py", line 2901, in all_reduce\n    work.wait()\n'


def trace(name: str) -> dict:
    return pickle.loads((FIXTURES / name).read_bytes())


def test_an_nccl_rank_waiting_in_a_collective_is_a_peer_though_its_stack_shows_none() -> None:
    verdict = decide(trace("nccl_rank0_waiting.pkl"), ITEM_STACK, "nccl", NOW_NS)
    assert verdict.peer
    assert "nccl:_allgather_base #1650 of group 5f3c (mesh_dp_shard), enqueued 12 s ago" in verdict.reason


def test_an_nccl_rank_with_nothing_in_flight_is_stuck_itself() -> None:
    verdict = decide(trace("nccl_rank3_stuck.pkl"), SLEEP_STACK, "nccl", NOW_NS)
    assert not verdict.peer and "nothing in flight (flight recorder" in verdict.reason


def test_a_full_dump_counts_only_what_is_not_finished() -> None:
    full = trace("nccl_rank0_full.pkl")
    assert [e["collective_seq_id"] for e in pending_collectives(full)] == [1649, 1650]  # started, scheduled
    verdict = decide(full, ITEM_STACK, "nccl", NOW_NS)
    assert verdict.peer and "nccl:_reduce_scatter_base #1649" in verdict.reason  # the oldest one
    assert "2 collective(s) in flight" in verdict.reason


def test_under_nccl_only_c10d_host_waits_on_the_stack_mean_waiting() -> None:
    stuck = trace("nccl_rank3_stuck.pkl")
    assert decide(stuck, C10D_STACK, "nccl", NOW_NS).peer  # a store barrier (new_group): waiting for peers
    assert not decide(stuck, DCP_STACK, "nccl", NOW_NS).peer  # its own checkpoint write hangs


def test_real_gloo_dumps_finished_collectives_are_retired_not_completed() -> None:
    waiting, idle = trace("gloo_rank0_waiting.pkl"), trace("gloo_rank1_idle.pkl")
    assert [e["state"] for e in idle["entries"]] == ["scheduled"]  # finished, still "scheduled" under gloo
    assert decide(waiting, ITEM_STACK, "gloo", NOW_NS).peer  # work.wait() on an async all-reduce
    assert not decide(idle, SLEEP_STACK, "gloo", NOW_NS).peer
    assert decide(idle, GLOO_STACK, "gloo", NOW_NS).peer  # gloo blocks the caller: the stack still counts


def test_a_cpu_gloo_cuda_nccl_group_reads_both_recorders() -> None:
    backend = "cpu:gloo,cuda:nccl"  # CPU tensors (flags, object sizes) go over gloo, GPU ones over NCCL
    waiting_on_cpu = merge_traces([trace("nccl_rank3_stuck.pkl"), trace("gloo_rank0_waiting.pkl")])
    assert decide(waiting_on_cpu, ITEM_STACK, backend, NOW_NS).peer
    stuck = merge_traces([trace("nccl_rank3_stuck.pkl"), trace("gloo_rank1_idle.pkl")])
    assert not decide(stuck, SLEEP_STACK, backend, NOW_NS).peer
    assert merge_traces([]) is None


def test_without_the_recorder_the_stack_decides() -> None:
    off = trace("recorder_off.pkl")  # TORCH_FR_BUFFER_SIZE=0
    assert decide(off, GLOO_STACK, "gloo", NOW_NS).peer
    verdict = decide(off, SLEEP_STACK, "nccl", NOW_NS)
    assert not verdict.peer and "(main thread's stack)" in verdict.reason
    assert decide(None, GLOO_STACK, None, NOW_NS).peer  # no process group at all


def test_the_limit_stays_below_the_collective_timeout() -> None:
    dog = Watchdog(Path("."), "j", 0, timeout_s=600, factor=20, startup_timeout_s=1200, ceiling_s=1680)
    assert dog.limit() == 1200
    dog.beat(1, 120.0)  # 20 x 120 s = 2400 s would outlast NCCL's own watchdog
    assert dog.limit() == 1680


RANKS = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from hpctrain.health.watchdog import Watchdog
    rank, port, run_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(4)
    dist.all_reduce(t)  # step 1, together
    dog = Watchdog(run_dir, "job1", rank, timeout_s=1.0 if rank == 0 else 4.0, factor=5.0,
                   startup_timeout_s=10.0, poll_s=0.1).start()
    dog.beat(1, 0.1)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # as under NCCL: enqueued, then a wait outside torch.distributed
        work.wait()
    else:
        time.sleep(60)  # stuck in its own code
""")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_a_real_gloo_hang_blames_the_stuck_rank_not_the_waiting_one(tmp_path: Path) -> None:
    port, env = _free_port(), {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS, str(r), port, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == EXIT_HANG, err
    records = {r: json.loads((tmp_path / "failures" / "job1" / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert records[0]["peer"] is True and "gloo:all_reduce #2" in records[0]["message"]
    assert records[1]["peer"] is False and "nothing in flight" in records[1]["message"]
    assert "verdict: waiting for another rank" in (tmp_path / "hangs" / "job1" / "rank0.txt").read_text()
    full = pickle.loads((tmp_path / "hangs" / "job1" / f"gloo{TRACE_SUFFIX}0").read_bytes())  # for post-mortems
    assert [e["collective_seq_id"] for e in full["entries"]] == [1, 2] and "frames" in full["entries"][0]


def test_a_forked_workers_outer_torch_frames_do_not_make_it_a_peer() -> None:
    """An elastic agent's worker has torch/distributed/elastic frames below the training code: only the frames
    the training code called say whether the rank waits in a collective."""
    outer = (
        '  File "/usr/lib/python3.11/multiprocessing/process.py", line 108, in run\n'
        '  File "/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 611, in _wrap\n'
        '  File "/work/hpctrain/train/worker.py", line 27, in run_worker\n'
        '  File "/work/hpctrain/train/loop.py", line 190, in _train\n'
    )
    asleep = outer + '  File "/work/hpctrain/train/faults.py", line 70, in maybe_fire\n'
    waiting = outer + (
        '  File "/work/hpctrain/parallel/engine.py", line 329, in _reduce\n'
        '  File "/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper\n'
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2900, in all_reduce\n'
    )
    assert not decide(None, asleep, "gloo", 0).peer
    assert decide(None, waiting, "gloo", 0).peer
