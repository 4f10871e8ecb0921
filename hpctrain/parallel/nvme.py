"""NVMe offload of the optimizer state (zero.offload_optimizer_device=nvme): ZeRO-Infinity's optimizer tier on FSDP2.

CPU offload (FSDP2's CPUOffloadPolicy) keeps each rank's fp32 shards of parameters, gradients and Adam's two
moments in host memory and steps AdamW on the CPU: 16 bytes per parameter of the shard. Here the moments
(exp_avg, exp_avg_sq: 8 of those 16 bytes) live in one file per rank under zero.nvme_path, and each step streams
them through host memory in chunks, in a ring of three buffers: chunk k+1 is read while chunk k is updated and
chunk k-1 is written back. The file is opened with O_DIRECT where the file system allows it (the page cache
would otherwise hold the very bytes this is meant to keep out of memory) and unlinked at once, so its space is
freed when the process ends, however it ends.

The master weights stay in host memory: under FSDP2 the fp32 shard *is* the parameter, and the all-gather of
every forward reads it. Moving it to NVMe too needs a second, half-precision resident copy for the all-gather
(what DeepSpeed's ZeRO-Infinity keeps on the GPU) and gives up the bitwise match below.

The update is torch's own AdamW kernel (torch.optim.adam.adam, fused, decoupled weight decay: what
hpctrain.parallel.optimizer's AdamW runs on CPU tensors) on views of each chunk, with the same hyperparameters
and step counts: the same element-wise operations on the same values as CPU offload, so the weights are
bitwise those of CPU offload (tests/parallel/test_nvme_offload.py, on real ranks, through a checkpoint and a
resume). It takes no `found_inf` (a skipped step must not stream the moments): the engine reads the step's
verdict first and steps it only when finite (hpctrain.parallel.engine, `skips_on_device`).

Checkpoints: `state_dict()` reads the moments back into tensors (DTensors shaped as their parameters, so DCP
saves and reshards them like any other state) and `load_state_dict()` writes loaded ones into this rank's file.
A resume needs nothing of the old files.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from hpctrain.hardware import format_bytes

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT: file offsets, sizes and buffer addresses in multiples of the logical block
SPLIT = 4096  # elements: a parameter's shard is split between chunks only at multiples of this
MOMENTS = ("exp_avg", "exp_avg_sq")
ON_NVME = "nvme"  # what optimizer.state[p][moment] holds between steps: the values are in the file
RING = 3  # buffers: one being read, one being updated, one being written


class NvmePathError(OSError):
    """zero.nvme_path cannot hold this rank's moments (not writable, too small)."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + length) of parameter `param`'s local shard, at `offset` in its chunk."""

    param: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class Chunk:
    """What one read brings in: `elements` of exp_avg, then as many of exp_avg_sq, at `offset` in the file."""

    offset: int
    elements: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return _round_up(2 * 4 * self.elements, ALIGN)


def plan_chunks(sizes: list[int], chunk_elements: int) -> list[Chunk]:
    """Pack the shards (`sizes`: elements of each parameter's local shard, in the optimizer's order) into
    chunks of at most `chunk_elements` per moment: small parameters share a chunk (one read for many biases),
    a large one spans several, split at multiples of SPLIT elements."""
    if chunk_elements < SPLIT or chunk_elements % SPLIT:
        raise ValueError(f"chunk_elements must be a positive multiple of {SPLIT}, got {chunk_elements}")
    chunks: list[Chunk] = []
    segments: list[Segment] = []
    fill, offset = 0, 0

    def close() -> None:
        nonlocal segments, fill, offset
        if segments:
            chunk = Chunk(offset, fill, tuple(segments))
            chunks.append(chunk)
            offset += chunk.nbytes
        segments, fill = [], 0

    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(size - start, chunk_elements - fill)
            if start + take < size:  # a split inside the parameter: at a multiple of SPLIT
                take -= (start + take) % SPLIT
            if take <= 0:
                close()
                continue
            segments.append(Segment(index, start, take, fill))
            fill += take
            start += take
            if fill == chunk_elements:
                close()
    close()
    return chunks


def _aligned_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of host memory starting at an ALIGN boundary (O_DIRECT's rule for user buffers)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    pad = (-raw.data_ptr()) % ALIGN
    return raw[pad : pad + nbytes]


@dataclass
class IoStats:
    """Bytes and seconds of this optimizer's NVMe traffic, and of its steps (what bench/bench_nvme.py reads)."""

    read_bytes: int = 0
    read_s: float = 0.0
    write_bytes: int = 0
    write_s: float = 0.0
    steps: int = 0
    step_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            setattr(self, f"{kind}_bytes", getattr(self, f"{kind}_bytes") + nbytes)
            setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)


class MomentFile:
    """One rank's moments on disk: positioned reads and writes of whole chunks (the GIL is released while the
    kernel copies, so reads, the update and writes overlap)."""

    def __init__(self, directory: Path, nbytes: int, rank: int) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=directory, prefix=f"hpctrain-rank{rank}-", suffix=".adam")
        except OSError as exc:
            raise NvmePathError(
                f"zero.nvme_path={directory}: cannot create the optimizer's moments file there "
                f"({exc}); set zero.nvme_path to a writable node-local directory"
            ) from exc
        try:
            try:
                self.fd = os.open(name, os.O_RDWR | getattr(os, "O_DIRECT", 0))
                self.direct = hasattr(os, "O_DIRECT")
                os.close(fd)
            except OSError:  # tmpfs and some network file systems refuse O_DIRECT
                self.fd, self.direct = fd, False
            self._reserve(directory, nbytes)
            if self.direct:
                self._probe(name)
        finally:
            os.unlink(name)
        self.path, self.nbytes = name, nbytes
        log.info(
            "optimizer moments: %s in %s (deleted; %s)",
            format_bytes(nbytes),
            name,
            "O_DIRECT" if self.direct else "buffered: the file system refuses O_DIRECT",
        )

    def _reserve(self, directory: Path, nbytes: int) -> None:
        """The file's space, taken now: a drive too small for every rank's moments fails at the start, naming
        the key, not with ENOSPC in the middle of a step. Reads of the reserved space give zeros: Adam's
        initial moments."""
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                os.close(self.fd)
                free = shutil.disk_usage(directory).free
                raise NvmePathError(
                    f"zero.nvme_path={directory}: this rank's optimizer moments need "
                    f"{format_bytes(nbytes)}, {format_bytes(free)} are free there (every rank "
                    "of the node takes as much); free space, use a larger drive, or shard over "
                    "more ranks"
                ) from exc
            os.ftruncate(self.fd, nbytes)  # no fallocate here (O_DIRECT refuses glibc's emulation): sparse

    def _probe(self, name: str) -> None:
        """Some file systems accept O_DIRECT at open and fail the first transfer: fall back to buffered I/O."""
        try:
            os.preadv(self.fd, [_aligned_buffer(ALIGN).numpy().data], 0)
        except OSError:
            os.close(self.fd)
            self.fd, self.direct = os.open(name, os.O_RDWR), False

    def read(self, buf: torch.Tensor, offset: int) -> None:
        self._transfer(os.preadv, buf, offset)

    def write(self, buf: torch.Tensor, offset: int) -> None:
        self._transfer(os.pwritev, buf, offset)
        if not self.direct:  # keep the page cache from holding what was just written (once it is clean)
            os.posix_fadvise(self.fd, offset, buf.numel(), os.POSIX_FADV_DONTNEED)

    def _transfer(self, call: Callable[..., int], buf: torch.Tensor, offset: int) -> None:
        view = buf.numpy().data
        done = 0
        while done < len(view):
            n = call(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{call.__name__} at byte {offset + done} of {self.path}: no progress")
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    local = _local(t)
    if not local.is_contiguous():
        raise RuntimeError(
            f"NVMe offload steps contiguous shards in place; this {what} is not "
            f"(shape {tuple(local.shape)}, stride {local.stride()})"
        )
    return local.view(-1)


class NvmeAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose moments live in a file on NVMe (see the module docstring).

    Everything else is AdamW's own: param_groups, hyperparameters, the per-parameter step count in `state`,
    state_dict's format (the moments are read back for it)."""

    def __init__(self, params: Any, directory: str | Path, chunk_elements: int, rank: int = 0, **defaults: Any) -> None:
        if defaults.get("amsgrad") or defaults.get("fused") or defaults.get("foreach"):
            raise ValueError(
                "NVMe offload runs AdamW's fused CPU kernel on each chunk itself: no amsgrad, fused or foreach flags"
            )
        super().__init__(params, **defaults)
        self.params = [p for group in self.param_groups for p in group["params"]]
        devices = {_local(p).device.type for p in self.params}
        if devices != {"cpu"}:
            raise ValueError(
                f"NVMe offload steps the optimizer on the CPU, but parameters are on {devices}: it "
                "needs FSDP2's CPU offload (zero.stage>=2 with dp>1) to keep the shards in host memory"
            )
        self.chunks = plan_chunks([_local(p).numel() for p in self.params], chunk_elements)
        size = self.chunks[-1].offset + self.chunks[-1].nbytes if self.chunks else ALIGN
        self.file = MomentFile(Path(directory), size, rank)
        self.ring = [
            _aligned_buffer(max(c.nbytes for c in self.chunks) if self.chunks else ALIGN)
            for _ in range(min(RING, len(self.chunks)) or 1)
        ]
        self.io = IoStats()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-nvme-write")

    # ---- streaming ------------------------------------------------------------------------------------------

    def _timed(self, kind: str, fn: Callable[[torch.Tensor, int], None]) -> Callable[[torch.Tensor, int], None]:
        def run(buf: torch.Tensor, offset: int) -> None:
            start = time.perf_counter()
            fn(buf, offset)
            self.io.add(kind, buf.numel(), time.perf_counter() - start)

        return run

    def _stream(
        self, chunks: list[Chunk], work: Callable[[Chunk, torch.Tensor], None], read: bool = True, write: bool = True
    ) -> None:
        """work(chunk, its moments as float32 [2, elements]) for each chunk, chunk k+1 read while chunk k is
        worked on and chunk k-1 written; returns when every write is on disk (or in the page cache)."""
        read_fn, write_fn = self._timed("read", self.file.read), self._timed("write", self.file.write)
        writes: list[Future[None] | None] = [None] * len(self.ring)
        reads: dict[int, Future[None]] = {}

        def buffer(i: int) -> torch.Tensor:
            return self.ring[i % len(self.ring)][: chunks[i].nbytes]

        def fetch(i: int) -> None:
            slot = i % len(self.ring)
            pending = writes[slot]
            if pending is not None:  # the buffer's previous chunk must be on its way to disk first
                pending.result()
                writes[slot] = None
            if read:
                reads[i] = self._reader.submit(read_fn, buffer(i), chunks[i].offset)

        try:
            if chunks:
                fetch(0)
            for i, chunk in enumerate(chunks):
                if i in reads:
                    reads.pop(i).result()
                if i + 1 < len(chunks):
                    fetch(i + 1)
                buf = buffer(i)
                work(chunk, buf[: 2 * 4 * chunk.elements].view(torch.float32).view(2, chunk.elements))
                if write:
                    writes[i % len(self.ring)] = self._writer.submit(write_fn, buf, chunk.offset)
        finally:
            for future in [*reads.values(), *writes]:
                if future is not None:
                    future.result()

    # ---- the step -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        stepping = {i for i, p in enumerate(self.params) if p.grad is not None}
        before: dict[int, torch.Tensor] = {}
        for i in stepping:  # the state AdamW creates lazily, the moments' place held by ON_NVME
            state = self.state[self.params[i]]
            if "step" not in state:
                state.update(step=torch.tensor(0.0, dtype=torch.float32), **dict.fromkeys(MOMENTS, ON_NVME))
            before[i] = state["step"].clone()
            state["step"] += 1

        group_of = {id(p): group for group in self.param_groups for p in group["params"]}  # load_state_dict
        # replaces the groups (and the loop sets each step's lr in the new ones): looked up at every step

        def update(chunk: Chunk, moments: torch.Tensor) -> None:
            for seg in chunk.segments:
                if seg.param not in stepping:
                    continue
                p = self.params[seg.param]
                group = group_of[id(p)]
                span = slice(seg.start, seg.start + seg.length)
                here = slice(seg.offset, seg.offset + seg.length)
                beta1, beta2 = group["betas"]
                adam(
                    [_flat(p, "parameter")[span]],
                    [_flat(p.grad, "gradient")[span]],
                    [moments[0, here]],
                    [moments[1, here]],
                    [],
                    [before[seg.param].clone()],
                    foreach=False,
                    capturable=False,
                    differentiable=False,
                    fused=True,
                    grad_scale=None,
                    found_inf=None,
                    has_complex=False,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                )

        self._stream([c for c in self.chunks if any(s.param in stepping for s in c.segments)], update)
        self.io.steps += 1
        self.io.step_s += time.perf_counter() - start
        return loss

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def read_moments(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's moments read back from the file, shaped and placed like the parameter."""
        out = {
            i: {m: torch.zeros_like(_local(p)) for m in MOMENTS}
            for i, p in enumerate(self.params)
            if "step" in self.state.get(p, {})
        }

        def gather(chunk: Chunk, moments: torch.Tensor) -> None:
            for seg in chunk.segments:
                if seg.param in out:
                    for row, name in enumerate(MOMENTS):
                        out[seg.param][name].view(-1)[seg.start : seg.start + seg.length].copy_(
                            moments[row, seg.offset : seg.offset + seg.length]
                        )

        self._stream(self.chunks, gather, write=False)
        return {i: {m: _like(self.params[i], t) for m, t in moments.items()} for i, moments in out.items()}

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for index, moments in self.read_moments().items():
            sd["state"][index] = {**sd["state"][index], **moments}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        loaded = {
            i: {m: _flat(self.state[p][m], "moment") for m in MOMENTS}
            for i, p in enumerate(self.params)
            if all(isinstance(self.state.get(p, {}).get(m), torch.Tensor) for m in MOMENTS)
        }

        def scatter(chunk: Chunk, moments: torch.Tensor) -> None:
            moments.zero_()  # a parameter without loaded state starts from zeros, as AdamW's does
            for seg in chunk.segments:
                if seg.param in loaded:
                    for row, name in enumerate(MOMENTS):
                        moments[row, seg.offset : seg.offset + seg.length].copy_(
                            loaded[seg.param][name][seg.start : seg.start + seg.length]
                        )

        self._stream(self.chunks, scatter, read=False)
        for i in loaded:
            self.state[self.params[i]].update(dict.fromkeys(MOMENTS, ON_NVME))

    def close(self) -> None:
        self._reader.shutdown()
        self._writer.shutdown()
        self.file.close()


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


def chunk_elements(chunk_mb: float) -> int:
    """zero.nvme_chunk_mb (MiB of each moment) in elements, a multiple of SPLIT."""
    return max(SPLIT, int(chunk_mb * 2**20) // 4 // SPLIT * SPLIT)
