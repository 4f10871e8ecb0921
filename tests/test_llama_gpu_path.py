"""The Llama's GPU path, checked on CPU: RMSNorm through torch's F.rms_norm with Hugging Face's numerics, RoPE's
cos/sin built once per (length, device, dtype), not per layer, micro-batch or recomputation, and the rule
deciding whether grouped-query attention repeats its key/value heads so that a fused SDPA kernel accepts it
(hpctrain.models.llama.model).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hpctrain.models.common import attention
from hpctrain.models.common.attention import sdpa_expands_kv
from hpctrain.models.llama import model as llama
from hpctrain.models.llama.model import Llama, LlamaArgs, RMSNorm

ARGS = LlamaArgs(
    n_layers=4,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=100,
    ffn_hidden=96,
    padded_vocab=128,
    rope_theta=500000.0,
)


def _model(args: LlamaArgs = ARGS) -> Llama:
    model = Llama(args)
    model.init_weights(seed=0)
    return model


def _tokens(t: int = 24, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def frequency_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the RoPE frequency function (every cos/sin table is built from one), on an empty cache."""
    calls: list[int] = []
    real = llama.rope_frequencies

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "rope_frequencies", counted)
    monkeypatch.setattr(llama, "_ROPE_CACHE", type(llama._ROPE_CACHE)())
    return calls


# ---------------------------------------------------------------- RoPE tables: once per (length, device, dtype)


def test_rope_tables_are_built_once_not_per_layer_or_micro_batch(frequency_calls: list[int]) -> None:
    """Four layers, forward and backward, then another micro-batch: one table; a new length: one more."""
    model = _model()
    model(_tokens()).sum().backward()
    assert len(frequency_calls) == 1
    model(_tokens(seed=6)).sum().backward()
    assert len(frequency_calls) == 1
    model(_tokens(t=16))
    assert len(frequency_calls) == 2


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_reuses_the_tables(frequency_calls: list[int], mode: str) -> None:
    """Activation checkpointing reruns each block in backward with the same tables: no build, and the same
    gradients as without recomputation."""
    from hpctrain.parallel.recompute import apply_recompute

    plain, checkpointed = _model(), _model()
    apply_recompute(checkpointed, mode)
    tokens = _tokens()
    plain(tokens).sum().backward()
    frequency_calls.clear()
    checkpointed(tokens).sum().backward()
    assert not frequency_calls
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_pipeline_stages_share_the_tables(frequency_calls: list[int]) -> None:
    """A later stage gets hidden states, not tokens: its attention asks for the same length, and the two stages
    give the full model's logits."""
    from hpctrain.parallel.pipeline import prune_to_stage

    full = _model()
    first, last = (prune_to_stage(copy.deepcopy(full), s, (len(full.layers) // 2,) * 2) for s in (0, 1))
    tokens = _tokens()
    with torch.no_grad():
        expected = full(tokens)
        got = last(first(tokens))
    assert len(frequency_calls) == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rope_tables_follow_the_length_device_and_dtype_of_the_queries(frequency_calls: list[int]) -> None:
    """Cast as Hugging Face casts them (fp32 angles, then the activations' dtype); one entry per key."""
    q = torch.empty(2, 4, 12, ARGS.head_dim)
    cos, sin = llama.rope_tables(ARGS, q)
    assert llama.rope_tables(ARGS, torch.empty(1, 2, 12, ARGS.head_dim))[0] is cos  # batch and heads: same key
    expected = llama.rope_cos_sin(ARGS, 12, torch.device("cpu"))
    torch.testing.assert_close((cos, sin), expected, rtol=0, atol=0)
    half = llama.rope_tables(ARGS, q.bfloat16())
    assert half[0].dtype == torch.bfloat16 and torch.equal(half[1], expected[1].bfloat16())
    assert llama.rope_tables(ARGS, torch.empty(20, ARGS.head_dim))[0].shape == (20, ARGS.head_dim)
    assert llama.rope_tables(ARGS, q.to("meta"))[0].device.type == "meta"
    scaled = llama.rope_tables(replace(ARGS, rope_scaling=8.0, rope_original_context=4), q)
    assert not torch.equal(scaled[0], cos)  # the RoPE arguments are part of the key


def test_meta_fake_and_inference_forwards_leave_no_table_behind(frequency_calls: list[int]) -> None:
    """Built on meta (no buffer: the state dict keeps its keys), a forward on meta is cached as meta; one under
    fake tensors (hpctrain.simulate) and one in inference mode cache nothing; materialised, the model gives the
    eagerly built model's logits and trains (no inference tensor saved for backward)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = Llama(ARGS)
    assert set(model.state_dict()) == set(_model().state_dict())
    assert not list(model.buffers())
    tokens = _tokens()
    assert model(tokens.to("meta")).shape == (2, 24, 128)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert model(mode.from_tensor(tokens)).shape == (2, 24, 128)
    with torch.inference_mode():
        model(tokens)
    assert [key[-2].type for key in llama._ROPE_CACHE] == ["meta"]
    assert all(type(t) is torch.Tensor for tables in llama._ROPE_CACHE.values() for t in tables)
    torch.testing.assert_close(model(tokens), _model()(tokens), rtol=0, atol=0)
    model(tokens).sum().backward()


# ---------------------------------------------------------------- RMSNorm: F.rms_norm, Hugging Face's numerics


def _hf_norm(norm: RMSNorm) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(norm.weight.shape[0], eps=norm.eps)
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    return hf.to(norm.weight.dtype)


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [
        (torch.float32, torch.float32),  # precision=fp32
        (torch.bfloat16, torch.bfloat16),  # FSDP2's bf16 parameters and activations
        (torch.bfloat16, torch.float32),  # a bf16 input and fp32 weight: fp32 out, as Hugging Face's
    ],
    ids=["fp32", "bf16", "bf16_in_fp32_weight"],
)
def test_rmsnorm_is_hugging_faces_bit_for_bit(
    x_dtype: torch.dtype, w_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    norm = norm.to(w_dtype)
    hf = _hf_norm(norm)
    x = (3 * torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(3))).to(x_dtype).requires_grad_()
    y, expected = norm(x), hf(x)
    assert calls == [1]  # torch's norm, not the hand-written one
    assert y.dtype == expected.dtype == torch.promote_types(x_dtype, w_dtype)
    assert torch.equal(y, expected)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(y.dtype)
    (gx, gw), (hx, hw) = (torch.autograd.grad(out, (x, m.weight), g) for out, m in ((y, norm), (expected, hf)))
    torch.testing.assert_close(gx, hx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, hw, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- SDPA: which kernel takes grouped-query attention


@pytest.mark.parametrize(
    ("dtype", "device", "heads", "head_dim", "expands"),
    [
        (torch.float32, "cuda", (32, 8), 128, True),  # only math takes fp32 GQA: repeat so efficient attention runs
        (torch.bfloat16, "cuda", (32, 8), 128, False),  # flash (and cuDNN) take GQA in bf16
        (torch.float16, "cuda", (32, 8), 128, False),
        (torch.bfloat16, "cuda", (8, 2), 320, True),  # past flash's 256 and cuDNN's limit: efficient, repeated
        (torch.float32, "cuda", (32, 32), 128, False),  # no grouping: nothing to repeat
        (torch.float64, "cuda", (32, 8), 128, False),  # no fused CUDA kernel for fp64 either way
        (torch.float32, "cpu", (32, 8), 128, False),  # CPU flash takes GQA in every dtype
        (torch.bfloat16, "cpu", (32, 8), 128, False),
        (torch.float32, "meta", (32, 8), 128, False),
    ],
)
def test_sdpa_expands_kv_where_no_fused_kernel_takes_grouped_query_attention(
    dtype: torch.dtype, device: str, heads: tuple[int, int], head_dim: int, expands: bool
) -> None:
    assert sdpa_expands_kv(dtype, device, *heads, head_dim) is expands


def test_the_torch_rules_the_decision_rests_on() -> None:
    """Tripwires for a torch upgrade, on this build: the CPU flash kernel runs grouped-query attention alone
    (so CPU never repeats), flash's backward keeps the key/value heads, memory-efficient attention's does not
    (no GQA there: its grad_k has the query heads). Should the last change, fp32 may keep enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, h, 16, 8, generator=gen).to(dtype) for h in (4, 2, 2))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        expected = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
        torch.testing.assert_close(y, expected)

    meta = torch.device("meta")
    q, out = torch.empty(1, 4, 16, 8, device=meta), torch.empty(1, 4, 16, 8, device=meta)
    k, v = torch.empty(1, 2, 16, 8, device=meta), torch.empty(1, 2, 16, 8, device=meta)
    seed = torch.empty((), dtype=torch.long, device=meta)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        out, q, k, v, out, torch.empty(1, 4, 16, device=meta), None, None, 16, 16, 0.0, True, seed, seed
    )
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        out, q, k, v, None, out, torch.empty(1, 4, 32, device=meta), seed, seed, 0.0, [True, True, True, False], True
    )
    assert flash[1].shape[1] == 2
    assert efficient[1].shape[1] == 4, "memory-efficient SDPA may take GQA now: revisit attention.sdpa_expands_kv"


@pytest.mark.parametrize("kv", [1, 2])
def test_repeated_key_value_heads_give_the_grouped_attention(monkeypatch: pytest.MonkeyPatch, kv: int) -> None:
    """The path taken on CUDA in fp32, forced on CPU: SDPA gets as many key/value heads as query heads and no
    enable_gqa, with the grouped path's output and gradients."""
    args = replace(ARGS, n_kv_heads=kv)
    grouped, repeated = _model(args), _model(args)
    seen: list[tuple[int, int, bool]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append((q.shape[1], k.shape[1], bool(kwargs.get("enable_gqa"))))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tokens = _tokens()
    grouped(tokens).sum().backward()
    assert set(seen) == {(4, kv, True)}
    seen.clear()
    monkeypatch.setattr(attention, "sdpa_expands_kv", lambda *a: True)
    repeated(tokens).sum().backward()
    assert set(seen) == {(4, 4, False)}
    torch.testing.assert_close(repeated(tokens), grouped(tokens), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(grouped.named_parameters(), repeated.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_block_compiles_in_one_graph(frequency_calls: list[int]) -> None:
    """parallel.compile compiles whole blocks: the tables (built in the graph, not looked up) and the kernel
    decision trace without a graph break."""
    model = _model()
    eager = copy.deepcopy(model)
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    tokens = _tokens()
    torch.testing.assert_close(model(tokens), eager(tokens), rtol=1e-5, atol=1e-6)
