"""The interleaved 1F1B schedule's in-flight micro-batches chunk by chunk (plan/pipeline.py), and what torch's runtime
schedule keeps unsharded of a rank's chunks (memory.interleaved_held_params)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpctrain.plan.activations import inflight_microbatches
from hpctrain.plan.memory import chunk_params_per_gpu, interleaved_held_params
from hpctrain.plan.pipeline import held_chunks
from hpctrain.plan.types import Layout
from tests.plan.shapes import shape

LLAMA_405B = shape("llama", 126, 16384, 128, 8192, 128256, ffn_hidden=53248, vocab_pad_multiple=64, kv_heads=8)


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (8, 16, 2), (16, 64, 4), (8, 24, 3)])
def test_even_chunks_give_korthikantis_count(p: int, m: int, v: int) -> None:
    """Even chunks: every rank holds Megatron's warm-up + 1 chunk forwards, (2(p - i - 1) + (v - 1) p + 1) / v
    stage-equivalents, p + (p - 1)/v on the first (Korthikanti et al. 2022, sec. 4.2.3)."""
    for rank in range(p):
        held = held_chunks(p, m, v, rank, (1,) * v)
        assert sum(held) / v == pytest.approx(inflight_microbatches(p, m, v, "interleaved_1f1b", rank))
    assert sum(held_chunks(p, m, v, 0, (1,) * v)) / v == pytest.approx(p + (p - 1) / v)


def test_the_uneven_cut_holds_the_light_chunk_more_often() -> None:
    """Llama 3 405B's 1 + 62 x 2 + 1 on 16 x 4 chunks: rank 0's chunks hold 1, 2, 2, 2 layers. With 32 micro-batches
    its warm-up (78 forwards + 1) runs chunk 0 for 31 of them: 127 layer-micro-batches, not 7 x 19.75; with 16 it
    runs every forward before the first backward: 16 of each chunk, 112."""
    assert held_chunks(16, 32, 4, 0, (1, 2, 2, 2)) == (31, 16, 16, 16)
    assert held_chunks(16, 16, 4, 0, (1, 2, 2, 2)) == (16, 16, 16, 16)


def test_torchs_interleaved_schedule_keeps_three_chunks_gathered() -> None:
    """ZeRO-1 under torch's interleaved 1F1B: the 3 largest chunks' parameters unsharded; with one round of
    micro-batches the largest chunk's gradients, with two every chunk's (memory.interleaved_held_params)."""
    lay = Layout(
        dp=128,
        tp=8,
        pp=16,
        virtual_stages=4,
        zero_stage=1,
        grad_accum=16,
        sequence_parallel=True,
        schedule="interleaved_1f1b",
        first_stage_layers=1,
        last_stage_layers=1,
    )
    chunks = chunk_params_per_gpu(LLAMA_405B, lay, 0)
    assert len(chunks) == 4 and chunks[1] == chunks[2] == chunks[3] > chunks[0]
    assert interleaved_held_params(LLAMA_405B, lay, 0) == (3 * chunks[1], chunks[1])
    two_rounds = replace(lay, dp=64, grad_accum=32)
    assert interleaved_held_params(LLAMA_405B, two_rounds, 0) == (3 * chunks[1], sum(chunks))
    assert (
        interleaved_held_params(
            LLAMA_405B, replace(lay, virtual_stages=1, schedule="1f1b", first_stage_layers=7, last_stage_layers=7), 0
        )
        is None
    )
