"""Packing, blending and reading ahead on real indexed datasets (written by hpctrain's writer).

Every token is its document's id x 1000 + its position in the document, so a sample says where each of its
tokens came from: packing and blending are checked token by token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config.schema import DataConfig, DataKind, parse_blend
from hpctrain.data.blend import BlendedSamples, PackedSamples, integer_weights
from hpctrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from hpctrain.data.loader import BatchReader, batch_of, open_datasets, validation_batches
from hpctrain.data.sampler import step_samples

SEQ = 16


def write_dataset(prefix: Path, lengths: list[int], base: int = 0) -> IndexedDataset:
    """Document d holds (base + d) * 1000 + position for each of its tokens."""
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for d, n in enumerate(lengths):
            writer.add_document((base + d) * 1000 + np.arange(n))
        writer.finalize()
    return IndexedDataset(prefix)


def lengths(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 60, n).tolist()


def test_a_sample_is_consecutive_tokens_of_consecutive_documents(tmp_path: Path) -> None:
    ds = write_dataset(tmp_path / "a", lengths(50, 0))
    packed = PackedSamples(ds, range(len(ds)), SEQ, seed=3)
    for s in range(3 * packed.samples_per_epoch):
        tokens = packed.sample(s)
        assert len(tokens) == SEQ + 1
        for prev, nxt in zip(tokens[:-1], tokens[1:]):
            doc, pos = divmod(int(prev), 1000)
            if pos + 1 < ds.sequence_lengths[doc]:
                assert nxt == prev + 1  # inside a document: the next position
            else:
                assert nxt % 1000 == 0 and nxt // 1000 != doc  # a document ended: another one starts


def test_an_epoch_reads_every_window_of_its_shuffled_stream_once(tmp_path: Path) -> None:
    ds = write_dataset(tmp_path / "a", lengths(40, 1))
    packed = PackedSamples(ds, range(len(ds)), SEQ, seed=3)
    epoch = [packed.sample(s) for s in range(packed.samples_per_epoch)]
    firsts = np.concatenate([t[:-1] for t in epoch])
    assert len(firsts) == packed.samples_per_epoch * SEQ == len(np.unique(firsts))  # no token twice
    assert packed.samples_per_epoch == (int(ds.sequence_lengths.sum()) - 1) // SEQ  # only the tail is left out
    second = [packed.sample(packed.samples_per_epoch + s) for s in range(packed.samples_per_epoch)]
    assert not all((a == b).all() for a, b in zip(epoch, second))  # another order in the next epoch
    again = PackedSamples(ds, range(len(ds)), SEQ, seed=3)
    assert all((again.sample(s) == t).all() for s, t in enumerate(epoch))  # the seed decides it all
    other = PackedSamples(ds, range(len(ds)), SEQ, seed=4)
    assert not all((other.sample(s) == t).all() for s, t in enumerate(epoch))


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.5, 0.2, 0.2, 0.05, 0.05], [0.999, 0.001]])
def test_a_blend_holds_each_share_within_a_sample_per_tree_level(weights: list[float]) -> None:
    counted = _Counting(len(weights))
    blend = BlendedSamples(counted.parts, weights)
    depth = int(np.ceil(np.log2(len(weights)))) or 1
    shares = np.array(integer_weights(weights)) / sum(integer_weights(weights))
    seen = np.zeros(len(weights), dtype=int)
    for g in range(20_000):
        part, local = blend.locate(g)
        assert local == seen[part]  # each dataset's own samples are taken in order: 0, 1, 2...
        seen[part] += 1
        assert np.all(np.abs(seen - (g + 1) * shares) <= depth), (g, seen)


def test_locating_a_sample_needs_nothing_but_its_id() -> None:
    blend = BlendedSamples(_Counting(5).parts, [0.4, 0.3, 0.15, 0.1, 0.05])
    sequential = [blend.locate(g) for g in range(1000)]
    assert [blend.locate(g) for g in reversed(range(1000))] == sequential[::-1]
    far = 10**12 + 17  # a run of trillions of samples: no index grows with it
    assert blend.locate(far) == BlendedSamples(_Counting(5).parts, [0.4, 0.3, 0.15, 0.1, 0.05]).locate(far)


class _Counting:
    """Datasets whose sample k is [k] * (SEQ + 1): which was read is visible in the tokens."""

    def __init__(self, n: int) -> None:
        self.parts = [self._Part(i) for i in range(n)]

    class _Part:
        seq_len = SEQ
        samples_per_epoch = 10**9

        def __init__(self, i: int) -> None:
            self.i = i

        def sample(self, k: int) -> np.ndarray:
            return np.full(SEQ + 1, self.i * 10**6 + k, dtype=np.int64)


def blended_config(tmp_path: Path, valid_fraction: float = 0.1) -> DataConfig:
    write_dataset(tmp_path / "a", lengths(80, 2), base=0)
    write_dataset(tmp_path / "b", lengths(30, 3), base=500)
    return DataConfig(
        kind=DataKind.indexed,
        blend=f"0.7 {tmp_path}/a 0.3 {tmp_path}/b",
        valid_fraction=valid_fraction,
        vocab_size=10**6,
    )


def test_validation_documents_are_never_trained_on(tmp_path: Path) -> None:
    data = open_datasets(blended_config(tmp_path, 0.1), SEQ, seed=1)
    train = {int(t) // 1000 for s in range(2000) for t in data.train.sample(s)}
    valid = {int(t) // 1000 for s in range(500) for t in data.valid.sample(s)}
    assert not train & valid
    assert valid == set(range(72, 80)) | set(range(527, 530))  # the last 10% of each dataset's documents
    assert train == set(range(72)) | set(range(500, 527))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_step_reads_the_same_blended_samples_whatever_the_dp_size(tmp_path: Path, dp: int) -> None:
    """Resharding: the ranks of any DP size together read exactly the rows one rank reads alone."""
    data = open_datasets(blended_config(tmp_path), SEQ, seed=1)
    alone = BatchReader(data.train, 16, 4, 1, 0)
    readers = [BatchReader(data.train, 16, 2, dp, r) for r in range(dp)]
    for step in range(5):
        whole = alone.batches(step * 16)[0].reshape(16, SEQ)
        parts = torch.cat([r.batches(step * 16)[0].reshape(-1, SEQ) for r in readers])
        assert torch.equal(whole, parts)
    for r in [alone, *readers]:
        r.close()


def test_reading_ahead_gives_what_reading_on_demand_gives(tmp_path: Path) -> None:
    """Exact resume: a reader that starts at any step (its whole state: the samples consumed) reads the
    same batches as one that read every step before, ahead or not."""
    data = open_datasets(blended_config(tmp_path), SEQ, seed=1)
    ahead = BatchReader(data.train, 8, 4, 2, 1, ahead=2)
    direct = [batch_of(data.train, step_samples(s * 8, 8, 2, 1), 4) for s in range(6)]
    assert all(torch.equal(ahead.batches(s * 8), direct[s]) for s in range(6))
    resumed = BatchReader(data.train, 8, 4, 2, 1, ahead=1)
    assert all(torch.equal(resumed.batches(s * 8), direct[s]) for s in range(3, 6))
    assert resumed.wait_s >= 0
    ahead.close()
    resumed.close()


def test_a_reading_error_reaches_the_training_thread(tmp_path: Path) -> None:
    data = open_datasets(blended_config(tmp_path), SEQ, seed=1)

    class Failing:
        seq_len = SEQ
        samples_per_epoch = 10

        def sample(self, k: int) -> np.ndarray:
            if k >= 8:
                raise OSError("stale file handle")
            return data.train.sample(k)

    reader = BatchReader(Failing(), 8, 4, 1, 0, ahead=1)
    reader.batches(0)
    with pytest.raises(OSError, match="stale file handle"):
        reader.batches(8)
    reader.close()


def test_validation_batches_are_the_same_every_time_and_across_dp(tmp_path: Path) -> None:
    data = open_datasets(blended_config(tmp_path), SEQ, seed=1)
    one = validation_batches(data.valid, 3, 8, 4, 1, 0)
    two = [validation_batches(data.valid, 3, 8, 2, 2, r) for r in range(2)]
    for b in range(3):
        assert torch.equal(one[b][0].reshape(8, SEQ), torch.cat([two[r][b][0].reshape(4, SEQ) for r in range(2)]))
    assert all(torch.equal(a, b) for a, b in zip(one, validation_batches(data.valid, 3, 8, 4, 1, 0)))


def test_separate_validation_prefixes(tmp_path: Path) -> None:
    cfg = blended_config(tmp_path, valid_fraction=0.0)
    write_dataset(tmp_path / "v", lengths(20, 4), base=900)
    cfg.valid_blend = f"{tmp_path}/v"
    data = open_datasets(cfg, SEQ, seed=1)
    assert {int(t) // 1000 for s in range(50) for t in data.valid.sample(s)} <= set(range(900, 920))
    assert {int(t) // 1000 for s in range(500) for t in data.train.sample(s)} == set(range(80)) | set(range(500, 530))


@pytest.mark.parametrize(
    "text, message",
    [("0.3 a 0.7", "weight/prefix pairs"), ("x a 0.5 b", "'x' is not a weight"), ("0 a 1 b", "must be > 0")],
)
def test_bad_blends_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_blend(text)
    assert parse_blend("/data/a") == [(1.0, "/data/a")]


def test_a_token_outside_the_vocabulary_is_named_before_the_model_sees_it(tmp_path: Path) -> None:
    data = open_datasets(blended_config(tmp_path), SEQ, seed=1)  # token ids up to 529 * 1000 + 59
    with pytest.raises(ValueError, match=r"sample \d+ holds token id \d+, but data.vocab_size=1000"):
        batch_of(data.train, range(8), 4, vocab_size=1000)
    reader = BatchReader(data.train, 8, 4, 1, 0, vocab_size=1000)
    with pytest.raises(ValueError, match="tokenised with a larger vocabulary"):
        reader.batches(0)
    reader.close()
