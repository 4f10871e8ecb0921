"""Checksums of checkpoint files and of the records in them: computed while DCP writes, checked by `verify`
and while a resume reads.

A bit flipped on a disk, a torn copy between nodes or a truncated file must not load silently: torch.load never
checks torch.save's record CRC32 (and hpctrain writes without it, see `manager.py`), so nothing else would notice
until the loss diverged, thousands of steps later. CRC32C (the checksum of GCS, S3 and iSCSI) is computed in DCP's
writer threads over the bytes as they go to the file, so it costs no extra read. `fastcrc` computes it (the
`crc-fast` crate: carry-less-multiply folding, AVX-512 VPCLMULQDQ or ARM PMULL where the CPU has them, chosen at run
time; the GIL released): 55 GB/s per thread on data in the cache here, twice the `crc32c` package's SSE4.2 `crc32`
instruction (27 GB/s, its ceiling). That matters on a resume from the page cache, where every byte read is summed
and the sum competes with the copy for the same two cores (docs/checkpoint.md). The values are the same: the tests
check them against the `crc32c` package.

Two granularities, from one pass:
- per file (size and CRC32C), gathered into the manifest at the commit: `verify` checks any file against it,
  and `.metadata` (which every rank unpickles first) is checked before it is read;
- per record: DCP asks the stream for its position before and after each item it writes, and a record's bytes
  are exactly that range, so the stream cuts its running CRC there. Each record's CRC is attached to the
  item's `_StorageInfo` (as `checksum`), which DCP gathers to the coordinator and pickles into `.metadata`
  beside the record's offset and length: the reader verifies each record as it reads it (`reader.py`), and
  `verify` names the tensors a damaged file holds. `test_integrity.py` pins this on real saves.

`.metadata` is a pickle, and a checkpoint may come from elsewhere (handed over, on a shared tier outside the run
directory): a crafted one with its sums updated and the manifest resealed passes every check above. So it is never
unpickled by `pickle.load` (DCP's own reader does that): `read_metadata` builds only the classes DCP's metadata
holds (`METADATA_CLASSES`) and refuses anything else with `UnsafeCheckpoint`, naming the file and the class,
before any of it runs. `test_pickle_safety.py` pins the list against real saves of every layout.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fastcrc.crc32 import iscsi as _crc32c
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

ALGORITHM = "crc32c"
METADATA = ".metadata"  # DCP's global metadata file, written by the coordinator (rank 0) only
READ_BYTES = 16 << 20  # a file is checked in reads of this size


def update(data: Any, value: int = 0) -> int:
    """The running CRC32C of `value`'s bytes followed by `data` (any contiguous buffer)."""
    return _crc32c(data, value)


def hexdigest(value: int) -> str:
    return f"{value:08x}"


# CRC32C of a concatenation from the CRCs of its parts (zlib's crc32_combine, for the Castagnoli polynomial):
# the file's CRC is folded from its records' as they are cut, so every byte is summed once.
_POLY = 0x82F63B78  # reflected


def _multmodp(a: int, b: int) -> int:
    """a x b modulo the polynomial, in the reflected bit order of CRC32C."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial


@functools.lru_cache(maxsize=4096)
def _x8nmodp(length: int) -> int:
    """x^(8 x length) modulo the polynomial: what shifting a CRC past `length` bytes multiplies it by (records of
    one shape repeat over layers and optimizer states, so the lengths are few)."""
    p, k = 1 << 31, 3
    while length:
        if length & 1:
            p = _multmodp(_X2N[k], p)
        length >>= 1
        k += 1
    return p


def combine(first: int, second: int, second_length: int) -> int:
    """CRC32C of A + B from CRC32C(A), CRC32C(B) and len(B)."""
    return _multmodp(_x8nmodp(second_length), first) ^ second


class SummingStream(io.RawIOBase):
    """A write stream that keeps the CRC32C of each range between two `tell()` calls (DCP's records) and of the
    whole file (folded from those). A large write goes out in pieces, each summed right after it is copied,
    while it is still in the CPU's cache."""

    PIECE = 4 << 20

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self.size = 0
        self.value = 0
        self._start, self._part = 0, 0
        self.records: dict[int, tuple[int, int]] = {}  # offset -> (length, CRC32C)

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), self.PIECE):
            piece = view[at : at + self.PIECE]
            written = self._raw.write(piece)  # a blocking buffered file: all of it, or an error
            self._part = update(piece[:written], self._part)
            self.size += written
        return len(view)

    def tell(self) -> int:
        self._cut()
        return self.size

    def _cut(self) -> None:
        if self.size > self._start:
            length = self.size - self._start
            self.records[self._start] = (length, self._part)
            self.value = combine(self.value, self._part, length)
            self._start, self._part = self.size, 0

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._cut()
            super().close()  # flushes
            self._raw.close()


class SummingFileSystem(FileSystem):
    """DCP's file system as its writer threads use it: torch.save's record CRC32 off (`manager.py` says why), and
    every stream written through a `SummingStream`, kept by file name for the writer."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.streams: dict[str, SummingStream] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        torch.serialization.set_crc32_options(False)  # thread-local: set in the thread that writes
        with super().create_stream(path, mode) as raw:
            stream = SummingStream(raw)
            yield stream
            stream.close()
        with self._lock:
            self.streams[Path(path).name] = stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """DCP writes `.metadata.tmp` and renames it: the sums follow the name."""
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.streams:
                self.streams[Path(new_path).name] = self.streams.pop(Path(path).name)


class SummingWriter(dcp.FileSystemWriter):
    """DCP's file writer that checksums what it writes: per file (`written`, for the manifest) and per record
    (a `checksum` on each item's storage info, which reaches `.metadata`)."""

    def __init__(self, path: str | os.PathLike, thread_count: int) -> None:
        # No copy-ahead: with one thread DCP's _OverlappingCpuLoader would sync CUDA streams on the save thread,
        # whose current device is GPU 0 (a stray context there from every rank); what hpctrain saves is staged
        # in host memory already, so there is nothing to copy ahead.
        super().__init__(path, thread_count=thread_count, per_thread_copy_ahead=0)
        self.fs: SummingFileSystem = SummingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)  # synchronous: every file is written and fsynced
        for result in future.value():
            info = result.storage_data
            stream = self.fs.streams.get(info.relative_path)
            found = stream.records.get(info.offset) if stream else None
            if found is not None and found[0] == info.length:
                info.checksum = hexdigest(found[1])
        return future

    def written(self) -> dict[str, tuple[int, str]]:
        """Name -> (size, CRC32C) of every file this rank wrote."""
        return {name: (s.size, hexdigest(s.value)) for name, s in self.fs.streams.items()}


# ---------------------------------------------------------------- checking files against their sums
def file_sum(path: Path, start: int = 0, length: int | None = None) -> int:
    """CRC32C of a file's bytes [start, start + length) (to its end when length is None)."""
    value = 0
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        left = length
        while left is None or left > 0:
            n = f.readinto(view if left is None else view[: min(READ_BYTES, left)])
            if not n:
                break
            value = update(view[:n], value)
            left = None if left is None else left - n
    return value


@dataclass(frozen=True)
class Damage:
    """A file whose bytes are not those written, and the records (tensors) hit."""

    file: str
    reason: str
    records: tuple[str, ...] = ()

    def __str__(self) -> str:
        hit = (
            f"; records hit: {', '.join(self.records[:8])}"
            + (f" and {len(self.records) - 8} more" if len(self.records) > 8 else "")
            if self.records
            else ""
        )
        return f"{self.file}: {self.reason}{hit}"


def record_sums(metadata: Any) -> dict[str, list[tuple[int, int, str | None, str]]]:
    """File -> [(offset, length, checksum or None, record name)] of a DCP checkpoint's `.metadata`, by offset."""
    out: dict[str, list[tuple[int, int, str | None, str]]] = {}
    for index, info in metadata.storage_data.items():
        name = index.fqn if not index.offset or not any(index.offset) else f"{index.fqn}@{list(index.offset)}"
        out.setdefault(info.relative_path, []).append((info.offset, info.length, getattr(info, "checksum", None), name))
    for records in out.values():
        records.sort()
    return out


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file whose pickle asks for something DCP's checkpoints never hold (a function, another
    class): unpickling it could run code, so it is refused before anything in it runs."""

    def __init__(self, file: str, forbidden: str, detail: str = "") -> None:
        reason = detail or (
            f"its pickle asks for {forbidden}, which DCP's checkpoint files never hold; unpickling it could run code"
        )
        self.reason = (
            f"refused to load: {reason}. This checkpoint is not as a DCP save wrote it (crafted, or "
            "altered after the save with its checksums and manifest updated to match): resume or export "
            "only checkpoints your own runs wrote, and remove this one"
        )
        super().__init__(f"{file}: {self.reason}")
        self.file = file
        self.forbidden = forbidden
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers a rank's exception to every rank, pickled
        return UnsafeCheckpoint, (self.file, self.forbidden, self.detail)


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Every class and function a DCP `.metadata` pickle of torch 2.13 names, found by unpickling the metadata of real
# saves of every layout hpctrain writes (DDP, ZeRO-1, FSDP2 and TP DTensor shards, pipeline stages, CPU and NVMe
# offload, fp16 with its loss scaler: `test_pickle_safety.py`), and nothing else. Builtin containers (dict,
# list, tuple, str, int, float, bool, None) are pickle opcodes, not classes: they need no entry.
METADATA_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),  # a non-tensor value (the fp16 loss scaler's scale and counter)
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "StorageMeta"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup by name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the save wrote
    }
)
# A dtype pickles as the `torch` attribute of its name (torch.float32): every dtype torch has, looked up in the
# module's own dict (a getattr could import a lazy submodule).
TORCH_DTYPES: frozenset[str] = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`, building only `METADATA_CLASSES` and torch dtypes."""

    def __init__(self, file: Any, name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(self._name, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(self._name, f"a persistent object ({str(pid)[:80]})")


def read_metadata(path: Path | str) -> Metadata:
    """A DCP checkpoint's `.metadata`, unpickled with only DCP's metadata classes allowed (`UnsafeCheckpoint`
    for anything else, before it runs), and checked to be DCP's `Metadata` whose records lie in files of the
    checkpoint's own directory."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        kind = type(metadata).__name__
        raise UnsafeCheckpoint(str(path), kind, f"it holds a {kind} where DCP writes its Metadata")
    records = metadata.storage_data if metadata.storage_data is not None else {}
    for info in records.values() if isinstance(records, dict) else [records]:
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(info, _StorageInfo)
            or not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or os.sep in name
        ):
            raise UnsafeCheckpoint(
                str(path),
                repr(name),
                f"it places a record in {name!r}, which is not a file of the checkpoint's own directory",
            )
    return metadata


def damaged_records(path: Path, records: list[tuple[int, int, str | None, str]]) -> list[str]:
    """The records of a file whose bytes do not match their CRC32C (those past the file's end included)."""
    size = path.stat().st_size
    bad = []
    for offset, length, checksum, name in records:
        if offset + length > size:
            bad.append(f"{name} (bytes {offset}..{offset + length}: past the end)")
        elif checksum is not None and hexdigest(file_sum(path, offset, length)) != checksum:
            bad.append(f"{name} (bytes {offset}..{offset + length})")
    return bad


def check_files(directory: Path, manifest: dict[str, Any], names: list[str] | None = None) -> list[Damage]:
    """Every listed file (default: all in the manifest) against its size and CRC32C; for a damaged data file,
    which records it hits (from `.metadata`'s per-record sums, when `.metadata` itself is sound)."""
    sizes: dict[str, int] = manifest.get("files", {})
    sums: dict[str, str] = manifest.get(ALGORITHM, {})
    damage: list[Damage] = []
    for name in names if names is not None else sorted(sizes):
        path = directory / name
        if not path.is_file():
            continue  # a missing file is a structural problem (`storage.verify`), or a peer's on a node-local tier
        size = path.stat().st_size
        if size != sizes.get(name, size):
            damage.append(Damage(name, f"{size} bytes, the manifest says {sizes[name]}"))
        elif name in sums and hexdigest(file_sum(path)) != sums[name]:
            damage.append(Damage(name, f"{ALGORITHM} mismatch (the manifest says {sums[name]})"))
    if not damage or any(d.file == METADATA for d in damage) or not (directory / METADATA).is_file():
        return damage
    try:
        per_file = record_sums(read_metadata(directory / METADATA))
    except UnsafeCheckpoint as err:  # the records cannot be named: say why, beside the damage found
        return [*damage, Damage(METADATA, err.reason)]
    return [
        Damage(d.file, d.reason, tuple(damaged_records(directory / d.file, per_file.get(d.file, [])))) for d in damage
    ]


# ---------------------------------------------------------------- the manifest's own sum
SELF = "manifest_crc32c"


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with a CRC32C of its own content: a torn or edited manifest is told from a sound one."""
    body = {k: v for k, v in manifest.items() if k != SELF}
    return {**body, SELF: hexdigest(update(json.dumps(body, sort_keys=True).encode()))}


def seal_problem(manifest: dict[str, Any]) -> str | None:
    """Why a manifest cannot be trusted (None when it can; a manifest from before seals were written can)."""
    if SELF not in manifest:
        return None
    expected = seal(manifest)[SELF]
    return None if manifest[SELF] == expected else f"manifest {ALGORITHM} {manifest[SELF]} != {expected} of its content"
