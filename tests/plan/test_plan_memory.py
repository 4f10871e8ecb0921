"""Model-state memory (ZeRO paper) and activation memory (Korthikanti et al. 2022) on hand-computed cases,
and where parameters live. hpctrain's own activation and model-state models: test_plan_activations.py and
test_plan_states.py."""

import pytest

from hpctrain.models.params import layer_params
from hpctrain.plan.activations import LOSS_CHUNK_ELEMENTS
from hpctrain.plan.memory import (
    activation_bytes_per_layer,
    bytes_per_param,
    inflight_microbatches,
    korthikanti_bytes_per_layer,
    layer_activation_bytes,
    layer_params_per_gpu,
    memory_per_gpu,
    stage_activation_bytes,
    stage_params_per_gpu,
    zero_model_states,
)
from hpctrain.plan.types import GB, GiB, Hardware, Layout
from tests.plan.shapes import GPT, dims, gpt

# ------------------------------------------------------------------ ZeRO paper, Figure 1


@pytest.mark.parametrize(
    "stage, paper_gb",
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],  # baseline, P_os, P_os+g, P_os+g+p
)
def test_zero_figure_1(stage, paper_gb):
    """Psi = 7.5B, N_d = 64, K = 12, in the paper's units (1 GB = 1e9 bytes) and rounding."""
    states = zero_model_states(7.5e9, dp=64, zero_stage=stage, dtype="fp16")
    assert round(states.total / GB, 1) == paper_gb


def test_zero_figure_1_formulas():
    psi, nd = 7.5e9, 64
    assert zero_model_states(psi, nd, 1, "fp16").total == pytest.approx(2 * psi + 2 * psi + 12 * psi / nd)
    assert zero_model_states(psi, nd, 2, "fp16").total == pytest.approx(2 * psi + 14 * psi / nd)
    assert zero_model_states(psi, nd, 3, "fp16").total == pytest.approx(16 * psi / nd)


def test_adam_is_16_bytes_per_param_not_8():
    assert sum(bytes_per_param("bf16")) == 16
    assert sum(bytes_per_param("fp32")) == 16  # 4 + 4 + 8
    assert bytes_per_param("fp32") == (4, 4, 8)
    assert bytes_per_param("bf16", grad_bytes=4) == (2, 4, 12)  # Megatron's fp32 main grads


# ------------------------------------------------------------------ Korthikanti et al. 2022, per layer
# The paper's formulas (Megatron: the attention matrix materialised, dropout masks, SP saves shards) are kept
# verbatim in korthikanti_bytes_per_layer, and activation_bytes_per_layer gives them back with
# flash_attention=False, dropout=True, sp_keeps_gathered=False. hpctrain's defaults differ (flash attention
# via SDPA, see test_plan_activations.py): that is why these tests pass the flags.

# GPT-3 175B shapes: s = 2048, h = 12288, a = 96, b = 1, t = 8; sbh = 25,165,824 and 5as/h = 80.
S, H, A, T = 2048, 12288, 96, 8
SBH = 25_165_824  # 2048 * 12288
MEGATRON = {"flash_attention": False, "dropout": True, "sp_keeps_gathered": False}


def test_korthikanti_no_parallelism():
    # sbh (34 + 80) = 114 sbh
    assert korthikanti_bytes_per_layer(S, 1, H, A) == 114 * SBH == 2_868_903_936
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, **MEGATRON) == 114 * SBH


def test_korthikanti_tensor_parallel():
    # sbh (10 + 24/8 + 80/8) = 23 sbh
    assert korthikanti_bytes_per_layer(S, 1, H, A, tp=T) == pytest.approx(23 * SBH)
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, tp=T, **MEGATRON) == pytest.approx(23 * SBH)


def test_korthikanti_tensor_and_sequence_parallel():
    # sbh/8 (34 + 80) = 14.25 sbh
    assert korthikanti_bytes_per_layer(S, 1, H, A, T, sequence_parallel=True) == pytest.approx(14.25 * SBH)
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, T, True, **MEGATRON) == pytest.approx(14.25 * SBH)


def test_korthikanti_selective_recompute():
    assert korthikanti_bytes_per_layer(S, 1, H, A, T, True, "selective") == pytest.approx(34 / 8 * SBH)
    assert korthikanti_bytes_per_layer(S, 1, H, A, T, False, "selective") == pytest.approx(13 * SBH)


def test_korthikanti_full_recompute():
    assert korthikanti_bytes_per_layer(S, 1, H, A, T, False, "full") == 2 * SBH
    assert korthikanti_bytes_per_layer(S, 1, H, A, T, True, "full") == pytest.approx(2 * SBH / 8)
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, T, False, "full") == 2 * SBH  # the same in hpctrain
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 1, T, True, "full") == pytest.approx(2 * SBH / 8)


def test_activations_scale_with_micro_batch_and_ffn():
    assert korthikanti_bytes_per_layer(S, 4, H, A, T, True) == pytest.approx(4 * 14.25 * SBH)
    assert activation_bytes_per_layer(GPT, dims(H, A), S, 4, T, True) == pytest.approx(
        4 * activation_bytes_per_layer(GPT, dims(H, A), S, 1, T, True)
    )
    # MLP width f = 2h: "34" becomes 18 + 4 f/h = 26
    assert korthikanti_bytes_per_layer(128, 1, 64, 4, ffn_hidden=128) == pytest.approx(
        128 * 64 * (26 + 5 * 4 * 128 / 64)
    )


def test_inflight_microbatches():
    assert inflight_microbatches(1, 12, 1, "1f1b") == 1
    assert inflight_microbatches(8, 12, 1, "1f1b") == 8  # first stage holds p
    assert inflight_microbatches(8, 12, 1, "1f1b", stage=7) == 1  # last stage one
    assert inflight_microbatches(8, 4, 1, "1f1b") == 4  # fewer microbatches than stages
    assert inflight_microbatches(8, 12, 1, "gpipe") == 12
    assert inflight_microbatches(8, 12, 2, "looped_bfs") == 12  # breadth-first: all microbatches, like GPipe
    assert inflight_microbatches(8, 12, 1, "zb_h2") == 12 and inflight_microbatches(8, 32, 1, "zb_h2") == 15
    assert inflight_microbatches(8, 12, 2, "zbv", stage=7) == 8  # V shape: every stage like 1F1B's first
    # interleaved: p (1 + (p-1)/(p v)) stage-equivalents = 8 + 7/2
    assert inflight_microbatches(8, 16, 2, "interleaved_1f1b") == pytest.approx(8 * (1 + 7 / 16))


def test_first_stage_holds_whole_model_of_activations():
    """Korthikanti eq. 5: with 1F1B the first stage stores L layers' worth, whatever p is. (dp = 2 here and below:
    DP over TP/PP is FSDP2's, with bf16 parameters; without DP hpctrain runs autocast, fp32 residual stream.)
    The first stage also holds what the token embedding's backward makes under TP when FSDP2 accumulates (here
    `replicate`, ZeRO-0 with TP/PP, under PP): working copies of the whole table on every TP rank, in the reduce
    dtype and the compute dtype, once whatever the micro-batches in flight (found by dry_run=simulate)."""
    model = gpt(96, H, A, S, 50257, dropout=0.1)
    lay = Layout(dp=2, tp=8, pp=8, micro_batch=1, grad_accum=16, sequence_parallel=True)
    per_layer = activation_bytes_per_layer(GPT, dims(H, A), S, 1, 8, True, dropout=True)
    embedding_dropout = SBH * 8  # s b h p, one byte each: the embedding sum stays replicated over TP
    # rows x h x (reduce dtype + compute dtype): no reduce_dtype, so bf16 + bf16 (vocab_pad_multiple 1: 50257 rows)
    embedding_backward = 50257 * H * (2 + 2)
    assert stage_activation_bytes(model, lay, 0) == pytest.approx(
        96 * per_layer + embedding_dropout + embedding_backward
    )
    inter = Layout(
        dp=2,
        tp=8,
        pp=8,
        virtual_stages=2,
        micro_batch=1,
        grad_accum=16,
        sequence_parallel=True,
        schedule="interleaved_1f1b",
    )
    # torch's order (pipeline.held_chunks): 2 x 7 + 8 warm-up forwards and the first steady one, 8 + 7 of chunk 0,
    # 8 of chunk 1: 23 chunk-micro-batches of 6 layers = 96 (1 + 7/16) layers, and 15 embedding dropout masks
    assert stage_activation_bytes(model, inter, 0) == pytest.approx(
        96 * per_layer * (1 + 7 / 16) + embedding_dropout / 8 * 15 + embedding_backward
    )


def test_last_stage_adds_the_head_and_logits():
    """12 layers x 1 micro-batch + final LayerNorm input (/t, SP) + the head's gathered input + the logits of this
    TP rank's vocabulary shard: 4 bytes per logit (the bf16 logits the loss keeps, which the pipeline schedule
    keeps too, and their bf16 gradient) + the loss's fp32 working copy of one chunk (activations.logits_bytes)."""
    model = gpt(96, H, A, S, 50257)
    lay = Layout(dp=2, tp=8, pp=8, micro_batch=1, grad_accum=16, sequence_parallel=True)
    per_layer = activation_bytes_per_layer(GPT, dims(H, A), S, 1, 8, True)
    shard = 2048 * -(-model.vocab_rows(8) // 8)  # each TP rank's vocabulary shard of the padded logits
    last = 12 * per_layer + 2 * SBH / 8 + 2 * SBH + shard * 4 + 4 * min(shard, LOSS_CHUNK_ELEMENTS)
    assert stage_activation_bytes(model, lay, 7) == pytest.approx(last)


def test_recompute_adds_one_layer_transient():
    """Full recompute stores each layer's input and regenerates one layer's activations at a time. On the first
    stage two things come on top (found by dry_run=simulate): the first block's checkpoint saves its input, the
    embedding output, before SP's slicing hook (which runs inside the checkpointed region) cuts it to s/t, so
    the other (t - 1)/t of it stays, for each micro-batch in flight; and the token embedding backward's working
    copies of the whole table (FSDP2 `replicate` accumulating under PP)."""
    model = gpt(96, H, A, S, 50257)
    full = Layout(dp=2, tp=8, pp=8, grad_accum=16, sequence_parallel=True, recompute="full")
    stored = 96 * 2 * SBH / 8
    one_layer = activation_bytes_per_layer(GPT, dims(H, A), S, 1, 8, True) - 2 * SBH / 8
    # s b h x 2 bytes (FSDP2's bf16, no autocast) x (1 - 1/t), for the 8 micro-batches in flight on stage 0
    first_block_input = SBH * 2 * (1 - 1 / 8) * 8
    embedding_backward = 50257 * H * (2 + 2)  # rows x h x (reduce dtype + compute dtype), bf16 + bf16 here
    assert stage_activation_bytes(model, full, 0) == pytest.approx(
        stored + one_layer + first_block_input + embedding_backward
    )
    assert layer_activation_bytes(model, full) == pytest.approx(2 * SBH / 8)


# ------------------------------------------------------------------ where parameters live


def test_stage_params_cover_the_model():
    model = gpt(4, 64, 4, 32, 100)
    assert stage_params_per_gpu(model, Layout(dp=1, tp=1, pp=1), 0) == model.params
    # pp = 2, tied: the last stage keeps a copy of the word embedding (Megatron)
    two = Layout(dp=1, tp=1, pp=2)
    total = stage_params_per_gpu(model, two, 0) + stage_params_per_gpu(model, two, 1)
    assert total == model.params + 100 * 64
    assert layer_params_per_gpu(model, 1) == layer_params(GPT, dims(64, 4))
    assert layer_params_per_gpu(model, 4) == (layer_params(GPT, dims(64, 4)) - 6 * 64) / 4 + 6 * 64


def test_stage_params_use_the_padded_vocabulary():
    """The embedding is built with padded rows (hpctrain.models.params.padded_vocab): 100 -> 128 with
    multiple 64 x TP 2; the model's own count (ModelShape.params) keeps the tokenizer's 100."""
    model = gpt(4, 64, 4, 32, 100, vocab_pad_multiple=64)
    plain = gpt(4, 64, 4, 32, 100)
    assert model.params == plain.params
    assert model.vocab_rows(1) == 128 and model.vocab_rows(2) == 128 and model.vocab_rows(4) == 256
    assert model.padding_params(2) == 28 * 64
    assert stage_params_per_gpu(model, Layout(dp=1, tp=1, pp=1), 0) == model.params + 28 * 64
    tp2 = Layout(dp=1, tp=2, pp=1)
    assert stage_params_per_gpu(model, tp2, 0) - stage_params_per_gpu(plain, tp2, 0) == 28 * 64 / 2


# ------------------------------------------------------------------ the breakdown

HW = Hardware("test", 8, 80 * GiB, 312e12, 300e9, 25e9)


def test_memory_per_gpu_columns_add_up_and_most_loaded_gpu():
    model = gpt(96, H, A, S, 50257)
    lay = Layout(
        dp=64, tp=8, pp=8, micro_batch=1, grad_accum=12, zero_stage=1, sequence_parallel=True, recompute="full"
    )
    mem = memory_per_gpu(model, lay, HW)
    assert mem.total == pytest.approx(mem.params + mem.grads + mem.optimizer + mem.buffers + mem.activations)
    assert mem.total == pytest.approx(sum(p.bytes for p in mem.parts if not p.cpu))
    assert mem.activations == pytest.approx(stage_activation_bytes(model, lay, mem.stage))
    assert mem.usable == pytest.approx(0.9 * 80 * GiB)
    assert mem.fits and mem.headroom == pytest.approx(mem.usable - mem.total)
    no_sp = memory_per_gpu(model, Layout(dp=64, tp=8, pp=8, micro_batch=4, grad_accum=12), HW)
    assert not no_sp.fits and no_sp.headroom < 0
