"""robust_outliers on hand-made cases: one slow node, noise on identical nodes, MAD == 0."""

from __future__ import annotations

import pytest

from hpctrain.health.outliers import robust_outliers


def test_one_slow_node_among_eight_is_found() -> None:
    step_s = {f"n{i}": t for i, t in enumerate([1.00, 1.02, 0.99, 1.01, 1.00, 0.98, 1.01, 1.45])}
    found = robust_outliers(step_s)
    assert list(found) == ["n7"]
    assert found["n7"] > 3.5


def test_noise_on_identical_nodes_is_not_flagged() -> None:
    # Tiny MAD makes a 2% wobble score high; the 10% relative floor keeps it out.
    step_s = {f"n{i}": t for i, t in enumerate([1.000, 1.001, 0.999, 1.000, 1.001, 0.999, 1.000, 1.020])}
    assert robust_outliers(step_s) == {}
    assert "n7" in robust_outliers(step_s, min_rel=0.0)


def test_lower_is_worse_flags_the_low_one_with_a_positive_score() -> None:
    tflops = {f"n{i}": v for i, v in enumerate([150.0, 151.0, 149.0, 150.5, 90.0, 150.0])}
    assert robust_outliers(tflops) == {}
    found = robust_outliers(tflops, higher_is_worse=False)
    assert list(found) == ["n4"] and found["n4"] > 3.5


def test_mad_zero_all_equal_but_one() -> None:
    values = {f"n{i}": 100.0 for i in range(7)} | {"n7": 150.0}
    found = robust_outliers(values)
    assert list(found) == ["n7"]
    assert found["n7"] == pytest.approx(50 / (1.253314 * 50 / 8))


def test_mad_zero_but_one_within_the_floor_is_not_flagged() -> None:
    values = {f"n{i}": 100.0 for i in range(7)} | {"n7": 105.0}
    assert robust_outliers(values) == {}


def test_all_equal_and_tiny_inputs_have_no_outliers() -> None:
    assert robust_outliers({f"n{i}": 3.0 for i in range(8)}) == {}
    assert robust_outliers({"a": 1.0, "b": 100.0}) == {}
