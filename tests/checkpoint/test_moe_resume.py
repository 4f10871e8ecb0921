"""A Mixture-of-Experts run under expert parallelism stops and resumes as a dense one does: bit-identical in the same
layout, and continuing within 1e-4 after moving its experts between EP degrees (EP 2 -> EP 1 -> EP 4: DCP reshards
the expert weights and their Adam moments, saved as whole [n_experts, ...] tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_checkpoint import config, model_weights, tiers
from tests.checkpoint.training import consumed_samples, losses_by_step, metrics, train

# A tiny Qwen3-MoE (4 experts, top 2) with both auxiliary losses on, in the checkpoint suite's SMALL run.
MOE = ["model.arch=qwen3_moe", "model.n_kv_heads=1", "model.head_dim=32", "model.ffn_hidden=64",
       "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.balance_coef=0.01", "model.moe.z_loss_coef=0.001"]


@pytest.mark.timeout(400)
@pytest.mark.usefixtures("gpu_rules")
def test_an_expert_parallel_run_resumes_bit_identically(compose_cfg, tmp_path: Path) -> None:
    common = ["train.max_steps=6", "parallel.ep=2", "zero=stage1", *MOE]
    straight = tmp_path / "straight"
    train(2, config(compose_cfg, tmp_path / "a", 2, *common, *tiers(tmp_path / "a", ram=3, local=100, shared=100)),
          straight)
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
    assert all("preempted" in r for r in train(2, config(compose_cfg, tmp_path, 2, *steps, "parallel.ep=2"),
                                               run_dir, signal_at=1))
    assert all("preempted" in r for r in train(1, config(compose_cfg, tmp_path, 1, *steps), run_dir, signal_at=3))
    train(4, config(compose_cfg, tmp_path, 4, *steps, "parallel.ep=4", "train.micro_batch=2", "zero=stage3"),
          run_dir)
    a, b = losses_by_step(reference), losses_by_step(run_dir)
    assert list(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a[step], b[step])
    assert consumed_samples(run_dir) == list(range(6 * 8))
