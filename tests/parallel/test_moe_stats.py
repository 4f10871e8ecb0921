"""The MoE routing summaries a user watches: per-layer load and imbalance, the worst layer, dropped fraction, and
which experts the router starves for how long."""

from __future__ import annotations

import pytest

from hpctrain.parallel.moe_stats import IdleExperts, LayerLoad, MoEStepStats


def routed(*layers: list[float], dropped: float = 0.0) -> MoEStepStats:
    return MoEStepStats(
        tokens_per_expert=[list(layer) for layer in layers], balance_loss=1.02, z_loss=0.5, dropped=dropped
    )


def test_per_layer_load_worst_layer_and_dropped_fraction() -> None:
    stats = routed([4, 4, 4, 4], [8, 0, 6, 2], dropped=3)
    assert stats.layers() == [LayerLoad(4, 4, 4, ()), LayerLoad(0, 8, 4, (1,))]
    assert [load.imbalance for load in stats.layers()] == [1.0, 2.0]
    assert stats.worst_layer() == 1
    assert stats.dropped_fraction() == 3 / 32
    assert stats.metrics() == {
        "moe/balance_loss": 1.02,
        "moe/z_loss": 0.5,
        "moe/dropped_fraction": 3 / 32,
        "moe/imbalance_max": 2.0,
        "moe/idle_experts": 1,
        "moe/layer0/tokens_min": 4,
        "moe/layer0/tokens_max": 4,
        "moe/layer0/imbalance": 1.0,
        "moe/layer1/tokens_min": 0,
        "moe/layer1/tokens_max": 8,
        "moe/layer1/imbalance": 2.0,
    }


def test_imbalance_bounds() -> None:
    """Every token on one expert is n_experts; a layer that routed nothing waits on nothing, so it counts as 1."""
    stats = routed([0, 0, 12, 0, 0, 0, 0, 0], [0, 0, 0, 0])
    assert [load.imbalance for load in stats.layers()] == [8.0, 1.0]
    assert stats.layers()[1].idle == (0, 1, 2, 3)
    assert stats.worst_layer() == 0
    assert routed([0, 0]).dropped_fraction() == 0.0


def test_an_idle_expert_is_reported_once_per_idle_run() -> None:
    """Reported when its run of idle steps reaches the limit, not on the steps after; tokens end the run, and a
    new run is reported again."""
    idle = IdleExperts(steps=3)
    busy, starved = routed([5, 5, 5], [5, 5, 5]), routed([5, 0, 10], [0, 15, 0])
    reports = [idle.update(s) for s in (starved, starved, starved, starved, busy, starved, starved, starved)]
    assert reports == [{}, {}, {0: [1], 1: [0, 2]}, {}, {}, {}, {}, {0: [1], 1: [0, 2]}]


@pytest.mark.parametrize("gap", [1, 2])
def test_one_busy_step_restarts_the_count(gap: int) -> None:
    idle = IdleExperts(steps=3)
    busy, starved = routed([5, 5]), routed([10, 0])
    seq = [starved, starved] + [busy] * gap + [starved, starved]
    assert all(idle.update(s) == {} for s in seq)
    assert idle.update(starved) == {0: [1]}
