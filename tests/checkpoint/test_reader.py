"""The fast checkpoint reader on real DCP files: bit-identical loads straight into the destinations, DCP's own
result wherever it must reshard or fall back, the torch.save record layout it parses pinned, and damaged
records (a flipped bit, a cut file) refused by name."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import hpctrain.checkpoint.reader as reader_module
from hpctrain.checkpoint.integrity import read_metadata as restricted_metadata
from hpctrain.checkpoint.reader import TAIL, CorruptCheckpoint, FastReader, directory, locate
from hpctrain.checkpoint.reshard import load_state

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]  # what hpctrain saves
SHAPES = [(), (7,), (5, 3), (0,), (2, 0)]
BIG = (700, 512)  # above SMALL in float32: read tail first, then head, then straight into the destination

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes (bit-for-bit equality, NaNs and signed zeros included)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def saved_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "step": 17,
        "big": sample(torch.float32, BIG, 1),
        "big_bf16": sample(torch.bfloat16, BIG, 2),
    }
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            state[f"{str(dtype)[6:]}_{j}"] = sample(dtype, shape, 10 * i + j)
    return state


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


class SwitchedCrc(FileSystem):
    """DCP's file system with torch.save's record CRC32 set in each writer thread (the switch is thread-local)."""

    def __init__(self, crc: bool) -> None:
        super().__init__()
        self.crc = crc

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" in mode:
            torch.serialization.set_crc32_options(self.crc)
        with super().create_stream(path, mode) as stream:
            yield stream


def save(state: dict[str, Any], path: Path, crc: bool = False, checksums: bool = True) -> Path:
    """A DCP checkpoint of `state` in two files (two writer threads), with each record's CRC32C in `.metadata`
    as hpctrain's writer stores it."""
    was = torch.serialization.get_crc32_options()
    writer = dcp.FileSystemWriter(path, thread_count=2)
    writer.fs = SwitchedCrc(crc)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        torch.serialization.set_crc32_options(was)
    if checksums:
        metadata = read_metadata(path)
        for info in metadata.storage_data.values():
            info.checksum = f"{crc32c.crc32c(record_bytes(path, info)):08x}"
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


def read_metadata(path: Path) -> Any:
    return pickle.loads((path / ".metadata").read_bytes())


def record_bytes(path: Path, info: Any) -> bytes:
    return (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]


def storage_info(path: Path, fqn: str) -> Any:
    return next(info for index, info in read_metadata(path).storage_data.items() if index.fqn == fqn)


def load(state: dict[str, Any], path: Path, planner: Any = None, **kwargs: Any) -> FastReader:
    reader = FastReader(path, **kwargs)
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    return reader


def dcp_load(state: dict[str, Any], path: Path, planner: Any = None) -> None:
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=True)


def corrupt(error: CheckpointException) -> CorruptCheckpoint:
    """The reader's error inside DCP's (which gathers every rank's)."""
    found = [e for e, _ in error.failures.values() if isinstance(e, CorruptCheckpoint)]
    assert len(found) == 1, error
    return found[0]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def storage_offset_of(path: Path, fqn: str, tensor: torch.Tensor) -> int:
    """Where a tensor's bytes lie in its file (found by content, not by the parser under test)."""
    info = storage_info(path, fqn)
    at = record_bytes(path, info).find(bits(tensor))
    assert at > 0
    return info.offset + at


# ---------------------------------------------------------------- bit-identical, straight into the destination
@pytest.mark.parametrize("crc", [False, True], ids=["crc32-off", "crc32-on"])
def test_every_dtype_and_shape_loads_bit_identical_straight_into_its_destination(tmp_path: Path, crc: bool) -> None:
    state = saved_state()
    path = save(state, tmp_path / "ckpt", crc=crc)
    assert len(list(path.glob("*.distcp"))) == 2  # read by two threads
    loaded = zeros_like(state)
    reader = load(loaded, path)
    tensors = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    assert reader.stats == {"direct": sum(state[k].numel() > 0 for k in tensors), "bytes": 1}  # DCP reads no empty one
    assert loaded["step"] == 17
    for key in tensors:
        assert loaded[key].dtype == state[key].dtype and loaded[key].shape == state[key].shape, key
        assert bits(loaded[key]) == bits(state[key]), key
        assert loaded[key]._version > 0 or not state[key].numel(), key  # autograd sees the write, as after copy_


def test_load_state_reads_through_the_fast_reader(tmp_path: Path) -> None:
    state = saved_state()
    path = save(state, tmp_path / "ckpt")
    loaded = zeros_like(state)
    load_state(loaded, str(path), None, no_dist=True)
    assert all(bits(loaded[k]) == bits(v) for k, v in state.items() if isinstance(v, torch.Tensor))


def test_a_load_parses_the_metadata_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_state` reads `.metadata` to plan and `dcp.load` asks again: one parse serves both, each with the
    load's own id."""
    state = saved_state()
    path = save(state, tmp_path / "ckpt")
    parsed: list[Any] = []
    monkeypatch.setattr(reader_module, "read_metadata", lambda p: parsed.append(p) or restricted_metadata(p))
    loaded = zeros_like(state)
    load_state(loaded, str(path), None, no_dist=True)
    assert parsed == [str(path / ".metadata")]
    assert all(bits(loaded[k]) == bits(v) for k, v in state.items() if isinstance(v, torch.Tensor))
    reader = FastReader(path)
    first = reader.read_metadata().storage_meta.load_id
    reader.reset()
    assert reader.read_metadata().storage_meta.load_id == reader.load_id != first
    assert len(parsed) == 2


# ---------------------------------------------------------------- the torch.save layout the parser knows
@pytest.mark.parametrize("crc", [False, True], ids=["crc32-off", "crc32-on"])
def test_torch_save_record_layout_is_the_one_the_parser_knows(tmp_path: Path, crc: bool) -> None:
    """Fails on the torch version whose torch.save record layout (zip directory, data.pkl, local headers)
    changes: the parser must find exactly the storage bytes torch.load returns, and every record of a DCP save
    must take the fast path (else resumes silently fall back to torch.load's speed)."""
    base = sample(torch.float32, (64, 48), 0)
    tensors = [sample(dtype, shape, 7) for dtype in DTYPES for shape in SHAPES]
    tensors += [
        sample(torch.float32, BIG, 3),
        sample(torch.bfloat16, BIG, 4),
        base[16:40],
        base.t(),
        base[:, 5],
    ]  # views: an offset into a larger storage, strides
    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        for tensor in tensors:
            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            record = buffer.getvalue()
            loaded = torch.load(io.BytesIO(record), weights_only=True)
            tail_start = max(0, len(record) - TAIL)  # what the reader reads of a record above SMALL
            found = directory(memoryview(record)[tail_start:], tail_start)
            assert found is not None, (tensor.dtype, tensor.shape)
            stored = locate(record, found, len(record))
            assert stored is not None, (tensor.dtype, tensor.shape)
            storage = torch.empty(0, dtype=torch.uint8).set_(loaded.untyped_storage())
            assert record[stored.start : stored.end] == bits(storage)
            assert (stored.dtype, stored.size, stored.stride, stored.storage_offset) == (
                loaded.dtype,
                tuple(loaded.shape),
                loaded.stride(),
                loaded.storage_offset(),
            )
            assert stored.whole() == (tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes)
    finally:
        torch.serialization.set_crc32_options(was)
    state = saved_state()
    reader = load(zeros_like(state), save(state, tmp_path / "ckpt", crc=crc))
    assert reader.stats["direct"] == sum(isinstance(v, torch.Tensor) and v.numel() > 0 for v in state.values())
    assert set(reader.stats) == {"direct", "bytes"}


# ---------------------------------------------------------------- DCP's result where it cannot go direct
def test_a_strided_or_other_dtype_destination_gets_what_dcp_gives(tmp_path: Path) -> None:
    """Read into a buffer and copied as DCP copies: a transposed destination, and one of another dtype."""
    state = {"w": sample(torch.float32, (64, 48), 1), "big": sample(torch.float32, BIG, 2)}
    path = save(state, tmp_path / "ckpt")

    def destination() -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(48, 64).t(), "big": torch.zeros(BIG, dtype=torch.bfloat16)}

    fast, ours = destination(), destination()
    dcp_load(ours, path)
    reader = load(fast, path)
    assert reader.stats == {"staged": 2}
    assert bits(fast["w"]) == bits(ours["w"]) == bits(state["w"]) and not fast["w"].is_contiguous()
    assert bits(fast["big"]) == bits(ours["big"]) == bits(state["big"].bfloat16())


class RowsPlanner(DefaultLoadPlanner):
    """A resharded read: rows [8, 24) and [24, 40) of the saved `w` into two destinations (one record, two
    requests, neither from the stored tensor's start)."""

    def create_local_plan(self) -> LoadPlan:
        size = self.metadata.state_dict_metadata["w"].size
        stored = MetadataIndex("w", torch.Size([0, 0]))
        return LoadPlan(
            [
                ReadItem(
                    LoadItemType.TENSOR,
                    MetadataIndex(name, torch.Size([0, 0])),
                    torch.Size([0, 0]),
                    stored,
                    torch.Size([start, 0]),
                    torch.Size([16, size[1]]),
                )
                for name, start in (("top", 8), ("bottom", 24))
            ]
        )


def test_a_resharded_read_gets_what_dcp_gives(tmp_path: Path) -> None:
    saved = sample(torch.float32, (64, 48), 5)
    path = save({"w": saved}, tmp_path / "ckpt")
    fast, ours = (
        {"top": torch.zeros(16, 48), "bottom": torch.zeros(16, 48)},
        {"top": torch.zeros(16, 48), "bottom": torch.zeros(16, 48)},
    )
    dcp_load(ours, path, RowsPlanner())
    reader = load(fast, path, RowsPlanner())
    assert reader.stats == {"staged": 2}  # one read of the record for both
    for key, rows in (("top", saved[8:24]), ("bottom", saved[24:40])):
        assert bits(fast[key]) == bits(ours[key]) == bits(rows)


def test_a_record_layout_the_parser_does_not_know_goes_through_torch_load(tmp_path: Path) -> None:
    """Records in torch.save's legacy (pre-zip) format, checksums and all: loaded, and counted as torch.load's."""
    state = {"a": sample(torch.float32, (6, 4), 1), "b": sample(torch.bfloat16, BIG, 2), "step": 3}
    path = save(state, tmp_path / "ckpt")
    metadata = read_metadata(path)
    legacy = io.BytesIO()
    for index, info in metadata.storage_data.items():
        data = record_bytes(path, info)
        if index.fqn in ("a", "b"):
            buffer = io.BytesIO()
            torch.save(state[index.fqn], buffer, _use_new_zipfile_serialization=False)
            data = buffer.getvalue()
        info.relative_path, info.offset, info.length = "legacy.distcp", legacy.tell(), len(data)
        info.checksum = f"{crc32c.crc32c(data):08x}"
        legacy.write(data)
    (path / "legacy.distcp").write_bytes(legacy.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    loaded = zeros_like(state)
    reader = load(loaded, path)
    assert reader.stats == {"torch_load": 2, "bytes": 1}
    assert bits(loaded["a"]) == bits(state["a"]) and bits(loaded["b"]) == bits(state["b"]) and loaded["step"] == 3


# ---------------------------------------------------------------- damaged records
@pytest.mark.parametrize("key", ["w", "big"], ids=["small-record", "large-record"])
def test_a_flipped_bit_in_a_records_data_is_refused_by_name(tmp_path: Path, key: str) -> None:
    state = {
        "w": sample(torch.float32, (64, 48), 1),
        "big": sample(torch.float32, BIG, 2),
        "other": sample(torch.int64, (9,), 3),
    }
    path = save(state, tmp_path / "ckpt")
    info = storage_info(path, key)
    flip(path / info.relative_path, storage_offset_of(path, key, state[key]) + 1000)
    with pytest.raises(CheckpointException) as excinfo:
        load(zeros_like(state), path)
    error = corrupt(excinfo.value)
    assert error.file == info.relative_path and error.records == [key]
    assert str(error) == (
        f"{info.relative_path}: checksum mismatch in {key} (bytes {info.offset}..{info.offset + info.length})"
    )


def test_every_damaged_record_of_a_file_is_named_in_one_error(tmp_path: Path) -> None:
    """Read by several threads (a part of the file each), reported together, in file order."""
    state = {f"t{i}": sample(torch.float32, (400, 450), i) for i in range(8)}  # 720 kB each: parts of ~1 MiB
    path = save(state, tmp_path / "ckpt")
    metadata = read_metadata(path)
    name = sorted(path.glob("*.distcp"))[0].name
    records = sorted(
        (info.offset, index.fqn) for index, info in metadata.storage_data.items() if info.relative_path == name
    )
    hit = [records[0][1], records[-1][1]]
    for fqn in hit:
        flip(path / name, storage_offset_of(path, fqn, state[fqn]) + 4)
    with pytest.raises(CheckpointException) as excinfo:
        load(zeros_like(state), path)
    error = corrupt(excinfo.value)
    assert error.file == name and error.records == hit
    assert str(error).count("checksum mismatch in") == 2


@pytest.mark.parametrize("key", ["w", "big"], ids=["small-record", "large-record"])
@pytest.mark.parametrize("where", [5, 100, -600], ids=["local-header", "data.pkl", "after-the-data"])
def test_a_flipped_bit_in_a_records_header_is_refused(tmp_path: Path, key: str, where: int) -> None:
    """The zip and pickle bytes around the tensor's: a large record's are parsed before its checksum can be
    checked (whatever they say must end in the same refusal), and those after its data are summed too."""
    state = {"w": sample(torch.float32, (64, 48), 1), "big": sample(torch.float32, BIG, 2)}
    path = save(state, tmp_path / "ckpt")
    info = storage_info(path, key)
    flip(path / info.relative_path, info.offset + where % info.length)
    with pytest.raises(CheckpointException) as excinfo:
        load(zeros_like(state), path)
    assert corrupt(excinfo.value).records == [key]


def test_wherever_a_bit_flips_the_load_refuses_the_record_and_nothing_else_breaks(tmp_path: Path) -> None:
    """Bits flipped all over a small and a large record's zip and pickle bytes (and in their data): with `verify`
    each is refused by name; without it each loads or is refused as unreadable, never a crash, an allocation of
    what a damaged size says or a hang."""
    state = {"w": sample(torch.float32, (64, 48), 1), "big": sample(torch.float32, BIG, 2)}
    path = save(state, tmp_path / "ckpt")
    for key in state:
        info = storage_info(path, key)
        file = path / info.relative_path
        around = [*range(0, 800, 17), *range(info.length - 1000, info.length, 17), info.length // 2]
        for at in around:
            flip(file, info.offset + at)
            with pytest.raises(CheckpointException) as excinfo:
                load(zeros_like(state), path)
            assert corrupt(excinfo.value).records == [key], at
            try:
                load(zeros_like(state), path, verify=False)
            except CheckpointException as e:
                assert corrupt(e).records == [key], at
            flip(file, info.offset + at)


def test_a_cut_file_is_refused_naming_the_records_past_its_end(tmp_path: Path) -> None:
    state = {f"t{i}": sample(torch.float32, (100, 10 + i), i) for i in range(6)}
    path = save(state, tmp_path / "ckpt")
    metadata = read_metadata(path)
    name = sorted(path.glob("*.distcp"))[0].name
    records = sorted(
        (info.offset, index.fqn) for index, info in metadata.storage_data.items() if info.relative_path == name
    )
    cut_at = records[-2][0] + 10  # into the second-to-last record
    with open(path / name, "r+b") as f:
        f.truncate(cut_at)
    with pytest.raises(CheckpointException) as excinfo:
        load(zeros_like(state), path)
    error = corrupt(excinfo.value)
    assert error.file == name and error.records == [fqn for _, fqn in records[-2:]]
    assert f"cut short at {cut_at} bytes" in str(error)


def test_without_verify_a_flipped_bit_loads_silently(tmp_path: Path) -> None:
    """Why `verify` is on by default: nothing else notices (torch.load does not check the bytes either)."""
    state = {"w": sample(torch.float32, (64, 48), 1), "big": sample(torch.float32, BIG, 2)}
    path = save(state, tmp_path / "ckpt")
    for key in state:
        flip(path / storage_info(path, key).relative_path, storage_offset_of(path, key, state[key]) + 1000)
    loaded = zeros_like(state)
    assert load(loaded, path, verify=False).stats == {"direct": 2}
    assert all(bits(loaded[k]) != bits(state[k]) for k in state)
    plain = zeros_like(state)
    dcp_load(plain, path)
    assert all(bits(plain[k]) == bits(loaded[k]) for k in state)  # DCP's own reader loads the same damage
    unsummed = zeros_like(state)
    save(state, tmp_path / "old", checksums=False)  # a checkpoint from before checksums: nothing to check
    assert load(unsummed, tmp_path / "old").stats == {"direct": 2}


def test_an_unparseable_record_without_verify_is_refused_not_crashed_on(tmp_path: Path) -> None:
    state = {"w": sample(torch.float32, (64, 48), 1)}
    path = save(state, tmp_path / "ckpt")
    info = storage_info(path, "w")
    with open(path / info.relative_path, "r+b") as f:  # the zip's end record: neither parser finds the archive
        f.seek(info.offset + info.length - 22)
        f.write(b"\0" * 22)
    with pytest.raises(CheckpointException) as excinfo:
        load(zeros_like(state), path, verify=False)
    error = corrupt(excinfo.value)
    assert error.records == ["w"] and "w (bytes" in str(error) and "cannot be read" in str(error)


def test_the_error_crosses_ranks_intact() -> None:
    """DCP pickles a rank's exception to gather it on every rank."""
    error = pickle.loads(pickle.dumps(CorruptCheckpoint("__1_0.distcp", ["a", "b"], ["x", "y"])))
    assert (error.file, error.records, str(error)) == ("__1_0.distcp", ["a", "b"], "__1_0.distcp: x; y")


def test_one_reading_thread_per_core_the_process_may_use_at_most_four() -> None:
    """From the page cache a read is CPU work (the copy and the CRC32C): a thread more than the cores only waits."""
    allowed = os.sched_getaffinity(0)
    assert FastReader("unused").threads == min(4, len(allowed))
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert FastReader("unused").threads == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert FastReader("unused", threads=3).threads == 3
