"""The training loop on blended Megatron-format datasets, on real gloo ranks: the exact-resume and resharding
checks of tests/checkpoint, with every sample's tokens checked too (not only its id), and the validation loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpctrain.config.schema import DataConfig, DataKind
from hpctrain.data.indexed import IndexedDatasetWriter
from hpctrain.data.loader import batch_of, open_datasets
from tests.checkpoint.test_checkpoint import config, model_weights, tiers
from tests.checkpoint.training import consumed_samples, consumed_tokens, losses_by_step, metrics, row_sums, train

SEQ = 32  # tests/checkpoint's SMALL config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Two byte-vocabulary datasets of documents counting up in random strides, 0.7 / 0.3, 10% of each held out
    for validation."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for name, docs in (("a", 300), ("b", 120)):
        with IndexedDatasetWriter(root / name, np.uint16) as writer:
            for _ in range(docs):
                start, stride, n = rng.integers(0, 250), rng.integers(1, 4), rng.integers(5, 200)
                writer.add_document(np.append((start + stride * np.arange(n)) % 250, 255))  # learnable
            writer.finalize()
    blend = f"0.7 {root}/a 0.3 {root}/b"
    return [
        "data=indexed",
        f"data.blend='{blend}'",
        "data.vocab_size=256",
        "data.valid_fraction=0.1",
        "train.eval_every=4",
        "train.eval_batches=2",
    ]


def expected_tokens(cfg: dict[str, Any], samples: int) -> dict[int, int]:
    """Sample id -> CRC32 of its tokens, read in this process from the same config."""
    d = cfg["data"]
    data = open_datasets(
        DataConfig(
            kind=DataKind.indexed, blend=d["blend"], valid_fraction=d["valid_fraction"], vocab_size=d["vocab_size"]
        ),
        cfg["train"]["seq_len"],
        cfg["train"]["seed"],
    )
    return dict(enumerate(row_sums(batch_of(data.train, range(samples), 1))))


def val_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metrics(run_dir) if "val_loss" in m}


@pytest.mark.timeout(300)
def test_resume_on_blended_data_is_bit_identical(compose_cfg, tmp_path: Path, corpus: list[str]) -> None:
    common = ["train.max_steps=12", *corpus]
    straight = tmp_path / "straight"
    train(2, config(compose_cfg, tmp_path / "a", 2, *common, *tiers(tmp_path / "a", 4, 100, 100)), straight)
    stopped = tmp_path / "stopped"
    cfg = config(compose_cfg, tmp_path / "b", 2, *common, *tiers(tmp_path / "b", 4, 100, 100))
    first = train(2, cfg, stopped, signal_at=6)  # USR2 in step 7: saved, stopped, resumed
    assert all("preempted" in r for r in first), first
    train(2, cfg, stopped)
    a, b = losses_by_step(straight), losses_by_step(stopped)
    assert list(b) == list(range(1, 13)) and all(a[s] == b[s] for s in b)
    assert val_losses(straight) == val_losses(stopped) and sorted(val_losses(stopped)) == [4, 8, 12]
    assert val_losses(stopped)[12] < val_losses(stopped)[4]  # held-out data: the model learns the byte statistics
    wa = model_weights(straight / "checkpoints" / "step_00000012")
    wb = model_weights(stopped / "checkpoints" / "step_00000012")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert consumed_samples(stopped) == list(range(12 * 8))
    assert consumed_tokens(stopped) == consumed_tokens(straight) == expected_tokens(cfg, 12 * 8)
    rows = metrics(stopped)
    assert all(0 <= m["data_wait_s"] < m["step_time_s"] for m in rows)


@pytest.mark.timeout(300)
def test_dp2_to_dp1_on_blended_data_reads_the_same_tokens(compose_cfg, tmp_path: Path, corpus: list[str]) -> None:
    run_dir = tmp_path / "run"
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=4", *corpus, *tiers(tmp_path, 2, 100, 100)), run_dir)
    cfg = config(
        compose_cfg, tmp_path, 1, "train.max_steps=7", "train.micro_batch=4", *corpus, *tiers(tmp_path, 2, 100, 100)
    )
    train(1, cfg, run_dir)
    assert consumed_samples(run_dir) == list(range(7 * 8))
    assert consumed_tokens(run_dir) == expected_tokens(cfg, 7 * 8)
    assert sorted(val_losses(run_dir)) == [4, 7]  # evaluated in both layouts, on the same validation samples
