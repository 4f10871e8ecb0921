"""Layout search: every candidate obeys the rules and fits; the design article's 175B layout is ranked and explained."""

from dataclasses import replace

import pytest

from hpctrain.config.layout import layout_rules
from hpctrain.plan.memory import memory_per_gpu
from hpctrain.plan.search import (
    cheapest_fitting,
    evaluate,
    explain,
    measured_mfu,
    rank_of,
    search_layouts,
    workload,
)
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import Layout, hardware
from tests.plan.shapes import gpt

GPT3 = gpt(n_layers=96, d_model=12288, n_heads=96, seq_len=2048, vocab_size=50257)
A100 = hardware("a100_80gb")
N_GPUS, GLOBAL_BATCH = 4096, 3072
ARTICLE = Layout(dp=64, tp=8, pp=8, zero_stage=3, micro_batch=4, grad_accum=12, sequence_parallel=True)


@pytest.fixture(scope="module")
def candidates():
    return search_layouts(GPT3, N_GPUS, A100, GLOBAL_BATCH, seq_len=2048)


def test_candidates_obey_rules_fit_and_are_sorted(candidates):
    assert len(candidates) > 10
    speeds = [c.tokens_per_s for c in candidates]
    assert speeds == sorted(speeds, reverse=True)
    for c in candidates:
        lay = c.layout
        assert layout_rules(lay, workload(GPT3, A100)) == []  # the checks' rules, the same functions
        assert lay.n_gpus == N_GPUS
        assert A100.gpus_per_node % lay.tp == 0 and GPT3.dims.n_heads % lay.tp == 0
        # even chunks, or the first and the last one layer lighter (they hold the embedding and the head)
        split = lay.layer_split(GPT3.dims.n_layers)
        inner = split[1:-1] or split
        assert len(set(inner)) == 1 and {split[0], split[-1]} <= {inner[0], inner[0] - 1}
        assert lay.micro_batch * lay.grad_accum * lay.dp == GLOBAL_BATCH
        assert lay.pp == 1 or lay.microbatches >= lay.pp
        assert c.memory.fits and c.memory.total <= c.memory.usable
        assert lay.sequence_parallel == (lay.tp > 1)
        assert c.why
    assert len({c.layout for c in candidates}) == len(candidates)


def test_only_the_cheapest_fitting_recompute_is_kept(candidates):
    order = ["none", "selective", "full"]
    for c in candidates[:50]:
        for cheaper in order[: order.index(c.layout.recompute)]:
            assert not memory_per_gpu(GPT3, replace(c.layout, recompute=cheaper), A100).fits


def test_the_layout_rules_the_search_obeys_catch_bad_layouts():
    w = workload(GPT3, A100)
    assert [key for key, _, _ in layout_rules(replace(ARTICLE, grad_accum=4), w)] == ["train.grad_accum"]  # m < pp
    assert [key for key, _, _ in layout_rules(replace(ARTICLE, tp=3, dp=512 // 3), w)] == ["parallel.tp"]  # 8 % 3
    assert layout_rules(replace(ARTICLE, recompute="selective"), w) == []


def test_article_layout_is_found_ranked_and_explained(candidates):
    article = cheapest_fitting(GPT3, ARTICLE, A100)
    # Without recomputation stage 0 needs ~83 GiB (8 micro-batches x 12 layers at 7.5 sbh, flash attention, and the
    # token embedding's gradient and backward copies, whole on each TP rank), and
    # hpctrain's selective policy keeps 6.75 sbh under SP at t = 8, not enough less: only full recompute fits.
    # (Before SDPA's flash attention was modelled, the planner's Korthikanti scores made "selective" the answer.)
    assert article is not None and article.layout.recompute == "full"
    assert article.layout in {c.layout for c in candidates}
    rank = rank_of(article.layout, candidates)
    best = candidates[0]
    assert rank > len(candidates) // 2  # well down the list...
    # ...because of the bubble (7/19 with 12 microbatches on 8 stages) and ZeRO-3's regathering
    assert article.step.bubble_fraction == pytest.approx(7 / 19)
    assert best.step.bubble_fraction < article.step.bubble_fraction
    assert best.step.dp_exposed_s < article.step.dp_exposed_s
    text = explain(article, best)
    assert "36.8%" in text and "ZeRO-3" in text and "63 microbatches" in text
    assert "faster" in text


def test_article_throughput_is_explained():
    """The article reports 120 samples/s (~20% MFU). Our estimate for its layout with full
    recomputation (the DeepSpeed-era default) is within 25% of that, and the measured MFU is below the
    estimate, as it should be for a model that leaves out stragglers, the optimizer step and latency."""
    full = estimate_step(GPT3, replace(ARTICLE, recompute="full"), A100)
    assert full.samples_per_s == pytest.approx(120, rel=0.25)
    assert measured_mfu(120, GPT3, N_GPUS, A100) == pytest.approx(full.mfu, rel=0.25)
    assert measured_mfu(120, GPT3, N_GPUS, A100) <= full.mfu


def test_rank_of_a_layout_outside_the_list(candidates):
    off_list = replace(ARTICLE, recompute="none")  # does not fit (~79 GiB), so it is no candidate; faster than full
    assert off_list not in {c.layout for c in candidates}
    assert rank_of(off_list, candidates, GPT3, A100) <= rank_of(replace(ARTICLE, recompute="full"), candidates)
    with pytest.raises(ValueError):
        rank_of(off_list, candidates)


def test_small_cpu_search():
    tiny = gpt(n_layers=4, d_model=128, n_heads=4, seq_len=256, vocab_size=256)
    cands = search_layouts(tiny, 2, hardware("cpu"), global_batch=16, dtype="fp32")
    layouts = {(c.layout.dp, c.layout.tp, c.layout.pp) for c in cands}
    assert layouts == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert all(c.layout.recompute == "none" for c in cands)
    assert "tok/s" in evaluate(tiny, cands[0].layout, hardware("cpu")).why


def test_nothing_fits_returns_empty():
    huge = gpt(n_layers=8, d_model=16384, n_heads=128, seq_len=2048, vocab_size=50257)
    assert search_layouts(huge, 8, hardware("a100_40gb"), global_batch=8, zero_stages=(0,)) == []
