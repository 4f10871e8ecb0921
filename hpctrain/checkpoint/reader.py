"""Reading a DCP checkpoint at the speed of the disk, checking each record's CRC32C on the way.

DCP's `FileSystemReader` reads a rank's files one after the other and each record through `torch.load` (zip
parsing and unpickling: most of a resume's time once the bytes are in the page cache), then copies the tensor
into its destination. `FastReader` parses a record's torch.save zip itself: its central directory (at the
record's end), `data.pkl` (dtype, size, stride: a restricted unpickler builds nothing) and the storage's local
header, then reads the storage's bytes straight into the destination tensor when the request is the whole
stored tensor and the destination a contiguous CPU tensor of its dtype and shape (a resume in the layout that
saved it). Any other request (resharding, a GPU, strided or other-dtype destination) reads the storage into a
CPU buffer and copies from there as DCP does; a record the parser does not recognise (a new torch.save format:
`test_reader.py` pins the current one) goes through `torch.load` as in DCP. `stats` counts which way each
request went. Small records are read in runs (one call for up to 1 MiB), a large one in three (its end, its
head, its storage); the files are read by a pool of threads, each file in parts of consecutive records in
offset order.

Each record's bytes are checked against the CRC32C the writer stored beside its offset in `.metadata`
(`integrity.py`), chained over the parts as they are read, in file order: a flipped bit or a cut file raises
`CorruptCheckpoint` naming the file and the tensors instead of resuming from damaged state. Whatever a damaged
header says is bounded by the record before it is used, so a record that cannot be checked (`verify` off, or
a checkpoint from before checksums) loads or fails as unreadable, never worse. A load that raises has written
part of the state: it must not be used.

Nothing a checkpoint holds is unpickled without a restriction: `.metadata` through `integrity.read_metadata`
(DCP's own `read_metadata` would `pickle.load` it), tensor records through the parser's own unpickler or
`torch.load(weights_only=True)`, and non-tensor values (DCP's byte records, which its planner would
`torch.load(weights_only=False)`) through `torch.load(weights_only=True)`: a record that asks for anything else
raises `UnsafeCheckpoint`, naming the file, the record and what it asked for, before any of it runs.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import pickletools
import re
import struct
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hpctrain.checkpoint.integrity import UnsafeCheckpoint, read_metadata, update

SMALL = 1 << 20  # a record up to this size is read whole in one call and its storage copied out of the buffer
SHARES = 4  # parts of the requested bytes per reading thread: whichever thread is free takes the next
PIECE = 1 << 20  # a large record's storage is read and summed in pieces of this size: each summed while in L2
TAIL = 4096  # the end of a larger record read first: the zip64 end records and the central directory
MAX_THREADS = 4  # reading threads at most (more were never measured)
HEAD_SLACK = 512  # read past the storage's local header offset: its header, name and alignment padding

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_FULL = 0xFFFFFFFF  # a 32-bit zip field whose value is in the zip64 extra field

_STORAGE_DTYPES = {  # torch.save's pickled storage classes (their `.dtype` warns that TypedStorage is deprecated)
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")  # what torch.load(weights_only=True) names when it refuses


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file whose records do not hold the bytes written (CRC32C), cannot be parsed or are cut."""

    def __init__(self, file: str, records: list[str], problems: list[str]) -> None:
        super().__init__(f"{file}: {'; '.join(problems)}")
        self.file = file
        self.records = records
        self.problems = problems

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers a rank's exception to every rank, pickled
        return CorruptCheckpoint, (self.file, self.records, self.problems)


@dataclass(frozen=True)
class Stored:
    """Where a torch.save record keeps its tensor: the storage's bytes [start, end) of the record."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    start: int
    end: int

    def whole(self) -> bool:
        """The storage holds exactly the tensor, row-major: its bytes are the tensor's."""
        expected, row_major = 1, True
        for n, step in zip(reversed(self.size), reversed(self.stride)):
            row_major = row_major and (n == 1 or step == expected)
            expected *= n
        return (
            (row_major or expected == 0)
            and self.storage_offset == 0
            and expected * self.dtype.itemsize == self.end - self.start
        )

    def fits(self) -> bool:
        """The tensor lies within its storage."""
        if min((*self.size, *self.stride, self.storage_offset), default=0) < 0:
            return False
        last = self.storage_offset + sum((n - 1) * step for n, step in zip(self.size, self.stride))
        return 0 in self.size or last < (self.end - self.start) // self.dtype.itemsize

    def tensor(self, storage: torch.Tensor) -> torch.Tensor:
        """The stored tensor over its storage's bytes (a uint8 tensor)."""
        return storage.view(self.dtype).as_strided(self.size, self.stride, self.storage_offset)


# ---------------------------------------------------------------- torch.save's zip record
class Directory(NamedTuple):
    """The entries of a record's zip that locate its tensor: (local header offset, size) each."""

    pickled: tuple[int, int]  # data.pkl
    byteorder: tuple[int, int]
    storage: tuple[int, int]  # data/<key>
    key: str


def directory(tail: bytes | memoryview, tail_start: int) -> Directory | None:
    """A record's zip directory, from its bytes [tail_start, end) in `tail`; None for a format not understood."""
    if len(tail) < _EOCD.size:
        return None
    sig, _, _, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != b"PK\x05\x06" or comment:
        return None
    at = len(tail) - _EOCD.size - _ZIP64_LOCATOR.size
    if at >= 0 and tail[at : at + 4] == b"PK\x06\x07":  # torch.save always writes the zip64 end records
        z64 = _ZIP64_LOCATOR.unpack_from(tail, at)[2] - tail_start
        if not 0 <= z64 <= len(tail) - _ZIP64_EOCD.size or tail[z64 : z64 + 4] != b"PK\x06\x06":
            return None
        count, cd_size, cd_offset = _ZIP64_EOCD.unpack_from(tail, z64)[7:10]
    at = cd_offset - tail_start
    if at < 0 or at + cd_size > len(tail):
        return None
    return _entries(bytes(tail[at : at + cd_size]), count)


@functools.lru_cache(maxsize=256)
def _entries(central: bytes, count: int) -> Directory | None:
    """Parsed once per distinct directory: without torch.save's CRC32s, records of one shape share theirs."""
    found: dict[str, tuple[int, int]] = {}
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > len(central):
            return None
        (sig, _, _, flags, method, _, _, _, packed, size, name_len, extra_len, comment_len, _, _, _, local) = (
            _CENTRAL.unpack_from(central, at)
        )
        if sig != b"PK\x01\x02" or method != 0 or flags & 1:  # stored, not encrypted
            return None
        name = central[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode(errors="replace").partition("/")[2]
        if _FULL in (packed, size, local):
            extra = central[at + _CENTRAL.size + name_len : at + _CENTRAL.size + name_len + extra_len]
            if (wide := _zip64_fields(extra, packed, size, local)) is None:
                return None
            size, local = wide
        found[name] = (local, size)
        at += _CENTRAL.size + name_len + extra_len + comment_len
    storages = [name for name in found if name.startswith("data/")]
    if len(storages) != 1 or "data.pkl" not in found or "byteorder" not in found:
        return None
    return Directory(found["data.pkl"], found["byteorder"], found[storages[0]], storages[0][len("data/") :])


def _zip64_fields(extra: bytes, packed: int, size: int, local: int) -> tuple[int, int] | None:
    """(size, local header offset) of a central directory entry whose 32-bit fields are full, from its zip64
    extra field (which holds, in order, those of size, packed size and offset that are full)."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 1 and at + 4 + length <= len(extra):
            values = iter(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            fields = [next(values, None) if value == _FULL else value for value in (size, packed, local)]
            return None if None in fields else (cast(int, fields[0]), cast(int, fields[2]))
        at += 4 + length
    return None


def locate(head: bytes | memoryview, found: Directory, length: int) -> Stored | None:
    """The tensor a record of `length` bytes holds and where its storage is, from the record's first bytes `head`
    (through the storage's local header); None when it is not one little-endian tensor this parser understands
    (or a damaged one: what it says must lie within the record)."""
    if _entry(head, *found.byteorder) != b"little" or (pickled := _entry(head, *found.pickled)) is None:
        return None
    spec = _spec(pickled)
    start = _data_start(head, found.storage[0])
    if spec is None or start is None:
        return None
    dtype, key, numel, storage_offset, size, stride = spec
    if key != found.key or found.storage[1] != numel * dtype.itemsize or start + found.storage[1] > length:
        return None
    stored = Stored(dtype, size, stride, storage_offset, start, start + found.storage[1])
    return stored if stored.fits() else None


def _data_start(head: bytes | memoryview, local: int) -> int | None:
    if local + _LOCAL.size > len(head) or head[local : local + 4] != b"PK\x03\x04":
        return None
    name_len, extra_len = _LOCAL.unpack_from(head, local)[9:11]
    start = local + _LOCAL.size + name_len + extra_len
    return start if start <= len(head) else None


def _entry(head: bytes | memoryview, local: int, size: int) -> bytes | None:
    start = _data_start(head, local)
    return None if start is None or start + size > len(head) else bytes(head[start : start + size])


@functools.lru_cache(maxsize=256)
def _spec(pickled: bytes) -> tuple[Any, ...] | None:
    """(dtype, storage key, storage numel, storage_offset, size, stride) from a record's `data.pkl`, unpickled
    once per distinct pickle (tensors of one shape share theirs); None for anything but one plain tensor."""
    try:
        for _ in pickletools.genops(pickled):  # lengths checked first: a damaged one may claim exabytes
            pass
        spec = _Unpickler(io.BytesIO(pickled)).load()
    except Exception:  # a damaged pickle fails in many ways, none of them ours to raise
        return None
    return spec if isinstance(spec, tuple) and len(spec) == 6 else None


def _rebuild(
    storage: tuple[torch.dtype, str, int],
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    hooks: dict[Any, Any],
    *metadata: Any,
) -> tuple[Any, ...]:
    """`torch._utils._rebuild_tensor_v2` as data: a tensor with Python state (metadata) is not understood."""
    if (
        hooks
        or any(metadata)
        or len(size) != len(stride)
        or not all(isinstance(n, int) for n in (storage_offset, *size, *stride))
    ):
        raise pickle.UnpicklingError("not a plain tensor")
    return (*storage, storage_offset, tuple(size), tuple(stride))


class _Unpickler(pickle.Unpickler):
    """Unpickles a record's `data.pkl` into `_spec`'s tuple, building nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return name  # persistent_load maps it to its dtype
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[torch.dtype, str, int]:
        kind, storage_type, key, _, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(kind)
        return _STORAGE_DTYPES[storage_type], key, numel


# ---------------------------------------------------------------- reading
class _Damaged(Exception):
    """A record that is not as written: how, with `{record}` where its name and bytes go."""


def _fill(fd: int, views: list[memoryview], offset: int) -> None:
    """Read the file from `offset` into `views`, all of them (a read returns at most 2 GiB on Linux)."""
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            raise _Damaged("{record} is cut short")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _check(value: int, checksum: str | None) -> None:
    if checksum is not None and f"{value:08x}" != checksum:
        raise _Damaged("checksum mismatch in {record}")


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, writable (as uint8 first: numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def reading_threads() -> int:
    """One reading thread per core this process may run on, at most MAX_THREADS. From the page cache a read is a
    copy and a CRC32C, both CPU work: a thread more than the cores only waits for one (2 threads read 2-3% faster
    than 4 on 2 cores, docs/checkpoint.md). A GPU node's rank has its cores (`cpus_per_task`) and gets 4."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


class _Dest(NamedTuple):
    """A request's destination, resolved before the reads start (its bytes when it is a contiguous CPU tensor):
    the reading threads then make no torch calls on the direct path, each of which would hand the GIL over."""

    tensor: torch.Tensor
    memory: memoryview | None
    dtype: torch.dtype
    shape: tuple[int, ...]


class _Record(NamedTuple):
    info: _StorageInfo
    reqs: list[ReadItem]  # the requests for it: several when it is split between destination shards
    dest: _Dest | None  # when one request reads it from its start


class FastReader(dcp.FileSystemReader):
    """DCP's file reader that reads records straight into their destinations, a rank's files in parallel, and
    checks each record's CRC32C (when `.metadata` holds one and `verify` is on)."""

    def __init__(self, path: str | os.PathLike, verify: bool = True, threads: int | None = None) -> None:
        super().__init__(path)
        self.verify = verify
        self.threads = threads or reading_threads()
        self.stats: Counter[str] = Counter()  # read requests by way: direct, staged, torch_load, bytes
        self._planner_lock = threading.Lock()  # DCP's planners are written for one reading thread
        self._metadata: dict[str, Metadata] = {}  # by path: a load asks twice (its caller plans, then dcp.load)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's `read_metadata`, unpickled with only DCP's metadata classes allowed (`integrity.read_metadata`):
        a crafted `.metadata` raises `UnsafeCheckpoint` before anything in it runs. Parsed once per reader and
        file: `load_state` reads it to plan, then `dcp.load` again (each parse is about 2% of a resume's CPU time)."""
        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        metadata = self._metadata.get(path)
        if metadata is None:
            metadata = self._metadata[path] = read_metadata(path)
        storage = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_index: dict[Any, list[ReadItem]] = {}
        for req in plan.items:
            per_index.setdefault(req.storage_index, []).append(req)
        per_file: dict[str, list[_Record]] = {}
        for index, reqs in per_index.items():
            info: _StorageInfo = self.storage_data[index]
            one = len(reqs) == 1 and reqs[0].type == LoadItemType.TENSOR and not any(reqs[0].storage_offsets)
            record = _Record(info, reqs, _resolve(planner, reqs[0]) if one else None)
            per_file.setdefault(info.relative_path, []).append(record)
        for name, records in per_file.items():
            records.sort(key=lambda r: r.info.offset)
            _check_size(name, records, os.stat(self.fs.concat_path(self.path, name)).st_size)
        # Each file in parts of consecutive records, the files' parts interleaved: a file's records are read in
        # offset order, and the threads (each taking the next part when done) all have work until the end.
        share = max(SMALL, sum(r.info.length for rs in per_file.values() for r in rs) // (SHARES * self.threads))
        parts = {name: _parts(records, share) for name, records in per_file.items()}
        jobs = [
            (name, part[i])
            for i in range(max(map(len, parts.values()), default=0))
            for name, part in parts.items()
            if i < len(part)
        ]
        with ThreadPoolExecutor(max(1, min(self.threads, len(jobs))), thread_name_prefix="fast-reader") as pool:
            done = [pool.submit(self._read_part, name, records, planner) for name, records in jobs]
        errors = [e for e in (f.exception() for f in done) if e is not None]
        if errors:
            raise _merged(errors)
        for f in done:
            self.stats.update(f.result())
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_part(self, name: str, records: list[_Record], planner: LoadPlanner) -> Counter[str]:
        """Read consecutive records of a file in offset order, each run of small ones in one read; raise for the
        damaged ones once all are read."""
        count: Counter[str] = Counter()
        damaged: list[tuple[str, str]] = []
        buffer = memoryview(bytearray(SMALL))
        fd = os.open(os.fspath(self.fs.concat_path(self.path, name)), os.O_RDONLY)
        try:
            for start, end, run in _runs(records):
                batch = buffer[: end - start] if end - start <= SMALL else None
                for record in run:
                    try:
                        if batch is not None and record is run[0]:
                            _fill(fd, [batch], start)
                        read = batch[record.info.offset - start :][: record.info.length] if batch is not None else None
                        count[self._read_record(fd, record, planner, read)] += len(record.reqs)
                    except _Damaged as e:
                        fqn, info = record.reqs[0].storage_index.fqn, record.info
                        where = f"{fqn} (bytes {info.offset}..{info.offset + info.length})"
                        damaged.append((fqn, str(e).replace("{record}", where)))
        finally:
            os.close(fd)
        if damaged:
            raise CorruptCheckpoint(name, [fqn for fqn, _ in damaged], [problem for _, problem in damaged])
        return count

    def _read_record(self, fd: int, record: _Record, planner: LoadPlanner, read: memoryview | None) -> str:
        """Read one record into its requests' destinations (its bytes are `read` when its run was read whole);
        the way it went."""
        info, kind = record.info, record.reqs[0].type
        checksum = getattr(info, "checksum", None) if self.verify else None
        if read is not None:  # a small record: its storage is copied out of the run's buffer
            if checksum is not None:
                _check(update(read), checksum)
            found = directory(read, 0) if kind == LoadItemType.TENSOR and not info.transform_descriptors else None
            stored = locate(read, found, info.length) if found is not None else None
            if stored is None:
                return self._through_torch(bytes(read), record, planner, checked=checksum is not None)
            memory, staging = _target(stored, record)
            memory[:] = read[stored.start : stored.end]
            return self._commit(stored, record, staging, planner)
        # A large one: the central directory (at its end), its head up to the storage, the storage into its
        # destination, each byte read once, the CRC32C chained over the parts in file order.
        tail_start = info.length - TAIL
        tail = memoryview(bytearray(TAIL))
        _fill(fd, [tail], info.offset + tail_start)
        found = directory(tail, tail_start) if kind == LoadItemType.TENSOR and not info.transform_descriptors else None
        head_end = found.storage[0] + HEAD_SLACK if found is not None else tail_start + 1
        stored = None
        if found is not None and head_end <= tail_start:
            head = memoryview(bytearray(head_end))
            _fill(fd, [head], info.offset)
            stored = locate(head, found, info.length)
        if stored is None:
            return self._through_torch(_whole(fd, info, checksum), record, planner, checked=checksum is not None)
        memory, staging = _target(stored, record)
        in_head = min(head_end, stored.end) - stored.start
        memory[:in_head] = head[stored.start : stored.start + in_head]
        rest = memory[in_head:]
        if checksum is None:
            _fill(fd, [rest], info.offset + head_end)
            return self._commit(stored, record, staging, planner)
        after = max(head_end, stored.end)  # the first byte that neither the head nor the storage holds
        gap = memoryview(bytearray(max(0, tail_start - after)))
        value, at = update(head), info.offset + head_end
        for start in range(0, len(rest), PIECE):  # each piece summed right after it is read: still in the cache
            piece = rest[start : start + PIECE]
            _fill(fd, [piece], at)
            value, at = update(piece, value), at + len(piece)
        _fill(fd, [gap], at)
        _check(update(tail[max(0, after - tail_start) :], update(gap, value)), checksum)
        return self._commit(stored, record, staging, planner)

    def _commit(self, stored: Stored, record: _Record, staging: torch.Tensor | None, planner: LoadPlanner) -> str:
        if staging is not None:
            self._copy(stored.tensor(staging), record, planner)
            return "staged"
        dest = cast(_Dest, record.dest).tensor
        torch.autograd.graph.increment_version(dest)  # written through its memory: autograd would not know
        with self._planner_lock:
            planner.commit_tensor(record.reqs[0], dest)
        return "direct"

    def _copy(self, tensor: torch.Tensor, record: _Record, planner: LoadPlanner) -> None:
        """DCP's copy of each request's part of a stored tensor into its destination."""
        for req in record.reqs:
            part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            if record.dest is not None:
                dest = record.dest.tensor
            else:
                with self._planner_lock:
                    dest = planner.resolve_tensor(req).detach()
            if dest.size() != part.size():  # DCP asserts; the metadata has the size the record should hold
                raise _Damaged(f"{{record}} holds {tuple(tensor.shape)}, not the size `.metadata` gives it")
            dest.copy_(part)
            with self._planner_lock:
                planner.commit_tensor(req, dest)

    def _through_torch(self, read: bytes, record: _Record, planner: LoadPlanner, checked: bool) -> str:
        """DCP's own way: the record's bytes through its stream transforms and torch.load (weights_only, also
        for the byte records that DCP's planner would load without it). `checked`: the bytes matched their
        CRC32C."""
        reqs = record.reqs
        raw = self.transforms.transform_load_stream(
            reqs[0], record.info.transform_descriptors or (), io.BytesIO(read)
        ).read(-1)
        if reqs[0].type == LoadItemType.BYTE_IO:
            # DCP's planner would torch.load these bytes with weights_only=False (any pickle runs): they are
            # loaded here with weights_only=True, and the planner is given that value saved anew.
            safe = io.BytesIO()
            torch.save(self._load_safely(raw, record, checked), safe)
            with self._planner_lock:
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(safe.getvalue()))
            return "bytes"
        tensor = self._load_safely(raw, record, checked)
        self._copy(cast(torch.Tensor, tensor), record, planner)
        return "torch_load"

    def _load_safely(self, raw: bytes, record: _Record, checked: bool) -> Any:
        """A record's value by torch.load(weights_only=True): `UnsafeCheckpoint` when its pickle asks for a
        global that torch refuses (it could run code) although its bytes are those written (`checked`: a
        record whose bytes could not be checked may be damaged, as a flipped bit in a class name is), `_Damaged`
        when it cannot be read otherwise."""
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged record fails in many ways inside torch.load
            text = str(e)
            asked = _WEIGHTS_ONLY_GLOBAL.search(text) if isinstance(e, pickle.UnpicklingError) else None
            if asked and checked:
                info = record.info
                raise UnsafeCheckpoint(
                    os.fspath(self.fs.concat_path(self.path, info.relative_path)),
                    asked.group(1),
                    f"its record {record.reqs[0].storage_index.fqn} (bytes {info.offset}..{info.offset + info.length})"
                    f" asks for {asked.group(1)}, which DCP's checkpoint files never hold; unpickling it could run "
                    "code",
                ) from None
            if isinstance(e, pickle.UnpicklingError):  # torch's text advises weights_only=False: its reason only
                text = next(
                    (
                        line
                        for line in reversed(text.splitlines())
                        if line.strip() and not line.startswith("Check the documentation")
                    ),
                    text,
                )
            raise _Damaged(f"{{record}} cannot be read ({type(e).__name__}: {text})") from e


def _resolve(planner: LoadPlanner, req: ReadItem) -> _Dest:
    tensor = planner.resolve_tensor(req).detach()
    memory = _bytes_of(tensor) if tensor.device.type == "cpu" and tensor.is_contiguous() else None
    return _Dest(tensor, memory, tensor.dtype, tuple(tensor.shape))


def _target(stored: Stored, record: _Record) -> tuple[memoryview, torch.Tensor | None]:
    """Where to read the storage: the destination's memory when it is the whole stored tensor, else a buffer
    (returned too)."""
    dest = record.dest
    if (
        dest is not None
        and dest.memory is not None
        and dest.dtype == stored.dtype
        and dest.shape == stored.size == tuple(record.reqs[0].lengths)
        and stored.whole()
    ):
        return dest.memory, None
    staging = torch.empty(stored.end - stored.start, dtype=torch.uint8)
    return _bytes_of(staging), staging


def _whole(fd: int, info: _StorageInfo, checksum: str | None) -> bytes:
    view = memoryview(bytearray(info.length))
    _fill(fd, [view], info.offset)
    if checksum is not None:
        _check(update(view), checksum)
    return cast(bytes, view.obj)


def _check_size(name: str, records: list[_Record], size: int) -> None:
    """A file cut short: raise naming every record that lies past its end (before anything is read)."""
    cut = [r.reqs[0].storage_index.fqn for r in records if r.info.offset + r.info.length > size]
    if cut:
        names = ", ".join(cut[:8]) + (f" and {len(cut) - 8} more" if len(cut) > 8 else "")
        raise CorruptCheckpoint(name, cut, [f"cut short at {size} bytes: {names} lie past its end"])


def _merged(errors: list[BaseException]) -> BaseException:
    """The error to raise for a load's failed parts: any other than a damaged record first, else the damaged
    records of the first damaged file, all its parts together."""
    other = [e for e in errors if not isinstance(e, CorruptCheckpoint)]
    if other:
        return other[0]
    damaged = cast(list[CorruptCheckpoint], errors)
    same = [e for e in damaged if e.file == damaged[0].file]
    return CorruptCheckpoint(same[0].file, [r for e in same for r in e.records], [p for e in same for p in e.problems])


def _parts(records: list[_Record], share: int) -> list[list[_Record]]:
    """Consecutive records (by offset) in parts of about `share` bytes."""
    parts: list[list[_Record]] = [[]]
    size = 0
    for record in records:
        if size >= share:
            parts.append([])
            size = 0
        parts[-1].append(record)
        size += record.info.length
    return parts


def _runs(records: list[_Record]) -> list[tuple[int, int, list[_Record]]]:
    """(start, end, records) of consecutive records (by offset) read in one call: up to SMALL bytes from the first
    one's start to the last one's end; a larger record is a run of its own."""
    runs: list[tuple[int, int, list[_Record]]] = []
    for record in records:
        end = record.info.offset + record.info.length
        if runs and end - runs[-1][0] <= SMALL:
            runs[-1][2].append(record)
            runs[-1] = (runs[-1][0], end, runs[-1][2])
        else:
            runs.append((record.info.offset, end, [record]))
    return runs
