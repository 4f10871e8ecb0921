"""A Mixture-of-Experts run under expert parallelism stops and resumes as a dense one does: bit-identical in the same
layout, and continuing within 1e-4 after moving its experts between EP degrees (EP 2 -> EP 1 -> EP 4: DCP reshards
the expert weights and their Adam moments, saved as whole [n_experts, ...] tensors); a checkpoint taken while the
sigmoid router's bias moves holds the bias of its own step."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hpctrain.checkpoint.manager as manager_module
from hpctrain.checkpoint.storage import committed_in
from tests.checkpoint.test_checkpoint import SMALL, config, model_weights, tiers
from tests.checkpoint.training import consumed_samples, losses_by_step, metrics, train

# A tiny Qwen3-MoE (4 experts, top 2) with both auxiliary losses on, in the checkpoint suite's SMALL run.
MOE = [
    "model.arch=qwen3_moe",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.ffn_hidden=64",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.balance_coef=0.01",
    "model.moe.z_loss_coef=0.001",
]


@pytest.mark.timeout(400)
@pytest.mark.usefixtures("gpu_rules")
def test_an_expert_parallel_run_resumes_bit_identically(compose_cfg, tmp_path: Path) -> None:
    common = ["train.max_steps=6", "parallel.ep=2", "zero=stage1", *MOE]
    straight = tmp_path / "straight"
    train(
        2,
        config(compose_cfg, tmp_path / "a", 2, *common, *tiers(tmp_path / "a", ram=3, local=100, shared=100)),
        straight,
    )
    stopped = tmp_path / "stopped"
    cfg = config(compose_cfg, tmp_path / "b", 2, *common, *tiers(tmp_path / "b", ram=3, local=100, shared=100))
    first = train(2, cfg, stopped, signal_at=4, signal_rank=1)
    assert all("preempted" in r and "step 5" in r["preempted"] for r in first), first
    train(2, cfg, stopped)
    a, b = losses_by_step(straight), losses_by_step(stopped)
    assert list(b) == list(range(1, 7))
    assert all(a[s] == b[s] for s in range(1, 7)), [(s, a[s], b[s]) for s in range(1, 7) if a[s] != b[s]]
    wa = model_weights(straight / "checkpoints" / "step_00000006")
    wb = model_weights(stopped / "checkpoints" / "step_00000006")
    assert wa["layers.0.mlp.experts.w_gate"].shape == (4, 64, 64)  # saved whole, whatever the EP degree
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert consumed_samples(stopped) == list(range(6 * 8))
    row = metrics(stopped)[-1]
    assert row["moe/balance_loss"] > 0.9 and "moe/layer1/imbalance" in row


@pytest.mark.timeout(600)
def test_experts_move_between_ep_degrees_and_training_continues(compose_cfg, tmp_path: Path) -> None:
    """EP 2 (2 ranks) stops at step 2, EP 1 (1 rank, 4 micro-batches) resumes to step 4 and stops, EP 4 (4 ranks,
    experts one per rank) finishes: each step's loss within 1e-4 of an uninterrupted EP 1 run."""
    steps = ["train.max_steps=6", *tiers(tmp_path, ram=100, local=100, shared=100), "optim.eps=1e-4", *MOE]
    reference = tmp_path / "reference"
    train(1, config(compose_cfg, tmp_path / "r", 1, *steps), reference)
    run_dir = tmp_path / "run"
    assert all(
        "preempted" in r
        for r in train(2, config(compose_cfg, tmp_path, 2, *steps, "parallel.ep=2"), run_dir, signal_at=1)
    )
    assert all("preempted" in r for r in train(1, config(compose_cfg, tmp_path, 1, *steps), run_dir, signal_at=3))
    train(4, config(compose_cfg, tmp_path, 4, *steps, "parallel.ep=4", "train.micro_batch=2", "zero=stage3"), run_dir)
    a, b = losses_by_step(reference), losses_by_step(run_dir)
    assert list(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a[step], b[step])
    assert consumed_samples(run_dir) == list(range(6 * 8))


def test_a_resume_across_a_checkpoint_taken_at_a_router_bias_update_is_bit_identical(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V3's sigmoid router moves its bias (a buffer, updated in place) once a step. A save's copy of the
    state runs while the next step computes, and what changes the state waits for it (the engine's
    before_update): the bias update too, or the checkpoint of step 1 holds step 2's bias and a resume from it
    routes step 2 otherwise. Made deterministic as the optimizer's fence test is: the copy starts only when the
    step reaches before_update, so it copies whatever changed before that point."""
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.records.fingerprint import fingerprint_of

    cfg = compose_cfg(
        *SMALL,
        *MOE,
        "model.moe.router=sigmoid",
        "model.moe.bias_update_rate=0.01",
        "cluster.gpus_per_node=1",
        "train.global_batch=2",
        "run.id=bias",
        f"checkpoint.tiers=[{{name: disk, path: {tmp_path}/tier, interval_steps: 1, keep_last: 2}}]",
    )

    def start() -> tuple[Any, CheckpointManager]:
        return (
            build_engine(cfg, resolve_layout(cfg), torch.device("cpu")),
            CheckpointManager(
                cfg.checkpoint, 0.0, tmp_path, "bias", 0, 1, fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
            ),
        )

    def state(engine: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}

    engine, manager = start()
    reached_update = threading.Event()
    copy = manager_module._copy_state_dict

    def late(*args: Any, **kwargs: Any) -> Any:
        assert reached_update.wait(60), "the step never reached before_update with a copy pending"
        return copy(*args, **kwargs)

    def fence() -> None:
        reached_update.set()
        manager.wait_for_staging()

    monkeypatch.setattr(manager_module, "_copy_state_dict", late)
    engine.before_update = fence
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (2, 1, 2, 32), generator=gen) for _ in range(3)]
    engine.step(data[0], 1e-3)
    reached_update.clear()
    at_step_1 = state(engine)
    manager.after_step(1, engine, {"consumed_samples": 2}, manager.control_values(time.monotonic()))
    engine.step(data[1], 1e-3)
    at_step_2 = state(engine)
    engine.step(data[2], 1e-3)
    straight = state(engine)
    manager.wait_all()
    bias = [k for k in at_step_1 if k.endswith("mlp.expert_bias")]
    assert bias and all(at_step_1[k].any() and not torch.equal(at_step_2[k], at_step_1[k]) for k in bias)
    saved = model_weights(committed_in(tmp_path / "tier" / "bias")[-1].path)
    moved = [k for k in bias if not torch.equal(saved[k], at_step_1[k])]
    assert not moved, f"the checkpoint of step 1 holds a later step's router bias: {moved}"

    monkeypatch.setattr(manager_module, "_copy_state_dict", copy)
    resumed, manager = start()
    assert manager.resume(resumed)["step"] == 1
    for batch in data[1:]:
        resumed.step(batch, 1e-3)
    after = state(resumed)
    assert all(torch.equal(after[k], straight[k]) for k in straight), [
        k for k in straight if not torch.equal(after[k], straight[k])
    ]
