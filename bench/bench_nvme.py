"""NVMe offload vs CPU offload: the optimizer step's time with Adam's moments streamed from a file, against torch's
AdamW with them in host memory (what CPU offload runs), on the same parameters and gradients, in one run; and the
disk's raw throughput measured in the same run, with the share of it the streaming reaches (goal >= 70%).

Raw throughput: a file the size of the moments written, then read, front to back, in the streaming's own chunks,
O_DIRECT (where the file system allows it), no computation, with one and with two transfers in flight (the
streaming has a read and a write in flight at once); the better of the two is the disk's raw rate (`dd bs=<chunk>
oflag=direct` is the first), and a read and a write at once (the streaming's own traffic); the time the disk
needs for the moments is the shorter of serial and simultaneous. Also timed: the streaming's own reads and
writes without the update (how much of the update the I/O hides). On a virtual disk the host's cache can serve
the streaming's pattern (a chunk written back right after it was read) faster than fresh sweeps: a share above
100% says the raw sweeps are not a bound there, not that the streaming beats the disk.
The streaming's share: the time the disk alone needs to read the moments and write them back at those raw rates,
over the optimizer step's measured time (100%: the step takes no longer than its I/O). Repetitions alternate
between the three measures (this machine is noisy) and the medians are reported.

    python bench/bench_nvme.py [--params 50e6] [--chunk-mb 64] [--repeats 5] [--dir /local_nvme] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hpctrain.entry import EntryParser
from hpctrain.parallel.nvme import MomentFile, NvmeAdamW, _aligned_buffer, chunk_elements  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)


def shapes(total: int) -> list[tuple[int, ...]]:
    """A transformer's mix: large matrices, and for each a bias and a norm gain (small tensors share chunks)."""
    d = 4096
    rows = max(1, total // (8 * d))
    out: list[tuple[int, ...]] = []
    for _ in range(8):
        out += [(rows, d), (d,), (d,)]
    return out


def resident_bytes() -> int:
    """This process's resident set (the page cache does not count: O_DIRECT bypasses it anyway)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def timed_step(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def raw_throughput(directory: Path, nbytes: int, block: int, depth: int) -> tuple[float, float, bool]:
    """(write bytes/s, read bytes/s, O_DIRECT) of one file of nbytes in sequential blocks of `block` bytes, with
    `depth` transfers in flight (threads; the streaming has one read and one write in flight)."""
    f = MomentFile(directory, nbytes, rank=99)
    bufs = [_aligned_buffer(block).fill_(7) for _ in range(depth)]
    offsets = list(range(0, nbytes, block))
    try:
        rates = []
        with ThreadPoolExecutor(depth) as pool:
            for op in (f.write, f.read):
                start = time.perf_counter()
                list(
                    pool.map(
                        lambda i: op(bufs[i % depth][: min(block, nbytes - offsets[i])], offsets[i]),
                        range(len(offsets)),
                    )
                )
                rates.append(nbytes / (time.perf_counter() - start))
        return rates[0], rates[1], f.direct
    finally:
        f.close()


def raw_mixed(directory: Path, nbytes: int, block: int) -> float:
    """Bytes/s of reading nbytes and writing nbytes at once (one thread each, sequential blocks, different halves
    of one file): the streaming's own traffic, without the update."""
    f = MomentFile(directory, 2 * nbytes, rank=99)
    bufs = [_aligned_buffer(block).fill_(7) for _ in range(2)]

    def sweep(op: Callable[[torch.Tensor, int], None], buf: torch.Tensor, base: int) -> None:
        for offset in range(0, nbytes, block):
            op(buf[: min(block, nbytes - offset)], base + offset)

    try:
        sweep(f.write, bufs[0], 0)  # the half to be read, written first (a sparse file reads without the disk)
        with ThreadPoolExecutor(2) as pool:
            start = time.perf_counter()
            for future in [pool.submit(sweep, f.read, bufs[0], 0), pool.submit(sweep, f.write, bufs[1], nbytes)]:
                future.result()
            return 2 * nbytes / (time.perf_counter() - start)
    finally:
        f.close()


def main() -> None:
    parser = EntryParser(description=__doc__)
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--chunk-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="the NVMe directory (default: a temporary one here)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="bench_nvme_", dir="/var/tmp"))

    torch.manual_seed(0)
    weights = [torch.randn(s) * 0.02 for s in shapes(int(args.params))]
    grads = [torch.randn_like(w) * 1e-3 for w in weights]
    cpu_params = [torch.nn.Parameter(w.clone()) for w in weights]
    nvme_params = [torch.nn.Parameter(w) for w in weights]
    for a, b, g in zip(cpu_params, nvme_params, grads):
        a.grad, b.grad = g, g
    n = sum(w.numel() for w in weights)
    # host memory each optimizer adds (resident set, first step included: AdamW creates its state there)
    before = resident_bytes()
    cpu = torch.optim.AdamW(groups(cpu_params), **HYPER)
    timed_step(cpu)
    cpu_host = resident_bytes() - before
    before = resident_bytes()
    nvme = NvmeAdamW(groups(nvme_params), directory, chunk_elements(args.chunk_mb), **HYPER)
    timed_step(nvme)  # the first step fills the sparse file
    nvme_host = resident_bytes() - before
    file_bytes = nvme.file.nbytes
    block = max(c.nbytes for c in nvme.chunks)

    cpu_s, nvme_s, read_s, write_s, io_only = [], [], [], [], []
    raw_w: dict[int, list[float]] = {}
    raw_r: dict[int, list[float]] = {}
    mixed: list[float] = []
    for _ in range(args.repeats):
        cpu_s.append(timed_step(cpu))
        before = (nvme.io.read_s, nvme.io.write_s)
        nvme_s.append(timed_step(nvme))
        read_s.append(nvme.io.read_s - before[0])
        write_s.append(nvme.io.write_s - before[1])
        start = time.perf_counter()  # the same reads and writes back, without the update: the streaming's I/O
        nvme._stream(nvme.chunks, lambda chunk, moments: None)
        io_only.append(time.perf_counter() - start)
        for depth in (1, 2):
            w, r, direct = raw_throughput(directory, file_bytes, block, depth)
            raw_w.setdefault(depth, []).append(w)
            raw_r.setdefault(depth, []).append(r)
        mixed.append(raw_mixed(directory, file_bytes, block))
    same = all(torch.equal(a, b) for a, b in zip(cpu_params, nvme_params))
    nvme.close()
    if args.dir is None:
        directory.rmdir()  # the files were unlinked as they were opened

    med = statistics.median
    t_cpu, t_nvme = med(cpu_s), med(nvme_s)
    w, r = max(med(v) for v in raw_w.values()), max(med(v) for v in raw_r.values())  # the disk at its best
    t_disk = min(file_bytes / r + file_bytes / w, 2 * file_bytes / med(mixed))  # serial, or both at once
    out = {
        "params": n,
        "moments_bytes": file_bytes,
        "chunk_bytes": block,
        "o_direct": direct,
        "directory": str(directory),
        "host_bytes_added_cpu_offload": cpu_host,
        "host_bytes_added_nvme_offload": nvme_host,
        "cpu_offload_step_s": t_cpu,
        "nvme_offload_step_s": t_nvme,
        "slowdown": t_nvme / t_cpu,
        "raw_write_gbps": w / 1e9,
        "raw_read_gbps": r / 1e9,
        "raw_by_depth_gbps": {d: {"write": med(raw_w[d]) / 1e9, "read": med(raw_r[d]) / 1e9} for d in raw_w},
        "raw_read_and_write_at_once_gbps": med(mixed) / 1e9,
        "stream_read_busy_s": med(read_s),
        "stream_write_busy_s": med(write_s),
        "stream_io_only_s": med(io_only),
        "disk_bound_s": t_disk,
        "planner_formula_s": max(t_cpu, t_disk),
        "share_of_raw": t_disk / t_nvme,
        "bitwise_equal": same,
    }
    print(
        f"{n / 1e6:.0f}M parameters, moments {file_bytes / 2**30:.2f} GiB in {directory} "
        f"({'O_DIRECT' if direct else 'buffered'}), chunks of {block / 2**20:.0f} MiB, {args.repeats} repeats"
    )
    print(
        f"  host memory the optimizer adds: CPU offload {cpu_host / 2**30:.2f} GiB, NVMe offload "
        f"{nvme_host / 2**30:.2f} GiB (its three chunk buffers)"
    )
    print(f"  optimizer step, CPU offload (AdamW, moments in memory): {t_cpu:7.3f} s")
    print(f"  optimizer step, NVMe offload (moments streamed):        {t_nvme:7.3f} s  ({t_nvme / t_cpu:.2f}x)")
    for d in raw_w:
        print(
            f"  raw disk, {d} transfer(s) in flight: write {med(raw_w[d]) / 1e9:.2f} GB/s, "
            f"read {med(raw_r[d]) / 1e9:.2f} GB/s"
        )
    print(f"  raw disk, a read and a write at once: {med(mixed) / 1e9:.2f} GB/s together")
    print(f"  the moments read and written back at the disk's best: {t_disk:.3f} s")
    print(
        f"  the streaming's own reads and writes, without the update: {med(io_only):.3f} s "
        f"(the update adds {t_nvme - med(io_only):+.3f} s)"
    )
    print(
        f"  the planner's formula (hpctrain/plan/offload.py) on these rates: max(CPU Adam, disk) = "
        f"{max(t_cpu, t_disk):.3f} s, measured {t_nvme:.3f} s ({t_nvme / max(t_cpu, t_disk) - 1:+.0%})"
    )
    print(
        f"  streaming reaches {t_disk / t_nvme:.0%} of the raw throughput (goal >= 70%); weights bitwise equal: {same}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
