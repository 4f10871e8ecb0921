"""The GPT module matches the parameter arithmetic the plan prints, and builds on the meta device."""

from __future__ import annotations

import pytest
import torch

from hpctrain.models.gpt import GPT, GPTArgs
from hpctrain.models.params import param_count


@pytest.mark.parametrize("layers,d,heads,vocab,ctx", [(4, 128, 4, 256, 256), (12, 768, 12, 50257, 2048),
                                                      (96, 12288, 96, 50257, 2048)])
def test_module_parameter_count_matches_formula(layers: int, d: int, heads: int, vocab: int, ctx: int) -> None:
    with torch.device("meta"):
        model = GPT(GPTArgs(layers, d, heads, vocab, ctx, 4 * d))
    assert sum(p.numel() for p in model.parameters()) == param_count(layers, d, vocab, ctx)


def test_175b_formula() -> None:
    assert param_count(96, 12288, 50257, 2048) == 174_604_259_328


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
