"""The learning-rate schedule: warmup, then decay to lr x min_lr_ratio."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpctrain.train.lr_schedule import lr_at


def optim(decay: str = "cosine") -> SimpleNamespace:
    return SimpleNamespace(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, decay=decay)


def test_warmup_is_linear_from_lr_over_warmup() -> None:
    assert lr_at(0, optim(), 100) == pytest.approx(1e-4)
    assert lr_at(9, optim(), 100) == pytest.approx(1e-3)


@pytest.mark.parametrize("decay,mid", [("cosine", 0.55e-3), ("linear", 0.55e-3), ("constant", 1e-3)])
def test_decay_midpoint_and_end(decay: str, mid: float) -> None:
    assert lr_at(55, optim(decay), 100) == pytest.approx(mid)
    end = 1e-3 if decay == "constant" else 1e-4
    assert lr_at(100, optim(decay), 100) == pytest.approx(end)


def test_cosine_is_monotone_after_warmup() -> None:
    lrs = [lr_at(s, optim(), 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
