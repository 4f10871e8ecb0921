"""Megatron's indexed dataset: hpctrain's writer and reader round-trip, agree with megatron-core's in both
directions, refuse damaged files, and never leave a half-written dataset."""

from __future__ import annotations

import pickle
import re
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from hpctrain.data import indexed
from hpctrain.data.indexed import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    exists,
    optimal_dtype,
)
from hpctrain.data.prepare import prepare


def megatron_indexed() -> ModuleType:
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as err:
        pytest.skip(f"megatron-core cannot be imported: {err}")
    return indexed_dataset


def random_documents(dtype: np.dtype, n: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    high = np.iinfo(dtype).max
    docs = [rng.integers(0, high, size=int(rng.integers(1, 300)), endpoint=True).astype(dtype) for _ in range(n)]
    docs[3] = np.zeros(0, dtype)  # an empty document is legal in the format
    docs[5][0], docs[6][0] = 0, high  # both ends of the range
    return docs


def write(prefix: Path, docs: list[np.ndarray], dtype: np.dtype) -> None:
    """Half one at a time, half in chunks: both paths of the writer."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs[:10]:
            writer.add_document(doc.tolist())
        for start in range(10, len(docs), 7):
            chunk = docs[start : start + 7]
            writer.add_documents(np.array([d.size for d in chunk]), np.concatenate(chunk))


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("dtype", [np.dtype(np.uint16), np.dtype(np.int32)])
def test_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: np.dtype) -> None:
    monkeypatch.setattr(indexed, "CHECK_BLOCK", 3)  # a valid index passes its checks block by block
    docs = random_documents(dtype)
    write(tmp_path / "ds", docs, dtype)
    assert files_in(tmp_path) == ["ds.bin", "ds.idx"] and exists(tmp_path / "ds")
    data = IndexedDataset(tmp_path / "ds")
    assert data.dtype == dtype and len(data) == len(docs)
    assert data.num_tokens == sum(d.size for d in docs)
    assert data.sequence_lengths.tolist() == [d.size for d in docs]
    assert data.document_indices.tolist() == list(range(len(docs) + 1))
    assert np.array_equal(data.tokens, np.concatenate(docs))
    for i, doc in enumerate(docs):
        assert data.get(i).dtype == dtype and np.array_equal(data.get(i), doc)
    assert np.array_equal(data.get(7, offset=2, length=3), docs[7][2:5])
    assert np.array_equal(data.get(7, offset=4), docs[7][4:])
    with pytest.raises(IndexError, match="sequence 7"):
        data.get(7, offset=1, length=docs[7].size)
    pickled = pickle.dumps(data)  # for another process: the prefix, not the tokens
    assert len(pickled) < 200 and np.array_equal(pickle.loads(pickled).tokens, data.tokens)


def test_an_empty_dataset_opens(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "empty", np.uint16):
        pass
    data = IndexedDataset(tmp_path / "empty")
    assert len(data) == 0 and data.num_tokens == 0 and data.document_indices.tolist() == [0]


def test_optimal_dtype_is_megatrons() -> None:
    dtype_rule = megatron_indexed().DType.optimal_dtype
    for vocab in (256, 8192, 50257, 65499, 65500, 128256):
        assert optimal_dtype(vocab) == np.dtype(dtype_rule(vocab))


def test_written_by_megatron_read_by_hpctrain(tmp_path: Path) -> None:
    """Documents of several sequences too (megatron's sentence-split datasets)."""
    mc = megatron_indexed()
    prefix = str(tmp_path / "mc")
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 65535, size=int(rng.integers(1, 50))) for _ in range(12)]
    builder = mc.IndexedDatasetBuilder(mc.get_bin_path(prefix), dtype=np.uint16)
    builder.add_item(torch.from_numpy(sequences[0]))  # a document of one sequence
    builder.end_document()
    builder.add_item(torch.from_numpy(sequences[1]))  # of three, item by item
    builder.add_item(torch.from_numpy(sequences[2]))
    builder.add_item(torch.from_numpy(sequences[3]))
    builder.end_document()
    # as megatron's tools/preprocess_data.py calls it: a list of ids, and the length of each sequence
    builder.add_document(np.concatenate(sequences[4:9]).tolist(), [s.size for s in sequences[4:9]])
    builder.add_document(np.concatenate(sequences[9:]).tolist(), [s.size for s in sequences[9:]])
    builder.finalize(mc.get_idx_path(prefix))

    data = IndexedDataset(prefix)
    reference = mc.IndexedDataset(prefix)
    assert data.document_indices.tolist() == [0, 1, 4, 9, 12] == reference.document_indices.tolist()
    assert data.sequence_lengths.tolist() == [s.size for s in sequences]
    assert data.sequence_pointers.tolist() == reference.index.sequence_pointers.tolist()
    for i, sequence in enumerate(sequences):
        assert np.array_equal(data.get(i), sequence)
        assert np.array_equal(data.get(i, 1, 2), reference.get(i, 1, 2))


@pytest.mark.parametrize("dtype", [np.dtype(np.uint16), np.dtype(np.int32)])
def test_written_by_hpctrain_read_by_megatron(tmp_path: Path, dtype: np.dtype) -> None:
    mc = megatron_indexed()
    docs = random_documents(dtype, seed=2)
    write(tmp_path / "ds", docs, dtype)
    reference = mc.IndexedDataset(str(tmp_path / "ds"))
    assert reference.index.dtype == dtype.type and len(reference) == len(docs)
    assert reference.sequence_lengths.tolist() == [d.size for d in docs]
    assert reference.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(reference[i], doc)
    assert [s.tolist() for s in reference[4:9]] == [d.tolist() for d in docs[4:9]]


def test_a_prepared_corpus_is_read_by_megatron(tmp_path: Path) -> None:
    mc = megatron_indexed()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(f'{{"text": "document {i}: {"naïve café " * i}"}}' for i in range(30)))
    summary = prepare([corpus], tmp_path / "out" / "ds", vocab_size=300, progress=False)
    data, reference = IndexedDataset(summary.prefix), mc.IndexedDataset(summary.prefix)
    assert len(reference) == summary.documents == 30 and reference.index.dtype == np.uint16
    assert reference.document_indices.tolist() == data.document_indices.tolist()
    for i in range(30):
        assert np.array_equal(reference[i], data.get(i)) and reference[i][-1] == 0  # <|endoftext|>


def patch(path: Path, offset: int, data: bytes) -> None:
    content = path.read_bytes()
    path.write_bytes(content[:offset] + data + content[offset + len(data) :])


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda idx, bin_: idx.write_bytes(b"NOTMMIDX\x00" + idx.read_bytes()[9:]), "not an indexed dataset"),
        (
            lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:9] + struct.pack("<Q", 2) + idx.read_bytes()[17:]),
            "version 2",
        ),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x09" + idx.read_bytes()[18:]), "dtype code 9"),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), "shorter than the 34-byte header"),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), "its header .* makes it"),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes() + bytes(5)), "multimodal"),
        (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), "but .* describes 23 tokens"),
        (lambda idx, bin_: patch(idx, 34 + 2 * 4, struct.pack("<i", -1)), "negative length of sequence 2"),
        (
            lambda idx, bin_: patch(idx, 34 + 5 * 4 + 3 * 8, struct.pack("<q", 26)),
            "sequence 3 starts at byte 26, .* 24",
        ),
        (lambda idx, bin_: patch(idx, 34 + 5 * 12 + 2 * 8, struct.pack("<q", 0)), "document indices must rise"),
        (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8] + struct.pack("<q", 4)), "document indices"),
        (lambda idx, bin_: idx.unlink(), "no such file"),
    ],
)
def test_damage_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: Callable[[Path, Path], None], problem: str
) -> None:
    """The index is checked two entries at a time here: the checks' block boundaries are crossed too."""
    monkeypatch.setattr(indexed, "CHECK_BLOCK", 2)
    prefix = tmp_path / "ds"
    write(prefix, [np.arange(n, dtype=np.uint16) for n in (3, 4, 5, 6, 5)], np.dtype(np.uint16))
    idx, bin_ = tmp_path / "ds.idx", tmp_path / "ds.bin"
    damage(idx, bin_)
    named = bin_ if "tokens" in problem else idx
    with pytest.raises(IndexedDatasetError, match=f"{re.escape(str(named))}: .*{problem}"):
        IndexedDataset(prefix)


def test_ids_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer:
        with pytest.raises(IndexedDatasetError, match=r"ds\.bin: token id 65536 does not fit uint16"):
            writer.add_document([1, 65536])
        with pytest.raises(IndexedDatasetError, match="token id -1 does not fit"):
            writer.add_document(np.array([-1, 5], dtype=np.int16))
        with pytest.raises(IndexedDatasetError, match="integers, got float64"):
            writer.add_document([1.0, 2.5])
        with pytest.raises(IndexedDatasetError, match="add up to 3, but 4 tokens"):
            writer.add_documents(np.array([1, 2]), np.arange(4, dtype=np.uint16))
        writer.add_document([7, 8])  # the refused ones left no trace
    with IndexedDatasetWriter(tmp_path / "signed", np.int32) as writer:
        with pytest.raises(IndexedDatasetError, match="token id -3 does not fit int32"):
            writer.add_document(np.array([4, -3], dtype=np.int32))
    assert IndexedDataset(tmp_path / "ds").tokens.tolist() == [7, 8]
    with pytest.raises(IndexedDatasetError, match="cannot hold token ids as float32"):
        IndexedDatasetWriter(tmp_path / "f", np.float32)


def test_an_aborted_or_failing_writer_leaves_nothing(tmp_path: Path) -> None:
    writer = IndexedDatasetWriter(tmp_path / "aborted", np.uint16)
    writer.add_document([1, 2, 3])
    assert len(files_in(tmp_path)) == 1  # its temporary .bin
    writer.abort()
    with pytest.raises(RuntimeError, match="corpus reader failed"):
        with IndexedDatasetWriter(tmp_path / "failed", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("corpus reader failed")
    assert files_in(tmp_path) == []
    with pytest.raises(IndexedDatasetError, match="writer is closed"):
        writer.add_document([4])
    with pytest.raises(IndexedDatasetError, match="directory .*nowhere does not exist"):
        IndexedDatasetWriter(tmp_path / "nowhere" / "ds", np.uint16)


def test_overwriting_replaces_both_files_and_an_open_reader_keeps_its_data(tmp_path: Path) -> None:
    write(tmp_path / "ds", [np.arange(10, dtype=np.uint16)], np.dtype(np.uint16))
    before = IndexedDataset(tmp_path / "ds")
    write(tmp_path / "ds", [np.arange(3, dtype=np.uint16)] * 2, np.dtype(np.uint16))
    assert files_in(tmp_path) == ["ds.bin", "ds.idx"]
    assert IndexedDataset(tmp_path / "ds").sequence_lengths.tolist() == [3, 3]
    assert before.get(0).tolist() == list(range(10))  # its memory maps hold the old files
