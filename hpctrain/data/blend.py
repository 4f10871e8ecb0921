"""Samples from Megatron-format indexed datasets: documents packed into fixed-length samples, and several
datasets blended by weight, each sample found from its global id alone.

Packing (Megatron's GPTDataset): each epoch, a dataset's documents are shuffled and laid end to end (each
ends with its end-of-document token, written by prepare); sample j of the epoch is the tokens [j * seq_len,
(j + 1) * seq_len + 1) of that stream, so a sample crosses document boundaries and no token is padding. The
epoch's samples are visited in a seeded permutation. The tail shorter than a sample is left out of the epoch.

Blending: weights are made integers (parts per million) and the datasets are the leaves of a balanced binary
tree. At a node with weights a (left) and s (both), the first g samples hold round(g a / s) from the left:
sample g goes left when that count grows at g + 1, and is then the left subtree's sample number round(g a
/ s), else the right's number g - round(g a / s). That is O(log datasets) integer arithmetic per sample with
no index to build or store: any global id is found directly, which is all exact resume and resharding to
another DP size need (the sampler's state stays one global sample index). Every prefix of n samples holds
each dataset's share of n within one sample per tree level (Megatron's greedy index: within one, but built
as an array of every sample of the run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpctrain.data.indexed import IndexedDataset
from hpctrain.data.sampler import AffinePermutation, Samples

WEIGHT_RESOLUTION = 1_000_000
EPOCHS_KEPT = 2  # a dataset's shuffled document order is rebuilt per epoch; the last two are kept


class PackedSamples:
    """One indexed dataset's sequences [first, last) packed into samples of seq_len + 1 tokens.

    `stream` makes the shuffles of each split and each dataset of a blend their own (train and validation
    samples of one prefix are drawn independently)."""

    def __init__(
        self, dataset: IndexedDataset, sequences: range, seq_len: int, seed: int, stream: tuple[int, ...] = ()
    ) -> None:
        self.dataset, self.sequences, self.seq_len = dataset, sequences, seq_len
        self._seed = [seed, *stream]
        self._lengths = dataset.sequence_lengths[sequences.start : sequences.stop].astype(np.int64)
        self._starts = dataset.sequence_pointers[sequences.start : sequences.stop] // dataset.dtype.itemsize
        self.tokens_per_epoch = int(self._lengths.sum())
        self.windows = (self.tokens_per_epoch - 1) // seq_len
        if self.windows < 1:
            raise ValueError(
                f"{dataset.prefix}: sequences {sequences.start}..{sequences.stop} hold "
                f"{self.tokens_per_epoch} tokens, fewer than one sample of seq_len {seq_len} + 1"
            )
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._perms: dict[int, AffinePermutation] = {}

    @property
    def samples_per_epoch(self) -> int:
        return self.windows

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's document order and the stream offset where each of its documents starts."""
        if epoch not in self._epochs:
            order = np.random.default_rng([*self._seed, epoch]).permutation(len(self._lengths))
            ends = np.cumsum(self._lengths[order])
            self._epochs[epoch] = (order, np.concatenate([[0], ends]))
            self._perms[epoch] = AffinePermutation.seeded(
                self.windows, int(np.random.default_rng([*self._seed, epoch, 1]).integers(1 << 62))
            )
            while len(self._epochs) > EPOCHS_KEPT:
                old, _ = self._epochs.popitem(last=False)
                del self._perms[old]
        self._epochs.move_to_end(epoch)
        return self._epochs[epoch]

    def sample(self, sample: int) -> np.ndarray:
        epoch, j = divmod(sample, self.windows)
        order, offsets = self._epoch(epoch)
        start = self._perms[epoch](j) * self.seq_len
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        p = int(np.searchsorted(offsets, start, side="right")) - 1
        filled, within = 0, start - int(offsets[p])
        while filled < len(out):
            doc = order[p]
            take = min(int(self._lengths[doc]) - within, len(out) - filled)
            first = int(self._starts[doc]) + within
            out[filled : filled + take] = self.dataset.tokens[first : first + take]
            filled, within, p = filled + take, 0, p + 1
        return out

    def describe(self) -> str:
        return (
            f"{self.dataset.prefix} sequences {self.sequences.start}..{self.sequences.stop}: "
            f"{self.tokens_per_epoch:,} tokens, {self.windows:,} samples per epoch"
        )


@dataclass(frozen=True)
class _Node:
    """A subtree of the blend: a leaf holds one dataset, an inner node splits between two subtrees."""

    weight: int
    part: int = -1
    left: _Node | None = None
    right: _Node | None = None


def integer_weights(weights: list[float]) -> list[int]:
    total = sum(weights)
    return [max(1, round(w / total * WEIGHT_RESOLUTION)) for w in weights]


def _tree(parts: list[int], weights: list[int]) -> _Node:
    if len(parts) == 1:
        return _Node(weights[parts[0]], part=parts[0])
    half = len(parts) // 2
    left, right = _tree(parts[:half], weights), _tree(parts[half:], weights)
    return _Node(left.weight + right.weight, left=left, right=right)


class BlendedSamples:
    """Several datasets' samples interleaved by weight (module docstring); a sample's source comes from its id."""

    def __init__(self, parts: Sequence[Samples], weights: list[float]) -> None:
        if len(parts) != len(weights) or not parts:
            raise ValueError(f"{len(parts)} datasets and {len(weights)} weights")
        self.parts, self.weights = parts, weights
        self.seq_len = parts[0].seq_len
        self._root = _tree(list(range(len(parts))), integer_weights(weights))

    @property
    def samples_per_epoch(self) -> int:
        """Samples before the first dataset starts its second epoch."""
        total = sum(self.weights)
        return min(int(p.samples_per_epoch * total / w) for p, w in zip(self.parts, self.weights))

    def locate(self, sample: int) -> tuple[int, int]:
        """(dataset, that dataset's own sample id) of global sample `sample`."""
        node, g = self._root, sample
        while node.left is not None and node.right is not None:
            left, right = node.left, node.right
            a, s = left.weight, node.weight
            before = (g * a + s // 2) // s  # left subtree's samples among this node's first g
            if ((g + 1) * a + s // 2) // s > before:
                node, g = left, before
            else:
                node, g = right, g - before
        return node.part, g

    def sample(self, sample: int) -> np.ndarray:
        part, local = self.locate(sample)
        return self.parts[part].sample(local)

    def describe(self) -> str:
        total = sum(self.weights)
        return "; ".join(f"{w / total:.3f} x {p.describe()}" for p, w in zip(self.parts, self.weights))
