"""hpctrain's activation model: SDPA flash attention, dropout, DTensor sequence parallelism, the selective policy,
autocast, and the logits each TP rank keeps for its shard of the loss (hpctrain/plan/activations.py).

The per-layer figures in sbh units were checked against the tensors autograd saves for
hpctrain.models.gpt.model.Block on CPU (saved_tensors_hooks, storages counted once, parameters left out; TP with 2
gloo processes; the selective policy's in tests/plan/test_plan_recompute.py).
"""

import pytest

from hpctrain.plan.activations import (
    LOSS_CHUNK_ELEMENTS,
    activation_bytes_per_layer,
    korthikanti_bytes_per_layer,
    logits_bytes,
)
from hpctrain.plan.memory import memory_per_gpu, stage_activation_parts
from hpctrain.plan.types import GiB, Layout, hardware
from tests.plan.shapes import GPT, dims, gpt

# GPT-3 1.3B as conf/experiment/gpt3_1.3b_1node.yaml runs it: 24 layers, h 2048, 16 heads, s 2048, micro-batch 8,
# DP 8 with ZeRO-2 (FSDP2, bf16 parameters: no autocast), dropout 0, vocabulary 50257 padded to 50304.
L, H, A, S, B = 24, 2048, 16, 2048, 8
GPT3_1_3B = gpt(L, H, A, S, 50257, vocab_pad_multiple=64)
ZERO2_DP8 = Layout(dp=8, tp=1, pp=1, zero_stage=2, micro_batch=B, grad_accum=8, reduce_dtype="fp32")


def test_gpt3_1_3b_recompute_none_activations_about_25_gib_not_85():
    """From first principles, bytes one layer saves for backward (bf16 = 2 bytes, sbh = s b h elements):
    LayerNorm 1 input 2 sbh, QKV-matmul input 2 sbh, Q K V 6 sbh (SDPA's inputs), SDPA output = output-projection
    input 2 sbh, log-sum-exp fp32 4 a s b, LayerNorm 2 input 2 sbh, MLP-in input 2 sbh, GELU input 8 sbh,
    MLP-out input 8 sbh: 32 sbh + 4 a s b. No s x s attention matrix (flash), no dropout mask (dropout 0).
    Korthikanti's 34 + 5 a s / h = 114 sbh gave 85.5 GiB for the 24 layers."""
    sbh = S * B * H
    per_layer = 2 * sbh + 2 * sbh + 6 * sbh + 2 * sbh + 4 * A * S * B + 2 * sbh + 2 * sbh + 8 * sbh + 8 * sbh
    assert 32 * sbh == GiB  # s b h = 2^25: 32 sbh is exactly 1 GiB per layer
    layers = L * per_layer
    assert layers / GiB == pytest.approx(24.0234, abs=1e-4)
    assert L * korthikanti_bytes_per_layer(S, B, H, A) / GiB == pytest.approx(85.5)  # what the planner said before
    parts = stage_activation_parts(GPT3_1_3B, ZERO2_DP8, 0)
    assert parts[0].bytes == pytest.approx(layers)
    assert 23 * GiB < parts[0].bytes < 26 * GiB


def test_gpt3_1_3b_head_and_logits():
    """Final LayerNorm input 2 sbh + head input 2 sbh + logits over the padded vocabulary: the loss's peak is in
    backward, 4 bytes per logit (the bf16 logits it keeps and their bf16 gradient) + one chunk's fp32 copy."""
    head = stage_activation_parts(GPT3_1_3B, ZERO2_DP8, 0)[1]
    assert head.bytes == pytest.approx(4 * S * B * H + B * S * 50304 * 4 + 4 * LOSS_CHUNK_ELEMENTS)
    assert head.bytes / GiB == pytest.approx(3.258, abs=1e-3)  # 9.336 when the loss took fp32 log-softmax
    mem = memory_per_gpu(GPT3_1_3B, ZERO2_DP8, hardware("a100_80gb"))
    assert mem.fits and 26 * GiB < mem.activations < 29 * GiB  # 32-35 GiB with the fp32 log-softmax loss


def test_flash_attention_drops_the_attention_matrix():
    sbh = S * H
    flash = activation_bytes_per_layer(GPT, dims(H, A), S, 1, dropout=True)
    assert flash == pytest.approx(sbh * (34 + 4 * A / H))  # log-sum-exp instead of 5 a s / h = 40
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, dropout=True, flash_attention=False) == pytest.approx(
        korthikanti_bytes_per_layer(S, 1, H, A)
    )
    # without dropout the materialised matrix is only the softmax output: 2 a s / h
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, flash_attention=False) == pytest.approx(
        sbh * (32 + 2 * A * S / H)
    )


def test_dropout_masks_only_when_dropout_is_on():
    """nn.Dropout with p = 0 returns its input: no mask. With p > 0: one byte per element after the attention and
    the MLP (flash attention regenerates its own dropout mask from the RNG state)."""
    sbh = S * H
    assert (
        activation_bytes_per_layer(GPT, dims(H, A), S, 1, dropout=True)
        - activation_bytes_per_layer(GPT, dims(H, A), S, 1)
        == 2 * sbh
    )
    lay = Layout(dp=1, tp=1, pp=1)
    with_dropout = stage_activation_parts(gpt(2, 64, 4, 32, 100, dropout=0.1), lay, 0)
    assert any(p.name == "embedding dropout mask" for p in with_dropout)
    assert not any(p.name == "embedding dropout mask" for p in stage_activation_parts(gpt(2, 64, 4, 32, 100), lay, 0))


def test_dtensor_sequence_parallel_keeps_the_gathered_matmul_inputs():
    """Measured on CPU, t = 2, sbh units: TP 20.06, TP + SP 18.05 (the all-gathered QKV and MLP-in inputs stay
    whole); Megatron's SP would store 16."""
    sbh, lse = S * H, 4 * A / H / 2
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 2) == pytest.approx(sbh * (20 + lse))
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 2, True) == pytest.approx(sbh * (18 + lse))
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 2, True, sp_keeps_gathered=False) == pytest.approx(
        sbh * (16 + lse)
    )


def test_selective_policy_saves_attention_matmul_and_collective_outputs():
    """hpctrain.parallel.recompute saves SDPA, matmul and TP collective outputs, not the row-parallel partial sums
    (tests/plan/test_plan_recompute.py measures it). sbh units + the log-sum-exp: 22 without TP, 14 with t = 2,
    15 with t = 2 and SP; at t = 8 and SP 6.75, less than no recomputation's 7.5 (the old policy kept 10.5)."""
    sbh, lse = S * H, 4 * A / H
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 1, False, "selective") == pytest.approx(sbh * (22 + lse))
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 2, False, "selective") == pytest.approx(
        sbh * (14 + lse / 2)
    )
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 2, True, "selective") == pytest.approx(
        sbh * (15 + lse / 2)
    )
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 8, True, "selective") == pytest.approx(
        sbh * (6.75 + lse / 8)
    )
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, 8, True) == pytest.approx(sbh * (7.5 + lse / 8))


def test_autocast_keeps_the_residual_stream_in_fp32():
    """Without FSDP2 (no DP, or DDP) forward runs under autocast: LayerNorm runs in fp32 and saves fp32 inputs.
    Measured on CPU: 36 sbh instead of 32."""
    sbh = S * H
    assert (
        activation_bytes_per_layer(GPT, dims(H, A), S, 1, fp32_residual=True)
        - activation_bytes_per_layer(GPT, dims(H, A), S, 1)
        == 4 * sbh
    )
    ddp = Layout(dp=8, tp=1, pp=1, zero_stage=0, micro_batch=B)
    fsdp = Layout(dp=8, tp=1, pp=1, zero_stage=2, micro_batch=B)
    gap = stage_activation_parts(GPT3_1_3B, ddp, 0)[0].bytes - stage_activation_parts(GPT3_1_3B, fsdp, 0)[0].bytes
    assert gap == pytest.approx(L * 4 * S * B * H)


def test_logits_shrink_with_tp():
    """Loss parallelism: each TP rank keeps its vocab/tp columns of the [b, s, padded vocabulary] logits (Llama 3
    70B's case, torchtitan's 188 GiB: b 1, s 8192, vocabulary 128256, bf16, TP 8)."""
    elements = 8192 * 128256
    assert logits_bytes(1, 8192, 128256, 2) == pytest.approx(elements * 4 + 4 * LOSS_CHUNK_ELEMENTS)
    assert logits_bytes(1, 8192, 128256, 2, tp=8) == pytest.approx(elements / 8 * 4 + 4 * LOSS_CHUNK_ELEMENTS)
    assert logits_bytes(1, 8192, 128256, 2, tp=8) / GiB == pytest.approx(0.551, abs=1e-3)
    assert logits_bytes(1, 1, 13, 2, tp=4) == 4 * 4 + 4 * 4  # torch.chunk's split: the widest shard, 4 columns


def test_logits_bytes_per_element():
    """2c per element (the kept logits, their gradient) + one chunk's fp32 working copy, here the whole tensor."""
    assert logits_bytes(1, 1, 1, 2) == 4 + 4
    assert logits_bytes(1, 1, 1, 4) == 8 + 4
    assert logits_bytes(1, 1, 1, 2, stored=12) == 8 + 11 * 2  # GPipe's last stage: c a micro-batch
    assert logits_bytes(1, 2**20, 64, 2) == 2**26 * 4 + 4 * LOSS_CHUNK_ELEMENTS  # the fp32 copy: one chunk


def test_gpipe_last_stage_holds_every_micro_batch_of_logits():
    model = gpt(8, 256, 4, 128, 1000)
    one_f_one_b = Layout(dp=2, tp=1, pp=2, grad_accum=8)
    gpipe = Layout(dp=2, tp=1, pp=2, grad_accum=8, schedule="gpipe")

    def head(lay: Layout) -> float:
        return next(p.bytes for p in stage_activation_parts(model, lay, 1) if p.name.startswith("output head"))

    assert head(one_f_one_b) == pytest.approx(4 * 128 * 256 + 128 * 1000 * (4 + 4))
    assert head(gpipe) == pytest.approx(8 * 4 * 128 * 256 + 128 * 1000 * (4 + 4 + 7 * 2))
