#!/usr/bin/env python3
"""Checkpoint costs, measured against references taken in the same run (this machine is noisy).

For a GPT whose model + AdamW state is a few hundred MB:
  (a) time training is blocked by a synchronous DCP save (dcp.save);
  (b) time training is blocked by hpctrain's asynchronous tiered save (CheckpointManager, staging only);
  write throughput of the save against the disk's own sequential write of the same bytes (a plain file),
  each repeat measuring both, one after the other;
  load throughput (the manager's resume) against a plain sequential read of the same bytes.
Targets: (b) <= 10% of (a); save throughput >= 70% of the raw disk figure.

    python bench/bench_checkpoint.py [--layers 12 --d-model 640] [--dir /tmp/hpctrain-bench-ckpt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.checkpoint.layout import committed_in  # noqa: E402
from hpctrain.checkpoint.manager import CheckpointManager, _NoCrcFileSystem  # noqa: E402
from hpctrain.config.layout import resolve_layout  # noqa: E402
from hpctrain.config.schema import Config  # noqa: E402
from hpctrain.parallel.engine import build_engine  # noqa: E402


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, nbytes: int, block: int = 64 << 20) -> float:
    """Seconds to write nbytes sequentially and fsync: the disk's own figure for this amount."""
    buf = os.urandom(min(block, nbytes))
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(buf[: min(len(buf), left)])
            left -= len(buf)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def raw_read(path: Path, block: int = 64 << 20) -> float:
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(block):
            pass
    return time.perf_counter() - started


def fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


@dataclass
class Saves:
    """Seconds per repeat of each save and of the raw write of the same bytes; the sizes of the last repeat."""

    sync_blocked: list[float] = field(default_factory=list)
    sync_nocrc: list[float] = field(default_factory=list)
    async_blocked: list[float] = field(default_factory=list)
    async_total: list[float] = field(default_factory=list)
    raw_write: list[float] = field(default_factory=list)
    sync_bytes: int = 0
    size: int = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=640)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hpctrain-bench-ckpt"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    cfg = bench_config(args)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    x = torch.randint(0, 50257, (1, 64))
    engine.step([(x, x)], 1e-4)  # optimizer states exist from here on
    params = sum(p.numel() for p in engine.model.parameters())

    manager = CheckpointManager(cfg.checkpoint, cfg.cluster.failure_rate_per_gpu_day, args.dir, "bench", 0, 1,
                                {"model": "bench"})
    raw_file = args.dir / "raw.bin"
    saves = measure_saves(args, engine, manager, raw_file)
    load_s, raw_read_s = measure_loads(args, engine, manager, raw_file)
    print_results(args.dir, params, saves, load_s, raw_read_s)
    shutil.rmtree(args.dir, ignore_errors=True)


def bench_config(args: argparse.Namespace) -> Any:
    """A GPT of --layers x --d-model on one CPU rank, one disk tier under --dir saving every step."""
    return OmegaConf.merge(OmegaConf.structured(Config), {
        "model": {"name": "bench", "n_layers": args.layers, "d_model": args.d_model, "n_heads": 8,
                  "vocab_size": 50257, "context": 1024},
        "cluster": {"name": "local", "nodes": 1, "gpus_per_node": 1},
        "train": {"global_batch": 1, "micro_batch": 1, "seq_len": 64, "max_steps": 10},
        "optim": {"warmup_steps": 1},
        "run": {"id": "bench"},
        "checkpoint": {"tiers": [{"name": "disk", "path": str(args.dir / "tier"), "interval_steps": 1,
                                  "keep_last": 1}], "when_busy": "wait"},
    })


def measure_saves(args: argparse.Namespace, engine: Any, manager: CheckpointManager, raw_file: Path) -> Saves:
    """(a), (a) without record CRC32s, (b) and the raw write, interleaved per repeat, so that each figure sees the
    same disk weather."""
    saves = Saves()
    for step in range(1, args.repeats + 1):
        target = args.dir / f"sync{step}"
        saves.sync_blocked.append(
            synchronous(lambda: dcp.save(engine.state_dict(), checkpoint_id=str(target), no_dist=True), target))
        saves.sync_bytes = dir_bytes(target)
        shutil.rmtree(target)
        writer = dcp.FileSystemWriter(str(target))
        writer.fs = _NoCrcFileSystem()
        saves.sync_nocrc.append(
            synchronous(lambda: dcp.save(engine.state_dict(), storage_writer=writer, no_dist=True), target))
        shutil.rmtree(target)

        manager.after_step(step, engine, {"consumed_samples": step}, manager.control_values(time.monotonic()))
        started_event = [e for e in manager.events if e["event"] == "save_started"][-1]
        saves.async_blocked.append(started_event["blocked_s"])
        manager.wait_all()
        committed = [e for e in manager.events if e["event"] == "save_committed"][-1]
        saves.async_total.append(committed["total_s"])
        manager.events.clear()
        saves.size = committed["bytes"]
        saves.raw_write.append(raw_write(raw_file, saves.size))
    return saves


def synchronous(save: Callable[[], None], target: Path) -> float:
    """Seconds a synchronous save blocks training: from the call until its files are on disk."""
    started = time.perf_counter()
    save()
    fsync_tree(target)
    return time.perf_counter() - started


def measure_loads(args: argparse.Namespace, engine: Any, manager: CheckpointManager, raw_file: Path
                  ) -> tuple[float, float]:
    """Median seconds of the manager's resume and of a plain sequential read of the same bytes."""
    ckpt = committed_in(args.dir / "tier" / "bench")[-1]  # an absolute tier path gets the run id appended
    raw_r = statistics.median(raw_read(raw_file) for _ in range(args.repeats))
    load_times = []
    for _ in range(args.repeats):  # what a restart does: find the newest checkpoint, verify it, load it
        started = time.perf_counter()
        assert manager.resume(engine)["step"] == ckpt.step
        load_times.append(time.perf_counter() - started)
    return statistics.median(load_times), raw_r


def print_results(disk: Path, params: int, saves: Saves, lt: float, raw_r: float) -> None:
    sb, ab = statistics.median(saves.sync_blocked), statistics.median(saves.async_blocked)
    sn, raw_w = statistics.median(saves.sync_nocrc), statistics.median(saves.raw_write)
    at = statistics.median(saves.async_total)
    sync_bytes, mb = saves.sync_bytes, saves.size / 1e6
    print(f"model {params / 1e6:.1f}M params; checkpoint {mb:.0f} MB (model + AdamW states); disk {disk}")
    print(f"(a) synchronous dcp.save, blocked:        {sb:8.3f} s  ({sync_bytes / 1e6 / sb:7.0f} MB/s)")
    print(f"    the same without record CRC32s:       {sn:8.3f} s  ({sync_bytes / 1e6 / sn:7.0f} MB/s)  "
          f"-> (b) is {ab / sn:.1%} of it")
    print(f"(b) hpctrain async save, blocked:         {ab:8.3f} s  = {ab / sb:6.1%} of (a)   [target <= 10%]")
    print(f"    hpctrain async save, start to commit: {at:8.3f} s  ({mb / at:7.0f} MB/s)")
    print(f"raw sequential write of {mb:.0f} MB + fsync:  {raw_w:8.3f} s  ({mb / raw_w:7.0f} MB/s)")
    print(f"save throughput vs raw write:             {raw_w / at:8.1%}   [target >= 70%]")
    print(f"resume (find, verify, load, set state):   {lt:8.3f} s  ({mb / lt:7.0f} MB/s)")
    print(f"raw sequential read:                      {raw_r:8.3f} s  ({mb / raw_r:7.0f} MB/s)  -> load at "
          f"{raw_r / lt:.1%} of raw")


if __name__ == "__main__":
    main()
