"""ZeRO's memory on real gloo ranks against the planner's figure for the same model and layout.

Each case steps a tiny model once (start-up, optimizer state), then measures the second step with torch's
own accounting (hpctrain.simulate.memory.step_tracker, as tests/simulate/test_simulate.py does): the peak
snapshot's parameter, gradient and optimizer storage on each rank, against hpctrain.plan.memory's columns.
bf16 with fp32 reduction and 4 micro-batches per rank, so what lives between micro-batches shows: ZeRO-1 and
zero.accumulate_unsharded hold the unsharded fp32 gradients, ZeRO-2/3 only their shards.

Each column is compared at its own peak over the step (`column_peaks`), as the planner counts it. Tolerance:
TOLERANCE of the measured model states, both ways (measured: ZeRO-1/2 within 0.2%, ZeRO-3 +1.9% and with
zero.accumulate_unsharded +1.5%, where the planner counts a whole MLP's gradient and torch's peak holds a little
less).

The collectives' staging is a column of its own, "buffers" (torch's ALL_GATHER and REDUCE_SCATTER categories,
hpctrain.plan.states "Columns"). ZeRO-1 and zero.accumulate_unsharded fill their fp32 gradient buffer as
backward makes each gradient (hpctrain/parallel/grad_buffer.py): their gradients' peak is the buffer alone, and
one parameter's fresh bf16 gradient, a temporary to torch, is under buffers. Measured: the reduce-scatter input's
peak is the planner's exactly (one layer's, under ZeRO-3 one MLP's, fp32); the all-gather outputs
peak at two units (the one copied out and the next, prefetched: 2 layers under ZeRO-1/2, a block's MLP and
attention under ZeRO-3) where the planner counts one; the column's own peak (ZeRO-1/2: the forward's two
all-gathers or the backward's reduce-scatter, never together; ZeRO-3: the MLP's reduce-scatter and the
attention's prefetched all-gather) stays within the planner's all-gather plus reduce-scatter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpctrain.config.layout import resolve_layout
from hpctrain.plan.estimate import cluster_hardware
from hpctrain.plan.memory import memory_per_gpu
from hpctrain.plan.types import ModelShape
from hpctrain.simulate.memory import category_peaks, column_peaks, step_tracker
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import make_cfg, rank_batches

pytestmark = pytest.mark.usefixtures("gpu_rules")

TOLERANCE = 0.05
STATES = ("params", "grads", "optimizer")
BASE = {
    "precision__dtype": "bf16",
    "precision__reduce_dtype": "fp32",
    "train__global_batch": 16,
    "train__micro_batch": 2,
    "model__n_layers": 4,
    "model__d_model": 128,
    "model__n_heads": 4,
}
FILLED = {"zero1", "zero3_accumulate_unsharded"}  # the fp32 buffer filled as gradients are made (grad_buffer)
CASES = {
    "zero1": {"zero__stage": 1},
    "zero2": {"zero__stage": 2},
    "zero3": {"zero__stage": 3},
    "zero3_accumulate_unsharded": {"zero__stage": 3, "zero__accumulate_unsharded": True},
}


def _measured(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """This rank's peak storage by planner column, and the all-gather and reduce-scatter buffers' own peaks, over
    its second step, for each case in turn (one process group for all: a fork per case would cost more than the
    cases)."""
    from hpctrain.parallel.engine import build_engine

    torch.set_num_threads(1)
    out = {}
    for name, overrides in cases.items():
        cfg = make_cfg(world, **overrides)
        engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
        engine.step(rank_batches(0, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
        tracker = step_tracker(engine.model_parts, engine.optimizers)
        with tracker:
            engine.step(rank_batches(1, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
        staging = category_peaks(tracker)
        out[name] = {
            **column_peaks(tracker),
            "all_gather": staging.get("All Gather", 0),
            "reduce_scatter": staging.get("Reduce Scatter", 0),
        }
    return out


def _planned(overrides: dict[str, Any], world: int) -> dict[str, float]:
    cfg = make_cfg(world, **overrides)
    layout = resolve_layout(cfg)
    mem = memory_per_gpu(ModelShape.of(cfg.model, cfg.train.seq_len), layout, cluster_hardware(cfg.cluster))
    staged = {
        name: sum(p.bytes for p in mem.parts if p.kind == "buffers" and p.on_gpu and key in p.name)
        for name, key in (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"), ("fresh", "fresh"))
    }
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "buffers": mem.buffers, **staged}


def _states(columns_: dict[str, float]) -> float:
    return sum(columns_[k] for k in STATES)


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, int]]]:
    ranks = run_distributed(_measured, 2, {name: {**BASE, **case} for name, case in CASES.items()}, timeout=240)
    return {name: [r[name] for r in ranks] for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_what_the_planner_counts(name: str, measured: dict[str, list[dict[str, int]]]) -> None:
    plan = _planned({**BASE, **CASES[name]}, 2)
    for rank, mine in enumerate(measured[name]):
        assert _states(plan) == pytest.approx(_states(mine), rel=TOLERANCE), (rank, plan, mine)
        assert plan["optimizer"] == pytest.approx(mine["optimizer"], rel=0.01), (rank, plan, mine)


def test_sharding_gradients_across_micro_batches_saves_their_unsharded_buffer(
    measured: dict[str, list[dict[str, int]]],
) -> None:
    """ZeRO-2/3 keep gradient shards between micro-batches; ZeRO-1 and the option keep them whole (fp32)."""
    grads = {name: max(r["grads"] for r in ranks) for name, ranks in measured.items()}
    params = {name: max(r["params"] for r in ranks) for name, ranks in measured.items()}
    assert grads["zero2"] < 0.75 * grads["zero1"], grads
    assert grads["zero3"] < 0.75 * grads["zero3_accumulate_unsharded"], grads
    assert params["zero3"] < 0.75 * params["zero2"], params  # ZeRO-3 gathers a unit at a time


@pytest.mark.parametrize("name", sorted(FILLED))
def test_the_gradient_buffer_is_all_the_gradients_held(name: str, measured: dict[str, list[dict[str, int]]]) -> None:
    """ZeRO-1 and zero.accumulate_unsharded: each gradient goes into the fp32 buffer as backward makes it (the tied
    head's too), so the gradients' peak is the buffer, Megatron's 4 bytes a parameter, and nothing besides."""
    plan = _planned({**BASE, **CASES[name]}, 2)
    for rank, mine in enumerate(measured[name]):
        assert plan["grads"] == pytest.approx(mine["grads"], rel=0.01), (rank, plan, mine)


@pytest.mark.parametrize("name", list(CASES))
def test_collective_buffers_are_counted_apart_as_torch_names_them(
    name: str, measured: dict[str, list[dict[str, int]]]
) -> None:
    """The buffers column is staging (one unit's all-gather output, one unit's reduce-scatter input) and, where the
    buffer is filled as gradients are made, one parameter's fresh bf16 gradient (torch counts it a temporary);
    the reduce-scatter input is torch's reduce-scatter peak; torch's all-gather peak is one unit and its
    prefetched neighbour; torch's buffers column holds at most one of each."""
    plan = _planned({**BASE, **CASES[name]}, 2)
    assert plan["buffers"] == plan["all_gather"] + plan["reduce_scatter"] + plan["fresh"], plan
    assert (plan["fresh"] > 0) == (name in FILLED)
    for rank, mine in enumerate(measured[name]):
        assert plan["reduce_scatter"] == pytest.approx(mine["reduce_scatter"], rel=0.01), (rank, plan, mine)
        assert plan["all_gather"] <= mine["all_gather"] <= 2 * plan["all_gather"], (rank, plan, mine)
        # at most one reduce-scatter input and one all-gather output are held together
        assert mine["buffers"] <= plan["reduce_scatter"] + plan["all_gather"], (rank, plan, mine)
