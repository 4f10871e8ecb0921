"""Pipeline bubble formulas (Narayanan et al. 2021 sec. 2.2) and the design article's 90% claim."""

import pytest

from hpctrain.plan.bubble import (
    bubble_fraction,
    bubble_overhead,
    microbatches_for_efficiency,
    pipeline_efficiency,
)


def test_no_pipeline_has_no_bubble():
    assert bubble_fraction(1, 1) == 0.0
    assert pipeline_efficiency(1, 7) == 1.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_share_the_bubble(schedule):
    # (p - 1) / (m + p - 1): 4 stages, 8 microbatches -> 3 / 11
    assert bubble_fraction(4, 8, schedule=schedule) == pytest.approx(3 / 11)
    assert bubble_overhead(4, 8, schedule=schedule) == pytest.approx(3 / 8)


def test_article_rule_of_thumb_is_82_not_90_percent():
    p = 8
    eff = pipeline_efficiency(p, 4 * p)
    assert eff == pytest.approx(1 - 7 / 39)
    assert round(eff * 100) == 82
    assert eff < 0.9


def test_article_175b_layout_idles_37_percent():
    assert bubble_fraction(8, 12) == pytest.approx(7 / 19)
    assert round(bubble_fraction(8, 12) * 100) == 37


def test_interleaved_divides_bubble_time_by_v():
    # bubble time (p-1)/v t_mb against ideal m t_mb: p=8, v=4, m=16 -> 1.75 / 17.75
    assert bubble_fraction(8, 16, 4, "interleaved_1f1b") == pytest.approx(1.75 / 17.75)
    assert bubble_overhead(8, 16, 4, "interleaved") == pytest.approx(7 / (4 * 16))
    assert bubble_fraction(8, 16, 1, "interleaved_1f1b") == pytest.approx(bubble_fraction(8, 16))


def test_zero_bubble_schedules():
    assert bubble_fraction(8, 16, schedule="zb_h1") == pytest.approx((7 / 3) / (16 + 7 / 3))
    assert bubble_fraction(8, 16, schedule="zb_h2") == 0.0


def test_virtual_stages_need_interleaved_schedule():
    with pytest.raises(ValueError):
        bubble_fraction(8, 16, 2, "1f1b")
    with pytest.raises(ValueError):
        bubble_fraction(8, 16, schedule="nonsense")


def test_microbatches_for_90_percent():
    # m / (m + 7) >= 0.9  <=>  m >= 63
    assert microbatches_for_efficiency(8, 0.9) == 63
    assert pipeline_efficiency(8, 63) >= 0.9 > pipeline_efficiency(8, 62)
    # interleaving with v = 7 makes the bubble one microbatch: m >= 9
    assert microbatches_for_efficiency(8, 0.9, 7, "interleaved_1f1b") == 9


def test_torch_pipelining_schedules():
    # looped BFS has the interleaved bubble; zero-bubble interleaved a third of it; ZB-V none (optimistic)
    assert bubble_fraction(8, 16, 4, "looped_bfs") == pytest.approx(bubble_fraction(8, 16, 4, "interleaved_1f1b"))
    assert bubble_fraction(8, 16, 2, "interleaved_zero_bubble") == pytest.approx((7 / 6) / (16 + 7 / 6))
    assert bubble_fraction(8, 16, 2, "zbv") == 0.0
