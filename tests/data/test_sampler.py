"""The sampler: deterministic, a bijection per epoch, and exact across DP sizes."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.data.loader import batch_of
from hpctrain.data.sampler import (
    AffinePermutation,
    SampleIndex,
    micro_batches,
    step_samples,
)
from hpctrain.data.sources import build_text_bytes, stdlib_sources


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 4096])
def test_affine_permutation_is_a_bijection(n: int) -> None:
    perm = AffinePermutation.seeded(n, seed=3)
    assert sorted(perm(i) for i in range(n)) == list(range(n))


def test_permutation_depends_on_seed() -> None:
    a = [AffinePermutation.seeded(1000, 1)(i) for i in range(10)]
    b = [AffinePermutation.seeded(1000, 2)(i) for i in range(10)]
    assert a != b


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_a_step_consumes_the_same_samples_whatever_the_dp_size(dp: int) -> None:
    for step in range(3):
        ranks = [step_samples(step * 32, 32, dp, r) for r in range(dp)]
        flat = [s for r in ranks for s in r]
        assert flat == list(range(step * 32, (step + 1) * 32))


def test_resharding_mid_run_neither_skips_nor_repeats() -> None:
    seen = [s for step in range(5) for r in range(4) for s in step_samples(step * 16, 16, 4, r)]
    seen += [s for step in range(5, 9) for r in range(2) for s in step_samples(step * 16, 16, 2, r)]
    assert seen == list(range(9 * 16))


def test_micro_batches_split_a_rank_slice() -> None:
    parts = micro_batches(range(8, 16), 4)
    assert [list(p) for p in parts] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_windows_cover_each_epoch_once() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    index = SampleIndex(tokens, seq_len=10, seed=0, vocab_size=2000)
    starts = sorted(index.window_of(s) for s in range(index.windows))
    assert starts == list(range(index.windows))
    batch = batch_of(index, range(4), micro_batch=2)
    x, y = batch[0].reshape(4, 10), batch[1].reshape(4, 10)
    assert batch.shape == (2, 2, 2, 10) and (y[:, :-1] == x[:, 1:]).all()
    assert [int(x[i, 0]) for i in range(4)] == [index.window_of(s) * 10 for s in range(4)]


def test_synthetic_samples_are_reproducible() -> None:
    index = SampleIndex(None, seq_len=16, seed=5, vocab_size=100)
    assert (index.sample(42) == index.sample(42)).all()
    assert not (index.sample(42) == index.sample(43)).all()


def test_text_bytes_is_real_python_source(tmp_path) -> None:
    assert len(stdlib_sources()) > 100
    path = build_text_bytes(max_bytes=200_000, cache_dir=tmp_path)
    data = path.read_bytes()
    assert len(data) == 200_000
    assert b"def " in data and b"import " in data
    assert build_text_bytes(max_bytes=200_000, cache_dir=tmp_path) == path  # cached


def test_a_cached_corpus_is_found_without_walking_the_standard_library(tmp_path, monkeypatch) -> None:
    """Every restarted worker opens the corpus: once it is built, finding it must not list the library's
    files (0.6 s)."""
    from hpctrain.data import sources

    path = build_text_bytes(max_bytes=50_000, cache_dir=tmp_path)

    def walked() -> list:
        raise AssertionError("the standard library was walked for a cached corpus")

    monkeypatch.setattr(sources, "stdlib_sources", walked)
    assert build_text_bytes(max_bytes=50_000, cache_dir=tmp_path) == path
    with pytest.raises(AssertionError, match="walked"):  # another size is another corpus: built
        build_text_bytes(max_bytes=60_000, cache_dir=tmp_path)
