"""Context parallelism's chunking and attention: on gloo ranks, the CP attention's output and input gradients
equal full causal attention on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models.common import attention
from hpctrain.parallel import context_parallel as cpmod
from hpctrain.parallel.engine import token_loss
from tests.distributed_harness import run_distributed


def test_chunks_mirror_and_cover_the_sequence() -> None:
    assert cpmod.chunk_order(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpmod.chunk_order(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([cpmod.chunk_order(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    assert torch.equal(held[cpmod.gathered_to_global(24, 3)], torch.arange(24))
    tokens = torch.arange(16).view(2, 8)
    assert cpmod.shard_sequence(tokens, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    step = torch.arange(2 * 3 * 2 * 8).view(2, 3, 2, 8)  # the engine's [inputs/targets, microbatches, micro_batch, seq]
    assert torch.equal(cpmod.shard_sequence(step, 2, 0, dim=-1), step[..., [0, 1, 6, 7]])


def test_a_sequence_that_does_not_cut_evenly_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4"):
        cpmod.chunk_order(10, 2, 0)


def _attention_matches(rank: int, world: int, hq: int, hkv: int, seq_len: int, repeat: bool) -> float:
    """Max abs difference of output and q/k/v gradients between CP attention and full causal attention.
    `repeat`: take the path of CUDA in fp32, key/value heads repeated after the gather (attention.grouped_kv)."""
    if repeat:
        attention.sdpa_expands_kv = lambda *args: True  # this forked rank's copy of the module only
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, seq_len, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, seq_len, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, seq_len, 8, generator=gen, requires_grad=True)
    grad = torch.randn(2, hq, seq_len, 8, generator=gen)
    gqa = hq != hkv
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    ref.backward(grad)

    local = [cpmod.shard_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = cpmod.cp_attention(*local, group=dist.group.WORLD)
    out.backward(cpmod.shard_sequence(grad, world, rank, dim=2))
    diffs = [(out - cpmod.shard_sequence(ref.detach(), world, rank, dim=2)).abs().max()]
    for mine, full in zip(local, (q, k, v)):
        diffs.append((mine.grad - cpmod.shard_sequence(full.grad, world, rank, dim=2)).abs().max())
    return max(float(d) for d in diffs)


@pytest.mark.parametrize(
    "world,hq,hkv,repeat",
    [(2, 4, 4, False), (2, 4, 2, False), (2, 4, 2, True), (4, 4, 1, False)],
    ids=["mha-cp2", "gqa-cp2", "gqa-cp2-repeated", "mqa-cp4"],
)
def test_cp_attention_equals_full_causal_attention(world: int, hq: int, hkv: int, repeat: bool) -> None:
    diffs = run_distributed(_attention_matches, world, hq, hkv, 16, repeat, timeout=120)
    assert max(diffs) < 1e-5, diffs


def _model(family: str) -> torch.nn.Module:
    from hpctrain.models.gpt.model import GPT, GPTArgs
    from hpctrain.models.llama.model import Llama, LlamaArgs

    if family == "gpt":
        model = GPT(GPTArgs(n_layers=2, d_model=32, n_heads=4, vocab_size=50, seq_len=16, ffn_hidden=64))
    else:
        model = Llama(LlamaArgs(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=64))
    model.init_weights(seed=0)
    return model


def _model_matches(rank: int, world: int, family: str) -> float:
    """Max abs difference of the logits, the loss and the gradients between a CP model on this rank's chunks and
    the one-process model. Each CP rank takes the engine's loss (`token_loss`, the mean over its tokens) and
    the gradients are averaged over the CP group (what FSDP over (dp_shard, cp) does): every CP rank holds the
    same number of tokens, so that is exactly the one-process token mean."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    labels = torch.randint(0, 50, (2, 16), generator=gen)
    ref_model, model = _model(family), _model(family)
    ref = ref_model(tokens)
    ref_loss = token_loss(ref, labels)
    ref_loss.backward()

    cpmod.apply_context_parallel(model, dist.group.WORLD)
    logits = model(cpmod.shard_sequence(tokens, world, rank))
    loss = token_loss(logits, cpmod.shard_sequence(labels, world, rank))
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    diffs = [
        (logits.detach() - cpmod.shard_sequence(ref.detach(), world, rank)).abs().max(),
        (mean_loss / world - ref_loss.detach()).abs(),
    ]
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        dist.all_reduce(p.grad)
        diffs.append((p.grad / world - ref_p.grad).abs().max())
    return max(float(d) for d in diffs)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_cp2_model_equals_the_one_process_model(family: str) -> None:
    diffs = run_distributed(_model_matches, 2, family, timeout=120)
    assert max(diffs) < 1e-5, diffs


def _gathers_in_backward(rank: int, world: int, mode: str) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) dispatched by the backward of a 2-layer CP Llama under `mode`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpctrain.parallel.recompute import apply_recompute

    ops = torch.ops._c10d_functional

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.gathers = self.scatters = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.gathers += func == ops.all_gather_into_tensor.default
            self.scatters += func == ops.reduce_scatter_tensor.default
            return func(*args, **(kwargs or {}))

    model = _model("llama")
    cpmod.apply_context_parallel(model, dist.group.WORLD)
    apply_recompute(model, mode)
    tokens = cpmod.shard_sequence(
        torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)), world, rank
    )
    loss = model(tokens).float().mean()
    with Count() as count:
        loss.backward()
    return count.gathers, count.scatters


@pytest.mark.parametrize("mode,gathers", [("none", 0), ("selective", 0), ("full", 4)])
def test_recomputation_gathers_keys_and_values_again_only_when_full(mode: str, gathers: int) -> None:
    """The selective policy keeps the all-gathered keys and values (collective outputs), so backward only
    reduce-scatters their gradients (2 per layer); full recomputation reruns each layer's 2 gathers."""
    counts = run_distributed(_gathers_in_backward, 2, mode, timeout=120)
    assert all(c == (gathers, 4) for c in counts), counts


def _index_builds(rank: int, world: int, family: str) -> tuple[list[int], bool]:
    """Calls of `gathered_to_global` and `chunk_order` in each of two forwards (then a backward) of a 3-layer CP
    model, and whether its logits equal a model whose layers build every index again (no cache)."""
    counts = {"gathered_to_global": 0, "chunk_order": 0}
    originals = {name: getattr(cpmod, name) for name in counts}

    def counted(name: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    from hpctrain.models.gpt.model import GPT, GPTArgs
    from hpctrain.models.llama.model import Llama, LlamaArgs

    def model() -> torch.nn.Module:
        m = (
            GPT(GPTArgs(n_layers=3, d_model=32, n_heads=4, vocab_size=50, seq_len=16, ffn_hidden=64))
            if family == "gpt"
            else Llama(LlamaArgs(n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=64))
        )
        m.init_weights(seed=0)
        cpmod.apply_context_parallel(m, dist.group.WORLD)
        return m

    tokens = cpmod.shard_sequence(
        torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)), world, rank
    )
    cached, uncached = model(), model()
    for name in counts:
        setattr(cpmod, name, counted(name))
    per_forward = []
    for _ in range(2):
        before = sum(counts.values()), counts["gathered_to_global"]
        logits = cached(tokens)
        per_forward += [counts["gathered_to_global"] - before[1], sum(counts.values()) - before[0]]
    logits.float().mean().backward()
    per_forward.append(sum(counts.values()))
    for name, original in originals.items():
        setattr(cpmod, name, original)
    if not hasattr(cpmod, "build_indices"):  # the code before the cache: nothing to compare with
        return per_forward, True
    for layer_core in [
        m for m in uncached.modules() if isinstance(getattr(m, "attention", None), cpmod.ContextParallelAttention)
    ]:
        layer_core.attention.indices = cpmod.build_indices  # type: ignore[assignment]  # build per call
    return per_forward, torch.equal(logits, uncached(tokens))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_cp_builds_its_index_tensors_once_not_per_layer(family: str) -> None:
    """S5a: the gather order, the positions and the masks are built once per (sequence length, cp, rank, device)
    and reused by every layer and every step: the first forward of a 3-layer model calls gathered_to_global
    once (the old code: once per layer), the second forward and the backward build nothing."""
    out = run_distributed(_index_builds, 2, family, timeout=120)
    for per_forward, same in out:
        gathers_first, builds_first, gathers_second, builds_second, total = per_forward
        assert (gathers_first, gathers_second, builds_second) == (1, 0, 0), per_forward
        assert total == builds_first, per_forward
        assert same
