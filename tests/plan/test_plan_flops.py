"""FLOPs and MFU against Narayanan et al. 2021 (Megatron-LM) Table 1 and sec. 5.1."""

import pytest

from hpctrain.plan.flops import (
    attention_core_flops,
    compute_seconds,
    flops_per_iteration,
    fp8_flops_per_iteration,
    layer_forward_flops,
    linear_forward_flops,
    mfu,
    model_flops_per_token,
    narayanan_flops,
    training_time_s,
)
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import Layout, hardware
from tests.plan.shapes import gpt

V, SEQ = 51200, 2048
# Table 1: params (B), heads, hidden, layers, TP, PP, GPUs, batch, achieved TFLOP/s per GPU, % of peak
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]


def _model(row):
    _, heads, hidden, layers, *_ = row
    return gpt(layers, hidden, heads, SEQ, V)


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_table_1_parameter_counts(row):
    assert round(_model(row).params / 1e9, 1) == row[0]


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_component_flops_equal_eq_3(row):
    """Our layer-by-layer count with full recomputation is the paper's closed form."""
    model, batch = _model(row), row[7]
    assert flops_per_iteration(model, batch, "full") == pytest.approx(
        narayanan_flops(batch, SEQ, model.dims.n_layers, model.dims.d_model, V), rel=1e-12
    )


def test_flops_hand_computation_1_7b_row():
    """96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with B=512, s=2048, l=24, h=2304, V=51200, step by step."""
    assert 2304**2 == 5_308_416
    assert 96 * 512 * 2048 * 24 == 2_415_919_104
    base = 2_415_919_104 * 5_308_416
    assert base == 12_824_703_626_379_264
    factor = 1 + 2048 / 13824 + 51200 / 884736  # s/(6h) = 0.148148, V/(16 l h) = 0.057870
    assert factor == pytest.approx(1.2060185, rel=1e-6)
    flops = flops_per_iteration(_model(TABLE_1[0]), 512, "full")
    assert flops == pytest.approx(base * factor, rel=1e-12)
    assert flops == pytest.approx(1.54668e16, rel=1e-5)
    # at the table's 137 TFLOP/s on 32 GPUs one iteration takes ~3.5 s
    assert flops / (137e12 * 32) == pytest.approx(3.53, abs=0.01)


def test_no_and_selective_recompute():
    model = _model(TABLE_1[6])
    B, s, L, h = 2304, SEQ, model.dims.n_layers, model.dims.d_model
    none = flops_per_iteration(model, B, "none")
    assert none == pytest.approx(72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))
    # hpctrain's selective policy reruns element-wise work only, and under TP the attention's output projection
    assert flops_per_iteration(model, B, "selective") == none
    tp_none = flops_per_iteration(model, B, "none", tp=8)
    assert flops_per_iteration(model, B, "selective", tp=8) == pytest.approx(tp_none + 2 * B * s * h * h * L)
    assert tp_none < flops_per_iteration(model, B, "selective", tp=8) < flops_per_iteration(model, B, "full", tp=8)


def test_training_time_examples_of_section_5_1():
    """GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s: ~34 days; 1T, 450B tokens, 3072 at 163: ~84 days."""
    gpt3 = gpt(96, 12288, 96, SEQ, V)
    days = training_time_s(gpt3, 300e9, 1536, 1024, 140e12) / 86400
    assert days == pytest.approx(34, rel=0.03)
    one_t = _model(TABLE_1[-1])
    days = training_time_s(one_t, 450e9, 3072, 3072, 163e12) / 86400
    assert days == pytest.approx(84, rel=0.03)


def test_mfu_of_the_design_article():
    """120 samples/s of 2048 tokens on 4096 A100s for GPT-3 175B is ~20% MFU."""
    gpt3 = gpt(96, 12288, 96, 2048, 50257)
    per_token = 6 * gpt3.params + 12 * 96 * 2048 * 12288
    assert model_flops_per_token(gpt3) == per_token
    value = mfu(120 * 2048, gpt3, 4096, 312e12)
    assert value == pytest.approx(120 * 2048 * per_token / (4096 * 312e12))
    assert 0.20 < value < 0.215


def test_table_1_percent_of_peak_matches_a100_peak():
    peak = hardware("a100_80gb").peak_flops
    for row in TABLE_1:
        assert round(row[8] * 1e12 / peak * 100) == row[9]


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r[0]}B" for r in TABLE_1])
def test_step_estimate_is_near_table_1(row):
    """With the table's TP/PP, full recomputation and the best micro-batch, the estimated per-GPU
    throughput (hardware FLOPs, as the paper counts them) lands within 35% of the measured one."""
    model, tp, pp, n, batch, achieved = _model(row), row[4], row[5], row[6], row[7], row[8]
    hw = hardware("a100_80gb")
    dp = n // (tp * pp)
    best = 0.0
    for mb in (1, 2, 4, 8):
        per = batch // dp
        if per % mb or (pp > 1 and per // mb < pp):
            continue
        lay = Layout(dp=dp, tp=tp, pp=pp, micro_batch=mb, grad_accum=per // mb, recompute="full")
        step = estimate_step(model, lay, hw)
        best = max(best, flops_per_iteration(model, batch, "full") / step.step_time_s / n / 1e12)
    assert 0.65 * achieved < best < 1.35 * achieved


def test_logit_flops_use_the_padded_vocabulary_and_mfu_the_model_count():
    """The logit matmul runs over the embedding as built (50257 -> 50688 rows at TP 8); MFU's 6 N counts the
    model's own parameters, padding being no useful work."""
    padded = gpt(24, 2048, 16, 2048, 50257, vocab_pad_multiple=64)
    plain = gpt(24, 2048, 16, 2048, 50257)
    extra = flops_per_iteration(padded, 512, "none", tp=8) - flops_per_iteration(plain, 512, "none")
    assert extra == pytest.approx(3 * 2 * 512 * 2048 * 2048 * (50688 - 50257))
    assert model_flops_per_token(padded) == model_flops_per_token(plain)


# ---- FP8 (precision.fp8, docs/fp8.md): the blocks' Linears at the FP8 peak, attention and logits at bf16 ----


def test_fp8_peaks_are_the_datasheets_dense_figures():
    """H100/H200 SXM: 3958 TFLOP/s FP8 with sparsity = 1979 dense, twice the bf16 989; A100 has none."""
    for name in ("h100_80gb", "h200"):
        hw = hardware(name)
        assert hw.has_fp8 and hw.fp8_flops == 1979e12 and hw.fp8_flops == pytest.approx(2 * hw.peak_flops, rel=1e-3)
    assert not hardware("a100_80gb").has_fp8 and not hardware("a100_40gb").has_fp8 and not hardware("cpu").has_fp8


def test_fp8_flops_are_the_linear_layers_of_every_pass():
    """GPT-3 1.7B (f = 4h): the Linears are 24 B s h^2 per layer forward; fwd + 2 backward GEMMs (+ a second
    forward under full recomputation) run in FP8; the attention core and the logit layer never do."""
    model, batch = _model(TABLE_1[0]), 512
    L, h, tokens = model.dims.n_layers, model.dims.d_model, batch * SEQ
    assert linear_forward_flops(tokens, h) == 24 * tokens * h * h
    assert fp8_flops_per_iteration(model, batch, "none", "tensorwise") == 3 * L * 24 * tokens * h * h
    assert fp8_flops_per_iteration(model, batch, "selective", "rowwise") == 3 * L * 24 * tokens * h * h
    assert fp8_flops_per_iteration(model, batch, "full", "tensorwise") == 4 * L * 24 * tokens * h * h
    assert fp8_flops_per_iteration(model, batch, "full", "none") == 0.0
    rest = flops_per_iteration(model, batch, "none") - fp8_flops_per_iteration(model, batch, "none", "tensorwise")
    logits = 3 * 2 * tokens * h * V
    assert rest == pytest.approx(3 * L * attention_core_flops(tokens, SEQ, h) + logits)


def test_llama_linear_share_counts_gqa_and_swiglu():
    """Llama 3 8B shapes: QKV with 8 key/value heads, three MLP matrices; linear + attention = the layer."""
    tokens, h, k, f = 8192.0, 4096, 1024, 14336
    linear = linear_forward_flops(tokens, h, f, k, gated=True)
    assert linear == 2 * tokens * (h * (h + 2 * k) + h * h + 3 * h * f)
    assert linear + attention_core_flops(tokens, 8192, h) == layer_forward_flops(tokens, 8192, h, f, k, gated=True)


def test_compute_seconds_takes_each_share_at_its_rate():
    assert compute_seconds(10.0, 0.0, 2, 5.0, 10.0, 0.5) == pytest.approx(10 / 5 / (2 * 0.5))
    assert compute_seconds(10.0, 10.0, 2, 5.0, 10.0, 0.5) == pytest.approx(10 / 10 / (2 * 0.5))
    assert compute_seconds(10.0, 4.0, 1, 5.0, 10.0, 1.0) == pytest.approx(6 / 5 + 4 / 10)
    assert compute_seconds(10.0, 4.0, 1, 5.0, 0.0, 1.0) == pytest.approx(10 / 5), "no FP8 peak: no speed-up"
    with pytest.raises(ValueError):
        compute_seconds(10.0, 11.0, 1, 5.0, 10.0, 1.0)


def test_fp8_step_estimate_on_h100_and_a100():
    """GPT-3 6.7B on 8 H100s: only the Linears' share gets the ~2x, so compute shrinks by ~share / 2 (not by half);
    MFU stays against the bf16 peak and rises with the shorter step. An A100 has no FP8: nothing changes."""
    model = gpt(32, 4096, 32, 2048, V)
    bf16 = Layout(dp=8, tp=1, pp=1, micro_batch=1, grad_accum=4, recompute="full")
    fp8 = Layout(dp=8, tp=1, pp=1, micro_batch=1, grad_accum=4, recompute="full", fp8="tensorwise")
    share = fp8_flops_per_iteration(model, 32, "full", "tensorwise") / flops_per_iteration(model, 32, "full")
    assert 0.8 < share < 0.95
    h100 = hardware("h100_80gb")
    a, b = estimate_step(model, bf16, h100), estimate_step(model, fp8, h100)
    assert b.compute_s / a.compute_s == pytest.approx(1 - share + share * h100.peak_flops / h100.fp8_flops)
    assert b.step_time_s < a.step_time_s and b.mfu > a.mfu
    assert b.mfu == pytest.approx(a.mfu * a.step_time_s / b.step_time_s)
    a100 = hardware("a100_80gb")
    assert estimate_step(model, fp8, a100).compute_s == pytest.approx(estimate_step(model, bf16, a100).compute_s)
