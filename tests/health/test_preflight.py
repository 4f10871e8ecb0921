"""The pre-flight's verdict on node timings: a node is named only when it is slow in two rounds, and the
report keeps both timings. Real multi-node runs of it are in tests/slurm/test_health_on_slurm.py."""

from __future__ import annotations

from hpctrain.config.schema import HealthConfig
from hpctrain.health.preflight import _judge


def timings(**per_host: float) -> list[dict]:
    """Two ranks per host, the second 1% slower (a node is as slow as its slowest GPU)."""
    return [{"host": h, "rank": 2 * i + j, "report": None, "matmul_s": t * (1 + 0.01 * j)}
            for i, (h, t) in enumerate(per_host.items()) for j in range(2)]


def test_a_node_slow_in_both_rounds_is_named_with_both_timings() -> None:
    bad, summary = _judge(timings(n1=0.005, n2=0.050, n3=0.0051, n4=0.0049), HealthConfig(),
                          timings(n1=0.0050, n2=0.049, n3=0.0050, n4=0.0052))
    assert set(bad) == {"n2"} and summary["suspects"] == ["n2"]
    assert "50.5 ms" in bad["n2"][0] and "then 49.5 ms" in bad["n2"][0]
    assert summary["hosts"]["n2"]["matmul_s"] == [0.0505, 0.049 * 1.01]


def test_a_node_slow_only_once_is_a_hiccup_not_a_bad_node() -> None:
    bad, summary = _judge(timings(n1=0.0073, n3=0.0032, n4=0.0033), HealthConfig(),
                          timings(n1=0.0034, n3=0.0033, n4=0.0032))
    assert bad == {} and summary["slow"] == {} and summary["suspects"] == ["n1"]


def test_a_small_spread_on_identical_nodes_names_nobody() -> None:
    bad, summary = _judge(timings(n1=0.0050, n2=0.0052, n3=0.0051, n4=0.0055), HealthConfig())
    assert bad == {} and summary["suspects"] == []


def test_two_nodes_are_not_compared() -> None:
    bad, _ = _judge(timings(n1=0.005, n2=0.5), HealthConfig(), timings(n1=0.005, n2=0.5))
    assert bad == {}
