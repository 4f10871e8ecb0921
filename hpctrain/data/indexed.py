"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx): read and write, byte for byte megatron-core's format.

Why this format: it is what Megatron-LM, NeMo and most pre-tokenised corpora ship in, so a dataset prepared here
trains under megatron-core and one prepared there trains here, with no conversion.

PREFIX.bin holds every sequence's token ids back to back, nothing else. PREFIX.idx (all little-endian):

    offset  size   field
    0       9      magic b"MMIDIDX\\x00\\x00"
    9       8      version, <Q, always 1
    17      1      dtype code of the .bin, <B: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                   7 float32, 8 uint16
    18      8      S = number of sequences, <Q
    26      8      D = len(document_indices), <Q (number of documents + 1)
    34      4*S    sequence_lengths, int32: tokens per sequence
    ..      8*S    sequence_pointers, int64: byte offset of each sequence in the .bin
    ..      8*D    document_indices, int64: a document is the sequences document_indices[i]:document_indices[i+1];
                   it starts with 0 and ends with S

A multimodal dataset appends S int8 sequence modes; nothing in the header says so (megatron's reader is told),
so such an .idx is recognised by its size and refused. The arrays are not aligned (int32 at byte 34): read
through unaligned views, as megatron does.

Writing: the .bin is streamed to a temporary name (only the lengths stay in memory), then at `finalize` both
files are fsynced and renamed into place, the .bin before the .idx, so the .idx is the commit point: whoever
finds it finds the complete .bin it describes. A writer that fails or is aborted removes its temporaries.
"""

from __future__ import annotations

import array
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from hpctrain.durable import fsync_dir

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
DTYPES: dict[int, np.dtype] = {
    code: np.dtype(name).newbyteorder("<")
    for code, name in {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }.items()
}
CODES: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}
LENGTH = np.dtype("<i4")
POINTER = np.dtype("<i8")
CHECK_BLOCK = 1 << 22  # index entries validated at a time


class IndexedDatasetError(ValueError):
    """A dataset that cannot be read or written as asked; the message names the file and what is wrong."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's choice (DType.optimal_dtype), so both sides agree on what a vocabulary gets: uint16 below
    65500 ids, else int32."""
    return DTYPES[8] if vocab_size < 65500 else DTYPES[4]


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def exists(prefix: str | os.PathLike) -> bool:
    """Both files are there (a .bin alone is a writer's debris or a copy under way, not a dataset)."""
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


class IndexedDataset:
    """A dataset opened read-only: the index arrays and the tokens are memory maps, nothing is read up front but
    the index (validated once, in full: a damaged dataset fails here, not mid-run)."""

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [sequences]
    sequence_pointers: np.ndarray  # int64 [sequences]: byte offsets in the .bin
    document_indices: np.ndarray  # int64 [documents + 1]
    tokens: np.ndarray  # the whole .bin, 1-d, memory-mapped

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx, bin_ = idx_path(prefix), bin_path(prefix)
        for path in (idx, bin_):
            if not path.is_file():
                raise IndexedDatasetError(f"{path}: no such file (an indexed dataset is PREFIX.idx + PREFIX.bin)")
        index = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
        if index.size < HEADER.size:
            raise IndexedDatasetError(f"{idx}: {index.size} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, code, n_seq, n_docs = HEADER.unpack(index[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise IndexedDatasetError(f"{idx}: not an indexed dataset index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise IndexedDatasetError(f"{idx}: version {version}, only version {VERSION} exists")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        self.dtype = DTYPES[code]
        expected = HEADER.size + n_seq * (LENGTH.itemsize + POINTER.itemsize) + n_docs * POINTER.itemsize
        if index.size == expected + n_seq and n_seq:
            raise IndexedDatasetError(f"{idx}: a multimodal dataset (it has sequence modes), not supported")
        if index.size != expected:
            raise IndexedDatasetError(
                f"{idx}: {index.size} bytes, but its header ({n_seq} sequences, {n_docs} "
                f"document indices) makes it {expected}"
            )
        buffer = index.data
        self.sequence_lengths = np.frombuffer(buffer, LENGTH, n_seq, HEADER.size)
        self.sequence_pointers = np.frombuffer(buffer, POINTER, n_seq, HEADER.size + self.sequence_lengths.nbytes)
        self.document_indices = np.frombuffer(
            buffer, POINTER, n_docs, HEADER.size + self.sequence_lengths.nbytes + self.sequence_pointers.nbytes
        )
        n_tokens = self._check_index(idx)
        size = bin_.stat().st_size
        if size != n_tokens * self.dtype.itemsize:
            raise IndexedDatasetError(
                f"{bin_}: {size} bytes, but {idx} describes {n_tokens} tokens of "
                f"{self.dtype.name} = {n_tokens * self.dtype.itemsize} bytes"
            )
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)

    def _check_index(self, idx: Path) -> int:
        """What megatron's reader assumes without checking: lengths >= 0, the sequences back to back from byte
        0, documents covering the sequences in order. Block by block: every rank opens the dataset, and an
        index of 10^8 sequences must not cost each a few GB. Returns the number of tokens."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        offset = 0  # bytes before the block
        for first in range(0, lengths.size, CHECK_BLOCK):
            block = lengths[first : first + CHECK_BLOCK].astype(np.int64)
            if block.min() < 0:
                raise IndexedDatasetError(f"{idx}: negative length of sequence {first + int(np.argmin(block))}")
            expected = offset + (np.cumsum(block) - block) * self.dtype.itemsize
            wrong = np.flatnonzero(expected != pointers[first : first + CHECK_BLOCK])
            if wrong.size:
                at = first + int(wrong[0])
                raise IndexedDatasetError(
                    f"{idx}: sequence {at} starts at byte {int(pointers[at])}, but the "
                    f"lengths before it put it at byte {int(expected[wrong[0]])}"
                )
            offset += int(block.sum()) * self.dtype.itemsize
        falls = any(
            (np.diff(docs[first : first + CHECK_BLOCK + 1]) < 0).any() for first in range(0, docs.size, CHECK_BLOCK)
        )
        if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or falls:
            raise IndexedDatasetError(f"{idx}: document indices must rise from 0 to the {lengths.size} sequences")
        return offset // self.dtype.itemsize

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """Pickled as its prefix, reopened on the other side: a memory map would pickle as the whole dataset."""
        return IndexedDataset, (self.prefix,)

    def __len__(self) -> int:
        return self.sequence_lengths.size

    @property
    def num_tokens(self) -> int:
        return self.tokens.size

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """A view (no copy) of sequence `index`'s tokens from `offset`, `length` of them (default: to its end)."""
        size = int(self.sequence_lengths[index])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens {offset}:{offset + length} of sequence {index}, which has {size}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]


class IndexedDatasetWriter:
    """Writes prefix.bin/.idx under temporary names and renames them into place in finalize() (the .bin first,
    the .idx last, so a reader that finds the .idx finds a complete .bin); fsync before the renames. A writer
    abandoned or failing (context manager __exit__ with an exception, or abort()) removes its temporaries: no
    half-written dataset is ever left. One sequence per document: what megatron's preprocess_data writes
    without sentence splitting."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype not in CODES or self.dtype.kind not in "iu":
            raise IndexedDatasetError(
                f"{bin_path(prefix)}: cannot hold token ids as {np.dtype(dtype).name} "
                "(integer dtypes: uint8, int8, int16, int32, int64, uint16)"
            )
        self._max = int(np.iinfo(self.dtype).max)
        try:
            fd, self._bin_tmp = _temporary(bin_path(prefix))
        except FileNotFoundError:
            raise IndexedDatasetError(
                f"{bin_path(prefix)}: directory {bin_path(prefix).parent} does not exist"
            ) from None
        self._idx_tmp: Path | None = None
        self._bin = open(fd, "wb", buffering=1 << 20)
        self._lengths = array.array("i")  # compact, whatever the number of documents
        self._finalized = False

    def _checked(self, tokens: np.ndarray | Sequence[int]) -> np.ndarray:
        """Token ids as the dataset's dtype, refused when they are not integers or do not fit it (a silent
        wrap-around would train on wrong tokens)."""
        if self._finalized or self._bin.closed:
            raise IndexedDatasetError(f"{bin_path(self.prefix)}: the writer is closed")
        ids = np.asarray(tokens)
        if ids.size == 0:
            return np.zeros(0, self.dtype)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise IndexedDatasetError(
                f"{bin_path(self.prefix)}: token ids must be a 1-d array of integers, "
                f"got {ids.dtype.name} of shape {ids.shape}"
            )
        low = int(ids.min()) if ids.dtype.kind == "i" else 0  # only what the input's dtype can get wrong
        high = int(ids.max()) if np.iinfo(ids.dtype).max > self._max else 0
        if low < 0 or high > self._max:
            raise IndexedDatasetError(
                f"{bin_path(self.prefix)}: token id {low if low < 0 else high} does not fit "
                f"{self.dtype.name} (0..{self._max})"
            )
        return ids.astype(self.dtype, copy=False)

    def add_document(self, tokens: np.ndarray | Sequence[int]) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(np.array([tokens.size]), tokens)

    def add_documents(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Many documents, their tokens concatenated: one write and one check for a whole chunk."""
        ids = self._checked(tokens)
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or (
            lengths.size
            and (lengths.dtype.kind not in "iu" or lengths.min() < 0 or lengths.max() > np.iinfo(LENGTH).max)
        ):
            raise IndexedDatasetError(
                f"{bin_path(self.prefix)}: document lengths must be integers in 0..{np.iinfo(LENGTH).max}"
            )
        if int(lengths.sum(dtype=np.int64)) != ids.size:
            raise IndexedDatasetError(
                f"{bin_path(self.prefix)}: document lengths add up to "
                f"{int(lengths.sum(dtype=np.int64))}, but {ids.size} tokens were given"
            )
        self._bin.write(np.ascontiguousarray(ids).data)
        self._lengths.frombytes(lengths.astype(np.intc).tobytes())

    def finalize(self) -> None:
        """Make the dataset durable and visible. An existing .idx is removed before the new .bin takes the old
        one's place, so a reader never pairs an old index with new tokens."""
        if self._finalized:
            return
        idx, bin_ = idx_path(self.prefix), bin_path(self.prefix)
        placed = False
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.frombuffer(self._lengths, np.intc).astype(LENGTH)
            pointers = np.zeros(lengths.size, POINTER)
            np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            documents = np.arange(lengths.size + 1, dtype=POINTER)
            fd, self._idx_tmp = _temporary(idx)
            with open(fd, "wb") as out:
                out.write(HEADER.pack(MAGIC, VERSION, CODES[self.dtype], lengths.size, documents.size))
                for values in (lengths, pointers, documents):
                    out.write(values.data)
                out.flush()
                os.fsync(out.fileno())
            idx.unlink(missing_ok=True)
            os.replace(self._bin_tmp, bin_)
            placed = True
            os.replace(self._idx_tmp, idx)
            fsync_dir(idx.parent)
        except BaseException:
            if placed:
                bin_.unlink(missing_ok=True)
            self.abort()
            raise
        self._finalized = True

    def abort(self) -> None:
        """Remove the temporaries; the writer cannot be used afterwards."""
        try:
            self._bin.close()  # may fail flushing (a full disk): the temporaries go all the same
        finally:
            for tmp in (self._bin_tmp, self._idx_tmp):
                if tmp is not None:
                    tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """A clean exit finalizes; an exception aborts."""
        if exc_type is None:
            self.finalize()
        elif not self._finalized:
            self.abort()


def _temporary(path: Path) -> tuple[int, Path]:
    """A new file beside `path` under a hidden, unique name, with the permissions a plain open gives (mkstemp's
    0600 would make a dataset that the others on the cluster cannot read)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
