"""The Qwen3 family in the planner: published parameter count, heads wider than d_model / n_heads in the FLOPs
and the activations (measured on the module), and the checks that go with a head width of its own."""

from __future__ import annotations

import pytest

from hpctrain.config.problems import ConfigError
from hpctrain.models.params import built_dims, model_param_count, stage_param_counts
from hpctrain.plan.activations import activation_bytes_per_layer
from hpctrain.plan.flops import attention_core_flops, flops_per_iteration
from hpctrain.plan.types import ModelShape
from tests.plan.saved import block_saved_bytes

QWEN3_8B = 8_190_735_360  # Hugging Face Qwen/Qwen3-8B, sum of numel over its safetensors


def test_qwen3_8b_parameter_count_is_the_published_one(compose_cfg) -> None:
    """Per layer: Q h x 4096 (32 heads of 128), K and V h x 1024, the projection 4096 x h, SwiGLU 3 h f, two
    RMSNorms h and the per-head q/k norms 2 x 128; embedding and untied head V x h; the final RMSNorm."""
    m = compose_cfg("model=qwen3_8b").model
    h, f, v, q, k = 4096, 12288, 151936, 32 * 128, 8 * 128
    layer = h * (q + 2 * k) + q * h + 3 * h * f + 2 * h + 2 * 128
    assert 36 * layer + 2 * v * h + h == QWEN3_8B
    assert model_param_count(m) == QWEN3_8B
    assert ModelShape.of(m, 4096).params == QWEN3_8B
    quarters = (m.n_layers // 4,) * 4
    assert sum(stage_param_counts(m, quarters)) == QWEN3_8B + 2 * (151936 - 151936)  # 151936 is a multiple of 64


def test_qwen3_flops_count_the_query_width_not_d_model(compose_cfg) -> None:
    """Qwen3-4B-like heads (4 x 64 in d 128): the attention core runs over n_heads x head_dim, and the Linears are
    the block's matrices, Q and the projection 2 x wider than d_model."""
    m = compose_cfg("model=qwen3_tiny").model
    shape = ModelShape.of(m, 256)
    tokens, h, q, k, f, s = 4 * 256, 128, 256, 128, 352, 256
    linear = 2 * tokens * (h * (q + 2 * k) + q * h + 3 * h * f)
    layer = linear + attention_core_flops(tokens, s, q)
    logits = 2 * tokens * h * shape.vocab_rows(1)
    assert flops_per_iteration(shape, 4, "none") == pytest.approx(4 * 3 * layer + 3 * logits)
    assert attention_core_flops(tokens, s, q) == 2 * attention_core_flops(tokens, s, h)


@pytest.mark.parametrize("head_dim", [0, 64], ids=["d_over_heads", "wider_heads"])
def test_qwen3_block_saves_what_the_formula_counts(compose_cfg, head_dim: int) -> None:
    """The tensors autograd saves for a Qwen3 block in bf16 on CPU (storages counted once, parameters left out):
    the formula (Llama's at the query width, plus the per-head norms: 6 bytes per element of Q and K and an fp32
    1/rms per head and token), plus RoPE's cos/sin tables and the two block RMSNorms' per-token fp32 1/rms."""
    d, a, g, f, s, b = 256, 8, 2, 704, 512, 2
    cfg = compose_cfg(
        "model=qwen3_tiny",
        f"model.d_model={d}",
        f"model.n_heads={a}",
        f"model.n_kv_heads={g}",
        f"model.ffn_hidden={f}",
        f"model.head_dim={head_dim}",
        "model.n_layers=1",
    )
    hd = head_dim or d // a
    rope_tables, inv_rms = 2 * s * hd * 2, 2 * b * s * 4
    formula = activation_bytes_per_layer(*built_dims(cfg.model), s, b)
    assert block_saved_bytes(cfg.model, b, s) == formula + rope_tables + inv_rms


def test_head_dim_checks(compose_cfg) -> None:
    from hpctrain.checks.runner import check_config

    check_config(compose_cfg("model=qwen3_tiny", "model.d_model=90"))  # 90 / 4 heads: fine with head_dim 64
    with pytest.raises(ConfigError) as odd:
        check_config(compose_cfg("model=qwen3_tiny", "model.head_dim=63"))
    assert [p.key for p in odd.value.problems] == ["model.head_dim"] and "RoPE" in str(odd.value)
    with pytest.raises(ConfigError) as gpt:
        check_config(compose_cfg("model=tiny", "model.head_dim=8"))
    assert "model.head_dim" in [p.key for p in gpt.value.problems]
    with pytest.raises(ConfigError) as split:  # d_model / n_heads only matters without a head width of its own
        check_config(compose_cfg("model=qwen3_tiny", "model.d_model=90", "model.head_dim=0"))
    assert [p.key for p in split.value.problems] == ["model.d_model"]
