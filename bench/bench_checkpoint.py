#!/usr/bin/env python3
"""Checkpoint costs, measured against references taken in the same run (this machine is noisy).

For a GPT whose model + AdamW state is a few hundred MB:
  (a) time training is blocked by a synchronous DCP save (dcp.save, torch.save's record CRC32 on, its default),
      and by the same save without any checksum, and with hpctrain's writer (CRC32C per file and record): the
      checksum's cost;
  (b) time training is blocked by hpctrain's asynchronous tiered save, in steady state: the step boundary that
      starts it (collecting the state dict, starting the copy to host memory, booking the previous save: the
      whole `after_step` call), plus the next training step's wait for the copy before its optimizer step
      (`wait_for_staging`: the copy runs while the step computes). Beside it, and not in the goal, how much
      slower that step is than one without a save running: on a CPU box the copy's and the write's threads
      share the training's cores (on a GPU node the copy is the DMA engine's and the cores are idle);
  write throughput of the save (start to durable commit) against the disk's own sequential write of the same
  bytes (a plain file, fsynced), each repeat measuring both, one after the other;
  load throughput (the manager's resume: find, check, load, set state; records verified as they are read, and
  without verification) against a plain sequential read of the same bytes into memory of their size, one
  thread, interleaved.
Targets: (b) <= 10% of (a); save throughput >= 80% of the raw disk; resume >= 80% of the raw read.

Every figure is a median over --repeats (at least 3) repetitions in which the ways being compared run one after
the other (A B C A B C ..., the first of each repetition rotated), and each goal is judged on the median of the
per-repetition ratios: a ratio of two neighbours in time, so that a noisy moment of a shared machine moves both.
The machine's load average is printed beside the results. The default is 7 repetitions: a virtual disk's own
reads spread 2x-4x between neighbouring repetitions (53-242% in one run), and a median of 3 of those is one
noisy moment. About 2 minutes on a quiet 2-core machine with the defaults.

    python bench/bench_checkpoint.py [--layers 12 --d-model 640] [--dir /tmp/hpctrain-bench-ckpt] [--repeats 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.filesystem import FileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.checkpoint.integrity import SummingWriter  # noqa: E402
from hpctrain.checkpoint.manager import CheckpointManager  # noqa: E402
from hpctrain.checkpoint.storage import committed_in  # noqa: E402
from hpctrain.config.layout import resolve_layout  # noqa: E402
from hpctrain.config.schema import Config  # noqa: E402
from hpctrain.entry import EntryParser
from hpctrain.parallel.engine import build_engine  # noqa: E402

_TOKENS = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(0))
BATCH = torch.stack([_TOKENS, _TOKENS])[:, None]  # one micro-batch of 64 tokens: inputs, targets


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, nbytes: int, block: int = 64 << 20) -> float:
    """Seconds to write nbytes sequentially and fsync: the disk's own figure for this amount."""
    buf = os.urandom(min(block, nbytes))
    os.sync()
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(buf[: min(len(buf), left)])
            left -= len(buf)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def raw_read(paths: list[Path], into: memoryview, block: int = 64 << 20) -> float:
    """Seconds to read files sequentially, one thread, in blocks of `block` bytes, into `into`: memory allocated
    and touched before (no allocation or page fault timed). Given the files' size, that is a load's own work:
    every byte placed in memory of its own, as a resume places it in the state's tensors. Given one block
    (the bench's reference until 2026-12: a 64 MiB buffer that each call allocated anew) it reads into the same
    memory over and over: as fast as the reads into the state where that buffer's pages were warm (reused from
    the heap), and half as fast where they were fresh, which made the ratio of a resume swing 2x with the
    allocator's state: printed beside, not judged."""
    reused, at = len(into) <= block, 0
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(into if reused else into[at : at + block]):
                at += 0 if reused else n
    return time.perf_counter() - started


def touched(nbytes: int) -> memoryview:
    """Memory of nbytes, every page written once (faulted in)."""
    return memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())


def drop_page_cache() -> bool:
    """Make the next reads come from the disk (root only); False where that is not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


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
    sync_crc32c: list[float] = field(default_factory=list)
    async_blocked: list[float] = field(default_factory=list)
    async_state_dict: list[float] = field(default_factory=list)
    async_boundary: list[float] = field(default_factory=list)
    async_wait: list[float] = field(default_factory=list)
    step_plain: list[float] = field(default_factory=list)
    step_overlapped: list[float] = field(default_factory=list)
    async_total: list[float] = field(default_factory=list)
    raw_write: list[float] = field(default_factory=list)
    sync_bytes: int = 0
    size: int = 0


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=640)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hpctrain-bench-ckpt"))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: a median of fewer is one noisy moment's figure")
    load_before = os.getloadavg()[0]
    torch.set_num_threads(2)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    cfg = bench_config(args)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    engine.step(BATCH, 1e-4)  # optimizer states exist from here on
    params = sum(p.numel() for p in engine.model.parameters())

    manager = CheckpointManager(
        cfg.checkpoint, cfg.cluster.failure_rate_per_gpu_day, args.dir, "bench", 0, 1, {"model": "bench"}
    )
    engine.before_update = manager.wait_for_staging  # as the training loop wires them
    gc.freeze()  # as the training task does once its engine and manager are built (`train.loop._resume`)
    raw_file = args.dir / "raw.bin"
    saves = measure_saves(args, engine, manager, raw_file)
    loads = {"page cache": measure_loads(args, engine, manager, cold=False)}
    if drop_page_cache():
        loads["disk (cache dropped)"] = measure_loads(args, engine, manager, cold=True)
    print_results(args.dir, params, saves, loads, (load_before, os.getloadavg()[0]))
    shutil.rmtree(args.dir, ignore_errors=True)


def bench_config(args: argparse.Namespace) -> Any:
    """A GPT of --layers x --d-model on one CPU rank, one disk tier under --dir saving every step."""
    return OmegaConf.merge(
        OmegaConf.structured(Config),
        {
            "model": {
                "name": "bench",
                "n_layers": args.layers,
                "d_model": args.d_model,
                "n_heads": 8,
                "vocab_size": 50257,
                "context": 1024,
            },
            "cluster": {"name": "local", "nodes": 1, "gpus_per_node": 1},
            "train": {"global_batch": 1, "micro_batch": 1, "seq_len": 64, "max_steps": 10},
            "optim": {"warmup_steps": 1},
            "run": {"id": "bench"},
            "checkpoint": {
                "tiers": [{"name": "disk", "path": str(args.dir / "tier"), "interval_steps": 1, "keep_last": 1}],
                "when_busy": "wait",
            },
        },
    )


class _NoChecksumFileSystem(FileSystem):
    """DCP's file system with torch.save's record CRC32 off and nothing in its place: the reference for the
    checksum's cost."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" in mode:
            torch.serialization.set_crc32_options(False)  # thread-local: in the writer thread
        with super().create_stream(path, mode) as stream:
            yield stream


def measure_saves(args: argparse.Namespace, engine: Any, manager: CheckpointManager, raw_file: Path) -> Saves:
    """(a) three ways, (b) and the raw write, interleaved per repeat, so that each figure sees the same disk
    weather. (b) is the time of a whole `after_step` that starts a save and books the previous one (finished
    meanwhile, as it would be during the training steps between two saves) and the next training step's time
    beyond a training step without a save, taken just before; the first has nothing to book and allocates the
    staging buffers, so it is left out."""
    saves = Saves()
    for step in range(1, args.repeats + 2):
        target = args.dir / f"sync{step}"

        def default() -> dcp.FileSystemWriter:
            return dcp.FileSystemWriter(str(target))

        def unsummed() -> dcp.FileSystemWriter:
            writer = dcp.FileSystemWriter(str(target))
            writer.fs = _NoChecksumFileSystem()
            return writer

        ways = [
            (saves.sync_blocked, default),
            (saves.sync_nocrc, unsummed),
            (saves.sync_crc32c, lambda: SummingWriter(target, thread_count=1)),
        ]
        for times, make in ways[step % 3 :] + ways[: step % 3]:  # each way first in turn: no order bias
            writer = make()
            times.append(
                synchronous(lambda: dcp.save(engine.state_dict(), storage_writer=writer, no_dist=True), target)
            )
            if make is default:
                saves.sync_bytes = dir_bytes(target)
            shutil.rmtree(target)

        manager._reap_retention(wait=True)  # the previous checkpoint's deletion: between saves, off the clock
        os.sync()
        plain = timed(lambda: engine.step(BATCH, 1e-4))  # a training step with no save running
        boundary = timed(
            lambda: manager.after_step(
                step, engine, {"consumed_samples": step}, manager.control_values(time.monotonic())
            )
        )
        overlapped = timed(lambda: engine.step(BATCH, 1e-4))  # the copy runs meanwhile; the optimizer waits for it
        waited = manager.take_staging_wait()
        for running in manager.in_flight.values():  # the steps between two saves: the write finishes
            running.future.result()
        if step > 1:
            saves.async_blocked.append(boundary + waited)
            saves.async_boundary.append(boundary)
            saves.async_wait.append(waited)
            saves.step_plain.append(plain)
            saves.step_overlapped.append(overlapped)
            started = [e for e in manager.events if e["event"] == "save_started"][-1]
            saves.async_state_dict.append(started["state_dict_s"])
            committed = [e for e in manager.events if e["event"] == "save_committed"][-1]
            saves.async_total.append(committed["total_s"])
            saves.size = committed["bytes"]
            saves.raw_write.append(raw_write(raw_file, saves.size))
        manager.events.clear()
    manager.wait_all()
    return saves


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def synchronous(save: Callable[[], None], target: Path) -> float:
    """Seconds a synchronous save blocks training: from the call until its files are on disk (the disk idle
    at the start: nothing left to write back from the figure before)."""
    os.sync()
    started = time.perf_counter()
    save()
    fsync_tree(target)
    return time.perf_counter() - started


@dataclass
class Loads:
    """Seconds per repeat of the manager's resume, with and without verifying each record as it is read, and of
    a plain sequential read of the same files into memory of their size (`raw`) and into one 64 MiB block."""

    verified: list[float]
    unverified: list[float]
    raw: list[float]
    raw_block: list[float]


def measure_loads(args: argparse.Namespace, engine: Any, manager: CheckpointManager, cold: bool) -> Loads:
    """The three, one after the other per repeat; `cold`: each from the disk (page cache dropped before it),
    else from the page cache (as from a RAM tier, or a file just written)."""
    ckpt = committed_in(args.dir / "tier" / "bench")[-1]  # an absolute tier path gets the run id appended
    files = sorted(ckpt.path.iterdir())
    into = {"raw": touched(sum(p.stat().st_size for p in files)), "raw_block": touched(64 << 20)}
    times: dict[str, list[float]] = {"raw": [], "verified": [], "unverified": [], "raw_block": []}
    raw_read(files, into["raw"])  # warm: the cache holds the files from here on
    ways = list(times)
    for repeat in range(args.repeats):  # what a restart does: find the newest checkpoint, check it, load it
        for way in ways[repeat % 4 :] + ways[: repeat % 4]:  # each way first in turn: no order bias
            if cold:
                drop_page_cache()
            if way in into:
                times[way].append(raw_read(files, into[way]))
                continue
            manager.verify_on_load = way == "verified"
            started = time.perf_counter()
            assert manager.resume(engine)["step"] == ckpt.step
            times[way].append(time.perf_counter() - started)
    manager.verify_on_load = True
    return Loads(**times)


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-repeat ratios of two interleaved measurements (neighbours in time)."""
    return [n / d for n, d in zip(numerators, denominators)]


def verdict(name: str, values: list[float], goal: float, at_most: bool) -> bool:
    """Print one goal: the median of the per-repeat ratios against it, with every repeat's; True when met."""
    value = statistics.median(values)
    met = value <= goal if at_most else value >= goal
    spread = ", ".join(f"{v:.1%}" for v in values)
    print(
        f"  {'PASS' if met else 'FAIL'}  {name}: {value:6.1%} (goal {'<=' if at_most else '>='} {goal:.0%}; "
        f"repeats {spread})"
    )
    return met


def print_results(
    disk: Path, params: int, saves: Saves, loads: dict[str, Loads], load_average: tuple[float, float]
) -> None:
    med = statistics.median
    sb, sn, sc, ab = med(saves.sync_blocked), med(saves.sync_nocrc), med(saves.sync_crc32c), med(saves.async_blocked)
    raw_w, at = med(saves.raw_write), med(saves.async_total)
    sync_bytes, mb = saves.sync_bytes, saves.size / 1e6
    print(
        f"model {params / 1e6:.1f}M params; checkpoint {mb:.0f} MB (model + AdamW states); disk {disk}; "
        f"medians of {len(saves.async_blocked)} interleaved repeats; load average {load_average[0]:.1f} at the "
        f"start, {load_average[1]:.1f} at the end"
    )
    print(
        f"(a) synchronous dcp.save, blocked:         {sb:8.3f} s  ({sync_bytes / 1e6 / sb:7.0f} MB/s)  "
        f"torch.save's CRC32 on (default)"
    )
    print(f"    the same without any checksum:         {sn:8.3f} s  ({sync_bytes / 1e6 / sn:7.0f} MB/s)")
    print(
        f"    the same with hpctrain's CRC32C:       {sc:8.3f} s  ({sync_bytes / 1e6 / sc:7.0f} MB/s)  "
        f"-> checksum cost {sc / sn - 1:+.1%}"
    )
    print(
        f"(b) hpctrain async save, training blocked: {ab:8.3f} s  = {ab / sb:6.1%} of (a), {ab / sn:6.1%} of (a) "
        f"without checksums"
    )
    sd, bd, wt = med(saves.async_state_dict), med(saves.async_boundary), med(saves.async_wait)
    print(f"    at the step boundary (after_step):     {bd:8.3f} s, of which engine.state_dict() {sd:.3f} s")
    print(f"    the next step's wait for the copy:     {wt:8.3f} s")
    sp, so = med(saves.step_plain), med(saves.step_overlapped)
    print(
        f"    not blocked: that step took {so:.3f} s against {sp:.3f} s without a save running "
        f"({statistics.median(ratios(saves.step_overlapped, saves.step_plain)):.2f}x: the copy's and the write's "
        f"threads on the same cores)"
    )
    print(f"    hpctrain async save, start to durable commit: {at:8.3f} s  ({mb / at:7.0f} MB/s)")
    print(f"raw sequential write of {mb:.0f} MB + fsync:   {raw_w:8.3f} s  ({mb / raw_w:7.0f} MB/s)")
    for where, ld in loads.items():
        lv, lu, lr = med(ld.verified), med(ld.unverified), med(ld.raw)
        print(f"from the {where}:")
        print(f"  resume (find, check, load, set state):   {lv:8.3f} s  ({mb / lv:7.0f} MB/s)  records verified")
        print(
            f"    the same without verification:         {lu:8.3f} s  ({mb / lu:7.0f} MB/s)  "
            f"-> verification costs {lv / lu - 1:+.1%} of the load"
        )
        print(f"  raw sequential read into memory:         {lr:8.3f} s  ({mb / lr:7.0f} MB/s)  one thread")
        lb = med(ld.raw_block)
        print(
            f"    the same into one 64 MiB block:        {lb:8.3f} s  ({mb / lb:7.0f} MB/s)  the same memory each "
            f"time: not a load's work (resume at {statistics.median(ratios(ld.raw_block, ld.verified)):.1%} of it)"
        )
    print("goals (median of the per-repeat ratios):")
    met = [
        verdict(
            "async save blocks training, share of a synchronous save",
            ratios(saves.async_blocked, saves.sync_blocked[1:]),
            0.10,
            at_most=True,
        ),
        verdict(
            "save throughput, share of a raw write", ratios(saves.raw_write, saves.async_total), 0.80, at_most=False
        ),
    ]
    met += [
        verdict(f"resume from the {where}, share of a raw read", ratios(ld.raw, ld.verified), 0.80, at_most=False)
        for where, ld in loads.items()
    ]
    print(f"{sum(met)} of {len(met)} goals met")


if __name__ == "__main__":
    main()
