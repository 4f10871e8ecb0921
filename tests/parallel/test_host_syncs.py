"""Host syncs per step on real gloo ranks: exactly one, the control read, after the optimizer step is queued.

On a GPU every read of a device value by the host (`item`, `tolist`, `float()`, `if tensor:`) waits for the
launch queue to drain. The step needs one: the reduced [loss, squared norm, *control] vector, whose control
values (stop signals, checkpoint agreement, the lease) the loop acts on at every boundary. Clipping and the
non-finite check stay on the device and fused AdamW skips a non-finite step there (`found_inf`), so that one
read comes after the optimizer step is queued. tests/gpu_rules.py's `recording_host_reads` sees every read,
torch's own code included; the engine's `_read` and each optimizer's `step` are recorded in the same list.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed_harness import run_distributed
from tests.gpu_rules import recording_host_reads
from tests.parallel.layouts import make_cfg, rank_batches

PP = {"train__micro_batch": 2}
STEPS = 3


def _events_per_step(rank: int, world: int, overrides: dict[str, Any]) -> list[list[str]]:
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    events: list[str] = []
    read = engine._read

    def recorded_read(values: torch.Tensor) -> list[float]:
        events.append("Engine._read")
        return read(values)

    engine._read = recorded_read
    for opt in engine.optimizers:

        def recorded_step(*args: Any, __step: Any = opt.step, **kwargs: Any) -> Any:
            events.append("optimizer.step")
            return __step(*args, **kwargs)

        opt.step = recorded_step
    steps = []
    for s in range(STEPS):
        batches = rank_batches(s, cfg, engine.dp_rank, engine.dp_size)
        events.clear()
        with recording_host_reads(events):
            engine.step(batches, cfg.optim.lr, [1.0, 0.0])
        steps.append(list(events))
    return steps


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, {}),  # DDP
        (2, {"zero__stage": 3}),  # FSDP2
        (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),  # TP (+ the partial gradients' reduction)
        (2, {"parallel__pp": 2, "parallel__schedule": "1f1b", **PP}),  # PP (+ the tied embedding's reduction)
        (2, {"parallel__cp": 2}),  # CP: the chunks cut on the device, positions and gathers' order made there
    ],
    ids=["ddp2", "fsdp2", "tp2_sp", "pp2", "cp2"],
)
def test_one_host_sync_per_step_after_the_optimizer_step(world: int, overrides: dict[str, Any]) -> None:
    """Every step, the first included; under PP torch's schedule adds its stages' one-time start-up to the
    first step (shapes exchanged as pickled objects: `recv_object_list` reads their sizes), none of it ours."""
    for rank, steps in enumerate(run_distributed(_events_per_step, world, overrides, timeout=120)):
        for step, events in enumerate(steps):
            reads = [e for e in events if e.startswith("host read")]
            if step == 0 and "parallel__pp" in overrides:
                startup = reads[:-1]
                assert startup and all("torch.distributed." in e for e in startup), (rank, events)
                reads = reads[-1:]
            assert len(reads) == 1 and "Tensor.tolist at hpctrain.parallel.engine" in reads[0], (rank, step, events)
            assert events[-2:] == ["Engine._read", reads[0]], (rank, step, events)
            assert "optimizer.step" in events and events.index("Engine._read") > max(
                i for i, e in enumerate(events) if e == "optimizer.step"
            ), (rank, step, events)


@pytest.mark.parametrize(
    "overrides", [{"parallel__ep": 2}, {"parallel__ep": 2, "parallel__recompute": "full"}], ids=["ep2", "ep2_recompute"]
)
def test_an_moe_layer_reads_its_routing_sizes_once_per_forward(overrides: dict[str, Any]) -> None:
    """Besides the step's control read, each MoE layer forward reads its split sizes once (expert parallelism's
    all-to-all takes host lists) and, off the grouped-GEMM path (CPU here; not H100/B200 in bf16), its per-expert
    segment sizes once: 4 layers x 2 micro-batches x 2, and a recomputed forward replays the forward's reads."""
    from tests.parallel.test_moe_layouts import MOE

    forwards = 4 * 2
    for rank, steps in enumerate(run_distributed(_events_per_step, 2, {**MOE, **PP, **overrides}, timeout=120)):
        for step, events in enumerate(steps):
            reads = [e for e in events if e.startswith("host read")]
            assert reads[-1].startswith("host read: Tensor.tolist at hpctrain.parallel.engine"), (rank, step, reads)
            routing = reads[:-1]
            moe = [e for e in routing if "hpctrain.models.common.moe" in e]
            assert len([e for e in moe if e.endswith("in _dispatch")]) == forwards
            assert len([e for e in moe if e.endswith("in run_experts")]) == forwards
            assert len(routing) == 2 * forwards, routing


def test_a_step_read_anywhere_else_is_seen() -> None:
    """The recorder is not blind: reads by torch's own code and by bool() count, each once."""
    events: list[str] = []
    t = torch.ones(3)
    with recording_host_reads(events):
        torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(t.clone())], 1.0, error_if_nonfinite=False)
        bool(t.sum() > 0)
        t.tolist()
        float(t[0])
    assert len(events) == 3, events  # clip_grad_norm_ (no grads) reads nothing; bool, tolist, float once each
