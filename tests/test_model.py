"""The GPT module matches the parameter arithmetic the plan prints, and builds on the meta device; the Llama
module has the names and shapes Hugging Face's weights convert to, and computes what Hugging Face's does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpctrain.models import create_model, registry
from hpctrain.models.family import Dims
from hpctrain.models.gpt.model import GPT, GPTArgs
from hpctrain.models.llama.model import Llama, LlamaArgs, apply_rope, rope_cos_sin, rope_frequencies
from hpctrain.models.params import param_count


@pytest.mark.parametrize(
    "layers,d,heads,vocab,ctx", [(4, 128, 4, 256, 256), (12, 768, 12, 50257, 2048), (96, 12288, 96, 50257, 2048)]
)
def test_module_parameter_count_matches_formula(layers: int, d: int, heads: int, vocab: int, ctx: int) -> None:
    with torch.device("meta"):
        model = GPT(GPTArgs(layers, d, heads, vocab, ctx, 4 * d))
    dims = Dims(layers, d, heads, heads, 4 * d, vocab, ctx)
    assert sum(p.numel() for p in model.parameters()) == param_count(registry.get("gpt"), dims)


def test_175b_formula() -> None:
    assert param_count(registry.get("gpt"), Dims(96, 12288, 96, 96, 4 * 12288, 50257, 2048)) == 174_604_259_328


def test_init_is_deterministic_and_scaled() -> None:
    args = GPTArgs(2, 32, 2, 64, 16, 128)
    a, b = GPT(args), GPT(args)
    a.init_weights(seed=1)
    b.init_weights(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.layers["0"].attn.proj.weight.std() < a.layers["0"].attn.qkv.weight.std()  # scaled residual init
    assert a.layers["0"].norm1.weight.eq(1).all() and a.layers["0"].mlp.fc.bias.eq(0).all()


def test_forward_shapes_and_tied_head() -> None:
    model = GPT(GPTArgs(2, 32, 2, 64, 16, 128))
    model.init_weights(seed=0)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    assert model.output_weight() is model.tok_emb.weight


# ---------------------------------------------------------------- Llama


def _llama_cfg(**overrides: object) -> object:
    from omegaconf import OmegaConf

    from hpctrain.config.schema import ModelConfig

    tiny = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "llama_tiny.yaml")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), tiny, overrides)


SMALL = LlamaArgs(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_hidden=96, padded_vocab=128)


def _llama(args: LlamaArgs = SMALL, seed: int = 0) -> Llama:
    model = Llama(args)
    model.init_weights(seed=seed)
    return model


@pytest.mark.parametrize("vocab,tp,rows", [(256, 1, 256), (200, 2, 256)])
def test_llama_parameter_names_and_shapes(vocab: int, tp: int, rows: int) -> None:
    """The names and shapes the Hugging Face converter and the planner count against (llama_tiny)."""
    with torch.device("meta"):
        model = create_model(_llama_cfg(vocab_size=vocab), tp)
    assert isinstance(model, Llama) and not model.tied_embeddings
    d, qkv, ffn = 128, (4 + 2 * 2) * 32, 352
    expected = {"tok_emb.weight": (rows, d), "norm_f.weight": (d,), "output.weight": (rows, d)}
    for i in range(4):
        expected.update(
            {
                f"layers.{i}.norm1.weight": (d,),
                f"layers.{i}.attn.qkv.weight": (qkv, d),
                f"layers.{i}.attn.proj.weight": (d, d),
                f"layers.{i}.norm2.weight": (d,),
                f"layers.{i}.mlp.gate.weight": (ffn, d),
                f"layers.{i}.mlp.up.weight": (ffn, d),
                f"layers.{i}.mlp.proj.weight": (d, ffn),
            }
        )
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == expected


def test_llama_init_is_per_name_and_scaled() -> None:
    a, b = _llama(), _llama()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    stage = Llama(SMALL)
    del stage.layers["0"]  # a pipeline stage: the remaining names draw the same weights as in the full model
    stage.tok_emb = None
    stage.init_weights(seed=0)
    full = dict(a.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    assert not torch.equal(a.tok_emb.weight[:100], a.output.weight[:100])  # untied
    assert not a.tok_emb.weight[100:].any() and not a.output.weight[100:].any()  # padding rows
    assert a.layers["0"].mlp.proj.weight.std() < a.layers["0"].mlp.up.weight.std()  # scaled residual init
    assert a.norm_f.weight.eq(1).all() and a.layers["1"].norm2.weight.eq(1).all()
    assert _llama(seed=1).layers["0"].attn.qkv.weight.ne(a.layers["0"].attn.qkv.weight).all()


def test_llama_forward_is_causal() -> None:
    model = _llama()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 100
    a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 128)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def _explicit_attention(attn: torch.nn.Module, x: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Grouped-query attention written out: query head h reads key/value head h // (n_heads / n_kv_heads)."""
    t = x.shape[1]
    hd, r = args.head_dim, args.n_heads // args.n_kv_heads
    w = attn.qkv.weight.view(args.n_kv_heads, r + 2, hd, args.d_model)
    cos, sin = rope_cos_sin(args, t, x.device)
    heads = []
    for h in range(args.n_heads):
        g = h // r
        q, k, v = (x @ w[g, j].T for j in (h % r, r, r + 1))
        scores = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2) / hd**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return attn.proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_query_attention_shares_key_value_heads(kv: int) -> None:
    """Llama's attention equals the written-out grouped-query attention; with kv == n_heads that is plain
    multi-head attention, and a GQA model equals the MHA model whose key/value heads are its own repeated."""
    args = replace(SMALL, n_kv_heads=kv)
    model = _llama(args)
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(1))
    attn = model.layers["0"].attn
    torch.testing.assert_close(attn(x), _explicit_attention(attn, x, args), rtol=1e-5, atol=1e-6)

    mha = Llama(replace(SMALL, n_kv_heads=4))
    state = model.state_dict()
    r, hd = 4 // kv, args.head_dim
    for i in range(args.n_layers):
        w = state[f"layers.{i}.attn.qkv.weight"].view(kv, r + 2, hd, 64)
        per_head = [torch.stack([w[h // r, h % r], w[h // r, r], w[h // r, r + 1]]) for h in range(4)]
        state[f"layers.{i}.attn.qkv.weight"] = torch.stack(per_head).reshape(-1, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(mha(tokens), model(tokens), rtol=1e-5, atol=1e-6)


def test_swiglu_and_rmsnorm() -> None:
    """SwiGLU from the separate gate and up weights; RMSNorm normalises in fp32 and scales in the input dtype."""
    block = _llama().layers["0"]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(3))
    gate, up = block.mlp.gate.weight, block.mlp.up.weight
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ block.mlp.proj.weight.T
    torch.testing.assert_close(block.mlp(x), expected, rtol=1e-5, atol=1e-6)

    norm = block.norm1
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    y = x.bfloat16()
    normed = (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + SMALL.norm_eps)).bfloat16()
    assert norm(y).dtype == torch.float32  # the fp32 weight times the bf16 input, as Hugging Face's
    torch.testing.assert_close(norm(y), norm.weight * normed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", [0.0, 8.0])
def test_rope_rotates_pairs_of_halves_by_relative_position(scaling: float) -> None:
    args = replace(SMALL, rope_theta=500000.0, rope_scaling=scaling, rope_original_context=64)
    hd, t = args.head_dim, 40
    cos, sin = rope_cos_sin(args, t, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    q, k = (
        apply_rope(torch.randn(hd, generator=gen).expand(t, hd), cos, sin),
        apply_rope(torch.randn(hd, generator=gen).expand(t, hd), cos, sin),
    )
    scores = q @ k.T  # scores[m, n] = <rotated q at m, rotated k at n>: a function of m - n only
    for shift in (1, 9):
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(q.norm(dim=-1), q[0].norm().expand(t))  # rotations keep lengths
    # Hugging Face's convention: dim i turns with dim i + hd/2 (not with its neighbour i + 1).
    unit = torch.zeros(t, hd)
    unit[:, 0] = 1.0
    angle = torch.arange(t) * rope_frequencies(args)[0]
    rotated = apply_rope(unit, cos, sin)
    torch.testing.assert_close(rotated[:, 0], angle.cos())
    torch.testing.assert_close(rotated[:, hd // 2], angle.sin())
    assert not rotated[:, 1].any()


def test_llama3_scaling_keeps_high_and_divides_low_frequencies() -> None:
    plain = replace(SMALL, rope_theta=500000.0)
    scaled = replace(plain, rope_scaling=8.0, rope_original_context=64)
    f, g = rope_frequencies(plain), rope_frequencies(scaled)
    wavelen = 2 * torch.pi / f
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # all three regimes are exercised
    torch.testing.assert_close(g[high], f[high])
    torch.testing.assert_close(g[low], f[low] / 8)
    assert ((g[~high & ~low] < f[~high & ~low]) & (g[~high & ~low] > f[~high & ~low] / 8)).all()


def _from_hugging_face(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's weights in hpctrain's names: q/k/v rows regrouped by KV group, embedding and head
    padded with zero rows."""
    hf = dict(state)
    d, kv = args.d_model, args.n_kv_heads
    pad = torch.zeros(args.embedding_rows - args.vocab_size, d)
    out = {
        "tok_emb.weight": torch.cat([hf.pop("model.embed_tokens.weight"), pad]),
        "output.weight": torch.cat([hf.pop("lm_head.weight"), pad]),
        "norm_f.weight": hf.pop("model.norm.weight"),
    }
    for i in range(args.n_layers):

        def take(name: str, i: int = i) -> torch.Tensor:
            return hf.pop(f"model.layers.{i}.{name}.weight")

        q, k, v = (take(f"self_attn.{n}_proj").view(kv, -1, d) for n in "qkv")
        out.update(
            {
                f"layers.{i}.norm1.weight": take("input_layernorm"),
                f"layers.{i}.attn.qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, d),
                f"layers.{i}.attn.proj.weight": take("self_attn.o_proj"),
                f"layers.{i}.norm2.weight": take("post_attention_layernorm"),
                f"layers.{i}.mlp.gate.weight": take("mlp.gate_proj"),
                f"layers.{i}.mlp.up.weight": take("mlp.up_proj"),
                f"layers.{i}.mlp.proj.weight": take("mlp.down_proj"),
            }
        )
    assert not hf, f"weights left unconverted: {list(hf)}"
    return out


@pytest.mark.parametrize("scaling", [0.0, 8.0], ids=["rope", "llama3_scaled_rope"])
def test_llama_matches_hugging_face(scaling: float) -> None:
    """Logits of Hugging Face's LlamaForCausalLM (eager attention) with its weights converted, in fp32."""
    transformers = pytest.importorskip("transformers")
    args = replace(SMALL, rope_theta=500000.0, rope_scaling=scaling, rope_original_context=64)
    rope = (
        {
            "rope_type": "llama3",
            "factor": scaling,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        if scaling
        else {"rope_type": "default"}
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope_keys: dict[str, object] = {"rope_parameters": {**rope, "rope_theta": args.rope_theta}}
    else:  # transformers 4: theta and scaling are separate keys
        rope_keys = {"rope_theta": args.rope_theta, "rope_scaling": rope}
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.d_model,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **rope_keys,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms away from 1, so a misplaced one shows
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model = Llama(args)
    model.load_state_dict(_from_hugging_face(hf.state_dict(), args))
    tokens = torch.randint(0, args.vocab_size, (2, 96), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens)[..., : args.vocab_size]
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    if scaling:  # the scaling matters at these lengths: the comparison would catch it missing
        unscaled = Llama(replace(args, rope_scaling=0.0))
        unscaled.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert ((unscaled(tokens)[..., : args.vocab_size] - expected).abs().max() / expected.abs().max()) > 1e-3
