"""What a task reads: the training and validation samples of its data config, and each step's batches read
ahead in a background thread.

The batches of a step are known before it starts (global sample ids [consumed, consumed + global batch), this
DP rank's contiguous slice), so the reader fills them while the previous step computes: the step then waits
only if reading is slower than computing, and that wait is measured (`data_wait_s` in metrics.jsonl). On a
GPU the batches are assembled in pinned host memory, so the engine's copy to the device is asynchronous.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hpctrain.config.schema import DataConfig, DataKind, parse_blend
from hpctrain.data.blend import BlendedSamples, PackedSamples
from hpctrain.data.indexed import IndexedDataset
from hpctrain.data.sampler import SampleIndex, Samples, micro_batches, rows, step_samples
from hpctrain.data.sources import open_tokens

TRAIN, VALID = 0, 1  # the split's number in each dataset's shuffle seed


@dataclass
class Datasets:
    train: Samples
    valid: Samples | None  # None: no validation split configured


def open_datasets(data: DataConfig, seq_len: int, seed: int) -> Datasets:
    """The config's training samples and, when `valid_fraction` or `valid_blend` asks for one, validation ones.
    The validation split is held out: no training sample reads its tokens."""
    if data.kind == DataKind.indexed:
        return _indexed(data, seq_len, seed)
    tokens = open_tokens(data)
    if tokens is None:  # synthetic: a validation "split" is other random tokens
        valid = SampleIndex(None, seq_len, seed + 1, data.vocab_size) if data.valid_fraction > 0 else None
        return Datasets(SampleIndex(None, seq_len, seed, data.vocab_size), valid)
    held_out = int(len(tokens) * data.valid_fraction)
    train = SampleIndex(tokens[: len(tokens) - held_out], seq_len, seed, data.vocab_size)
    valid = SampleIndex(tokens[len(tokens) - held_out :], seq_len, seed, data.vocab_size) if held_out else None
    return Datasets(train, valid)


def _indexed(data: DataConfig, seq_len: int, seed: int) -> Datasets:
    blend = parse_blend(data.blend or "")
    opened = [IndexedDataset(prefix) for _, prefix in blend]
    weights = [w for w, _ in blend]
    train, valid = [], []
    for i, ds in enumerate(opened):
        cut = _train_sequences(ds, data.valid_fraction)
        train.append(PackedSamples(ds, range(cut), seq_len, seed, (i, TRAIN)))
        if data.valid_fraction > 0 and not data.valid_blend:
            valid.append(PackedSamples(ds, range(cut, len(ds)), seq_len, seed, (i, VALID)))
    valid_weights = weights
    if data.valid_blend:
        valid_pairs = parse_blend(data.valid_blend)
        valid_weights = [w for w, _ in valid_pairs]
        opened_valid = [IndexedDataset(p) for _, p in valid_pairs]  # each open checks the whole index: once
        valid = [PackedSamples(ds, range(len(ds)), seq_len, seed, (i, VALID)) for i, ds in enumerate(opened_valid)]
    return Datasets(_blended(train, weights), _blended(valid, valid_weights) if valid else None)


def _train_sequences(ds: IndexedDataset, valid_fraction: float) -> int:
    """Where the training sequences end: before the last `valid_fraction` of the documents (a document's
    sequences are never split between training and validation)."""
    documents = len(ds.document_indices) - 1
    held_out = int(round(documents * valid_fraction))
    if valid_fraction > 0 and (held_out < 1 or held_out >= documents):
        raise ValueError(
            f"{ds.prefix}: data.valid_fraction={valid_fraction} of {documents} documents holds out "
            f"{held_out}: there must be documents on both sides"
        )
    return int(ds.document_indices[documents - held_out])


def _blended(parts: list[PackedSamples], weights: list[float]) -> Samples:
    return parts[0] if len(parts) == 1 else BlendedSamples(parts, weights)


class BatchReader:
    """One DP rank's batches for each step, read `ahead` steps in advance by one background thread.

    A step's batches are one [2, microbatches, micro_batch, seq_len] int64 tensor (inputs, targets), the
    engine's input. Buffers are reused round-robin, `ahead + 1` of them: while the step of one is running,
    the others are being filled; by the time a buffer comes round again its step has ended (its loss was
    reduced to the host, so a device copy out of it has finished)."""

    def __init__(
        self,
        dataset: Samples,
        global_batch: int,
        micro_batch: int,
        dp: int,
        dp_rank: int,
        pin: bool = False,
        ahead: int = 1,
        vocab_size: int | None = None,
        stride: int | None = None,
    ) -> None:
        """`stride`: how far one step's first sample is from the next's (default: `global_batch`; replica groups
        each read their share of a larger step)."""
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.stride = stride or global_batch
        self.vocab_size = vocab_size
        self.dp, self.dp_rank, self.ahead = dp, dp_rank, ahead
        per_rank = global_batch // dp
        shape = (2, per_rank // micro_batch, micro_batch, dataset.seq_len)
        self._buffers = [torch.empty(shape, dtype=torch.int64, pin_memory=pin) for _ in range(ahead + 1)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-data") if ahead else None
        self._pending: dict[int, Future[torch.Tensor]] = {}
        self.wait_s = 0.0  # how long the last `batches` call waited for its step's data

    def batches(self, consumed: int) -> torch.Tensor:
        """The batches of the step that starts after `consumed` samples; queues the reads of the next steps."""
        started = time.perf_counter()
        pending = self._pending.pop(consumed, None)
        batch = pending.result() if pending is not None else self._fill(consumed)
        self.wait_s = time.perf_counter() - started
        if self._pool is not None:
            for k in range(1, self.ahead + 1):
                later = consumed + k * self.stride
                if later not in self._pending:
                    self._pending[later] = self._pool.submit(self._fill, later)
        return batch

    def _fill(self, consumed: int) -> torch.Tensor:
        out = self._buffers[(consumed // self.stride) % len(self._buffers)]
        fill_batch(self.dataset, step_samples(consumed, self.global_batch, self.dp, self.dp_rank), out, self.vocab_size)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending.clear()


def fill_batch(dataset: Samples, samples: range, out: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Write `samples` into `out` [2, microbatches, micro_batch, seq_len]: inputs, then targets. A token id
    outside `vocab_size` raises here, naming the sample: on a GPU it would be a device-side assert in the
    embedding, far from its cause (data made with another tokenizer)."""
    seq = out.shape[-1]
    block = torch.from_numpy(rows(dataset, samples))
    if vocab_size is not None and int(block.max()) >= vocab_size:
        row = int((block >= vocab_size).any(dim=1).nonzero()[0])
        raise ValueError(
            f"sample {samples[row]} holds token id {int(block[row].max())}, but data.vocab_size="
            f"{vocab_size}: the data was tokenised with a larger vocabulary than the config says; "
            "set data.vocab_size (and model.vocab_size) to the tokenizer's"
        )
    out[0].view(-1, seq).copy_(block[:, :-1])
    out[1].view(-1, seq).copy_(block[:, 1:])
    return out


def batch_of(dataset: Samples, samples: range, micro_batch: int, vocab_size: int | None = None) -> torch.Tensor:
    """A new [2, microbatches, micro_batch, seq_len] tensor of `samples` (validation, tests and tools)."""
    parts = micro_batches(samples, micro_batch)
    out = torch.empty((2, len(parts), micro_batch, dataset.seq_len), dtype=torch.int64)
    return fill_batch(dataset, samples, out, vocab_size)


def validation_batches(
    dataset: Samples,
    eval_batches: int,
    global_batch: int,
    micro_batch: int,
    dp: int,
    dp_rank: int,
    vocab_size: int | None = None,
) -> list[torch.Tensor]:
    """The validation samples of this DP rank: global batches 0..eval_batches-1 of the validation split,
    the same every time (curves compare across resumes and layouts)."""
    return [
        batch_of(dataset, step_samples(b * global_batch, global_batch, dp, dp_rank), micro_batch, vocab_size)
        for b in range(eval_batches)
    ]
