"""A deterministic sampler whose whole state is one number: the global sample index.

Global sample g (counted from the start of training over all ranks) maps to a fixed window of the token
array through a seeded permutation per epoch. A step consumes samples [step * global_batch, (step + 1) *
global_batch) whatever the DP size; each DP rank takes a contiguous slice. So a resumed run continues at
exactly the next sample, even with a different number of data-parallel ranks (no sample skipped or
repeated), and no sampler state beyond the index needs saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class Samples(Protocol):
    """What the training loop reads: global sample id -> seq_len + 1 token ids, the same on every rank."""

    seq_len: int

    @property
    def samples_per_epoch(self) -> int: ...

    def sample(self, sample: int) -> np.ndarray: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class AffinePermutation:
    """i -> (a * i + b) mod n with gcd(a, n) = 1: a bijection on [0, n) needing O(1) memory."""

    n: int
    a: int
    b: int

    @classmethod
    def seeded(cls, n: int, seed: int) -> AffinePermutation:
        rng = np.random.default_rng(seed)
        a = int(rng.integers(1, max(2, n)))
        while math.gcd(a, n) != 1:
            a = a % n + 1
        return cls(n=n, a=a, b=int(rng.integers(0, n)))

    def __call__(self, i: int) -> int:
        return (self.a * i + self.b) % self.n


class SampleIndex:
    """Maps global sample ids to token windows of seq_len + 1 (inputs and shifted targets) of one flat array
    of tokens (a split of it is a slice: the memory map is not read)."""

    def __init__(self, tokens: np.ndarray | None, seq_len: int, seed: int, vocab_size: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.windows = (len(tokens) - 1) // seq_len if tokens is not None else 1 << 40
        if self.windows < 1:
            raise ValueError(
                f"the data holds {0 if tokens is None else len(tokens)} tokens, fewer than one "
                f"sample of seq_len {seq_len} + 1"
            )
        self._perms: dict[int, AffinePermutation] = {}

    def window_of(self, sample: int) -> int:
        epoch, j = divmod(sample, self.windows)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = self._perms.setdefault(epoch, AffinePermutation.seeded(self.windows, self.seed * 100003 + epoch))
        return perm(j)

    @property
    def samples_per_epoch(self) -> int:
        return self.windows

    def describe(self) -> str:
        if self.tokens is None:
            return f"random tokens below {self.vocab_size}"
        return f"{len(self.tokens):,} tokens, {self.windows:,} samples per epoch"

    def sample(self, sample: int) -> np.ndarray:
        """seq_len + 1 token ids of global sample `sample`."""
        if self.tokens is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + sample)
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen).numpy()
        start = self.window_of(sample) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


def rows(dataset: Samples, samples: range) -> np.ndarray:
    """[len(samples), seq_len + 1] token ids: each row an input and, shifted by one, its targets."""
    return np.stack([dataset.sample(s) for s in samples])


def step_samples(consumed: int, global_batch: int, dp: int, dp_rank: int) -> range:
    """The global sample ids a DP rank consumes in the step that starts after `consumed` samples."""
    per_rank = global_batch // dp
    start = consumed + dp_rank * per_rank
    return range(start, start + per_rank)


def micro_batches(samples: range, micro_batch: int) -> list[range]:
    return [samples[i : i + micro_batch] for i in range(0, len(samples), micro_batch)]
