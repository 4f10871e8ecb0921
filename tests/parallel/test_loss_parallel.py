"""Loss parallelism on real gloo ranks: under TP the logits stay split by vocabulary and the loss is computed on
the shards (hpctrain.parallel.tensor_parallel.vocab_parallel_cross_entropy), equal to F.cross_entropy on the
full logits, and no TP rank ever holds a full-vocabulary logits tensor during a step."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.parallel import tensor_parallel
from hpctrain.parallel.tensor_parallel import vocab_parallel_cross_entropy
from hpctrain.plan import activations
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import SEQ, make_cfg

# A vocabulary no other width of the tiny model shares (d 64, QKV 192, MLP 256: 32, 96 and 128 per TP rank),
# padded to 1024 rows for TP 2: each rank holds 512 columns, rank 1 its last 24 padding.
VOCAB = 1000
PADDED = 1024
WIDE = {"model__vocab_size": VOCAB, "data__vocab_size": VOCAB}
PP = {"parallel__pp": 2, "train__micro_batch": 2}


def _full_loss(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab).float(), targets.reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [2**24, 20])  # one chunk; chunks of 2 tokens
def test_one_process_equals_cross_entropy(dtype: torch.dtype, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a mesh the function is F.cross_entropy on the real columns; padding columns get no gradient."""
    monkeypatch.setattr(tensor_parallel, "LOSS_CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, 10, (3, 5), generator=gen)
    loss = vocab_parallel_cross_entropy(logits, targets, 10)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = _full_loss(logits, targets, 10)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    assert grad.dtype == dtype and not grad[..., 10:].any()
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def _sharded_loss(rank: int, world: int, vocab: int) -> tuple[float, torch.Tensor, float, torch.Tensor]:
    """(loss, this rank's gradient slice) of the function on a Shard(-1) DTensor, and F.cross_entropy's on the
    full logits (every rank draws the same ones)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(4, 6, 8 * world, generator=gen)
    targets = torch.randint(0, vocab, (4, 6), generator=gen)
    width = full.shape[-1] // world
    local = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(DTensor.from_local(local, mesh, [Shard(2)]), targets, vocab)
    loss.backward()
    whole = full.clone().requires_grad_()
    ref = _full_loss(whole, targets, vocab)
    ref.backward()
    assert whole.grad is not None and local.grad is not None
    return loss.item(), local.grad, ref.item(), whole.grad[..., rank * width : (rank + 1) * width]


@pytest.mark.parametrize("vocab", [13, 6], ids=["padding_on_rank1", "rank1_all_padding"])
def test_sharded_loss_equals_cross_entropy_on_the_full_logits(vocab: int) -> None:
    """2 ranks x 8 columns: the real vocabulary ends inside rank 1's shard, or before it (a shard of padding)."""
    for loss, grad, ref, ref_grad in run_distributed(_sharded_loss, 2, vocab, timeout=120):
        assert loss == pytest.approx(ref, rel=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


class _LastDims(TorchDispatchMode):
    """Counts the last dimension of every tensor an op makes (a DTensor's: of its local shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[int] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                self.counts[(t.to_local() if isinstance(t, DTensor) else t).shape[-1]] += 1
        return out


def _step_shapes(rank: int, world: int, overrides: dict[str, Any]) -> tuple[bool, dict[int, int], list[float]]:
    """(whether this rank holds the last stage, last dims made during two steps and an evaluation, the losses)."""
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(0, VOCAB, (cfg.train.global_batch, SEQ + 1), generator=gen)  # dp 1: every rank all
    batches = torch.stack([rows[:, :-1], rows[:, 1:]]).reshape(2, -1, cfg.train.micro_batch, SEQ)
    shapes = _LastDims()
    with shapes:
        losses = [engine.step(batches, cfg.optim.lr).loss for _ in range(2)]
        losses.append(engine.evaluate([batches]))
    return engine.has_last, dict(shapes.counts), losses


def _reference_loss(overrides: dict[str, Any]) -> float:
    """The first step's loss of the one-process model (padded as for TP 2) by F.cross_entropy."""
    from hpctrain.parallel.engine import build_model

    cfg = make_cfg(1, **overrides)
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"), 2)
    rows = torch.randint(0, VOCAB, (cfg.train.global_batch, SEQ + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return _full_loss(model(rows[:, :-1]), rows[:, 1:], VOCAB).item()


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, {"parallel__tp": 2}),
        (2, {"parallel__tp": 2, "parallel__sequence_parallel": True, "model__arch": "llama", "model__n_kv_heads": 2}),
        (4, {"parallel__tp": 2, **PP}),
    ],
    ids=["tp2_gpt_tied", "tp2_sp_llama", "tp2xpp2_gpt_tied"],
)
def test_no_tp_rank_holds_full_vocabulary_logits(world: int, overrides: dict[str, Any]) -> None:
    """During a step, its backward and an evaluation, no tensor on any TP rank has the (padded or real) full
    vocabulary as its last dimension, while the last stage's ranks make the vocab/tp-wide logits; the loss is
    F.cross_entropy's on the one-process model's full logits."""
    overrides = {**WIDE, **overrides}
    ref = _reference_loss(overrides)
    results = run_distributed(_step_shapes, world, overrides, timeout=240)
    for rank, (has_last, counts, losses) in enumerate(results):
        assert not {PADDED, VOCAB} & set(counts), (rank, {d: counts[d] for d in (PADDED, VOCAB) if d in counts})
        assert counts.get(PADDED // 2, 0) > 0 or not has_last, rank
        assert losses == results[0][2]
    assert results[0][2][0] == pytest.approx(ref, rel=1e-5)


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that ops make while it is on (each storage counted until freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.held:
                storage = t.untyped_storage()
                self.held.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.data_ptr(), storage.nbytes())
        return out

    def _free(self, address: int, nbytes: int) -> None:
        self.held.discard(address)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_holds_what_the_planner_counts(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's output, the loss and its backward at their peak: activations.logits_bytes (2 c a logit and one
    fp32 chunk; here 4 chunks of 32 tokens), plus no more than the head's gradient and a few vectors a token."""
    monkeypatch.setattr(tensor_parallel, "LOSS_CHUNK_ELEMENTS", 2**14)
    monkeypatch.setattr(activations, "LOSS_CHUNK_ELEMENTS", 2**14)
    tokens, columns = 128, 512
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, 16, generator=gen).to(dtype)
    head = torch.randn(columns, 16, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, columns, (tokens,), generator=gen)
    live = _LiveBytes()
    with live:
        loss = vocab_parallel_cross_entropy(hidden @ head.t(), targets, columns)
        loss.backward()
    planned = activations.logits_bytes(1, tokens, columns, dtype.itemsize)
    small = head.numel() * dtype.itemsize + 32 * tokens  # the head's gradient; per-token fp32/int64 vectors
    assert planned <= live.peak <= planned + small, (live.peak, planned)


def test_the_planner_chunks_as_the_engine_does() -> None:
    """The planner (no torch) keeps its own copy of the loss's chunk size."""
    assert activations.LOSS_CHUNK_ELEMENTS == tensor_parallel.LOSS_CHUNK_ELEMENTS
