"""Decisions of the GPU path that the CPU can show: device binding, the local executor's GPUs, host syncs per
step, fused optimizers, vocabulary padding and the RNG streams a checkpoint keeps."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checks.cluster import _local_gpus, visible_gpus
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import resolve_layout
from hpctrain.distributed.environment import task_device
from hpctrain.launch.executor import build_executor
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.optimizer import optimizer_defaults
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import global_batch, make_cfg, rank_batches


def test_one_gpu_per_task_sites_bind_device_zero() -> None:
    """srun --gpus-per-task shows each task one device 0: local rank 3 must not ask for cuda:3."""
    assert task_device(3, cuda_devices=1) == torch.device("cuda", 0)
    assert task_device(3, cuda_devices=8) == torch.device("cuda", 3)
    assert task_device(5, cuda_devices=4) == torch.device("cuda", 1)
    assert task_device(3, cuda_devices=0) == torch.device("cpu")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpu_type,expected", [("h100", "0,1"), ("cpu", "")])
def test_local_executor_gives_each_task_its_gpus(compose_cfg, tmp_path: Path, gpu_type: str, expected: str) -> None:
    """A real submitit local job: without gpus_per_node submitit exports CUDA_VISIBLE_DEVICES="" and a GPU
    workstation trains on its CPUs. The node's one task (its elastic agent) sees every GPU of the node, or one
    task per rank does with launcher.in_allocation=false."""
    for in_allocation, tasks in ((True, 1), (False, 2)):
        cfg = compose_cfg(f"cluster.gpu_type={gpu_type}", f"launcher.in_allocation={in_allocation}")
        executor = build_executor(cfg, resolve_layout(cfg), "test", tmp_path)
        # os.getenv pickles by reference: the task process need not import this test module
        assert executor.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "<unset>").results() == [expected] * tasks


def test_local_gpu_checks(tmp_path: Path) -> None:
    driver = tmp_path / "gpus"
    for i in range(8):
        (driver / f"0000:{i:02x}:00.0").mkdir(parents=True)
    assert visible_gpus({}, str(driver)) == 8
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, str(driver)) == 2
    devices = tmp_path / "dev"
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (devices / name).mkdir(parents=True)
    assert visible_gpus({}, str(tmp_path / "none"), str(devices)) == 2  # a container without /proc/driver/nvidia
    assert visible_gpus({}, str(tmp_path / "none"), str(tmp_path / "none")) == 0
    idle = CheckReport(None)
    _local_gpus("cpu", 2, 8, idle)
    assert [w.key for w in idle.warnings] == ["cluster.gpu_type"] and "cluster.gpus_per_node=8" in idle.warnings[0].fix
    short = CheckReport(None)
    _local_gpus("h100", 4, 2, short)
    assert [e.key for e in short.errors] == ["cluster.gpus_per_node"] and "=2" in short.errors[0].fix
    fine = CheckReport(None)
    _local_gpus("cpu", 2, 0, fine)
    assert not fine.errors and not fine.warnings


def test_fused_adamw_where_the_device_has_it_foreach_elsewhere() -> None:
    cfg = make_cfg(1)
    assert optimizer_defaults(cfg.optim, "cuda")["fused"] is True
    assert optimizer_defaults(cfg.optim, "cpu")["fused"] is True  # torch's CPU kernel (not its for-loop default)
    mixed = optimizer_defaults(cfg.optim, "mixed")  # parameters on several devices: no one fused kernel
    assert mixed["foreach"] is True and "fused" not in mixed


def _host_syncs(rank: int, world: int, overrides: dict[str, Any]) -> list[int]:
    """Calls from hpctrain's code that copy a device value to the host, per engine step."""
    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    counts = [0]
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("hpctrain."):
                counts[0] += 1
            return __original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    per_step = []
    for step in range(3):
        counts[0] = 0
        engine.step(rank_batches(step, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr, [0.0, 1.0])
        per_step.append(counts[0])
    return per_step


@pytest.mark.parametrize(
    "world,overrides",
    [(1, {}), (2, {"parallel__tp": 2, "precision__loss_scaling": True})],
    ids=["single", "tp2_loss_scaling"],
)
def test_one_host_sync_per_step(world: int, overrides: dict[str, Any]) -> None:
    """The loss, the gradient norm and the control values reach the host together, once a step."""
    for per_step in run_distributed(_host_syncs, world, overrides, timeout=120):
        assert per_step == [1, 1, 1]


def _train(vocab_pad_multiple: int, steps: int = 3) -> tuple[list[float], torch.Tensor]:
    cfg = make_cfg(1, model__vocab_size=50, data__vocab_size=50, model__vocab_pad_multiple=vocab_pad_multiple)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    losses = []
    for step in range(steps):
        x, y = global_batch(step, cfg)
        losses.append(engine.step(torch.stack([x % 50, y % 50])[:, None], cfg.optim.lr).loss)
    return losses, engine.model.tok_emb.weight.detach().clone()


def test_vocabulary_padding_changes_neither_loss_nor_weights() -> None:
    """50 tokens padded to 64 rows: the padding rows are never looked up, their logits are cut before the
    loss, so they get no gradient and stay zero; the real rows train exactly as without padding."""
    padded_losses, padded = _train(64)
    plain_losses, plain = _train(1)
    assert padded.shape == (64, 64) and plain.shape == (50, 64)
    assert padded_losses == pytest.approx(plain_losses, rel=1e-6)
    torch.testing.assert_close(padded[:50], plain, rtol=1e-5, atol=1e-6)
    assert not padded[50:].any()


def test_checkpoints_keep_the_rng_streams_of_their_device() -> None:
    from hpctrain.checkpoint.manager import _rng_state, _set_rng_state

    state = _rng_state(torch.device("cpu"))
    assert set(state) == {"cpu"}  # on a GPU also "cuda": dropout masks there come from the CUDA generator
    expected = torch.rand(3)
    _set_rng_state(state, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


def test_export_of_a_padded_checkpoint_has_the_tokenizers_rows(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint.inspect import export_model
    from hpctrain.checkpoint.storage import Committed

    cfg = make_cfg(1, model__vocab_size=50, data__vocab_size=50, model__vocab_pad_multiple=64)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    dcp.save({"train": engine.state_dict()}, checkpoint_id=str(tmp_path / "step_1"), no_dist=True)
    m = cfg.model
    manifest = {"step": 1, "fingerprint": {"model": [m.n_layers, m.d_model, m.n_heads, 50, m.context, m.ffn_mult]}}
    out = export_model(Committed("x", 1, tmp_path / "step_1", manifest), tmp_path / "export.pt")[0]
    exported = torch.load(out)["tok_emb.weight"]
    assert exported.shape == (50, m.d_model)  # the checkpoint holds 64 rows
    assert torch.equal(exported, engine.model.tok_emb.weight.detach()[:50])


def test_a_gpu_run_that_finds_no_gpu_stops_instead_of_training_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpctrain.train.loop import _expect_a_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(
        RuntimeError,
        match=r"cluster.gpu_type=h100_80gb but this task sees no GPU "
        r"\(CUDA_VISIBLE_DEVICES='', torch .* built without CUDA\).*"
        r"cluster.gpu_type=cpu",
    ):
        _expect_a_gpu("h100_80gb", torch.device("cpu"))
    _expect_a_gpu("cpu", torch.device("cpu"))
    _expect_a_gpu("h100_80gb", torch.device("cuda", 0))


def test_a_gpu_step_reports_reserved_memory_and_allocator_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an out-of-memory compares with is what the caching allocator reserved, not what tensors hold: both are
    reported per step, and the retries that precede an out-of-memory (torch.cuda.memory_stats' num_alloc_retries).
    The CUDA allocator is what this machine lacks: its three queries stand in, with a GPU's figures."""
    import torch

    from hpctrain.parallel.metrics import memory_metrics

    assert set(memory_metrics(torch.device("cpu"))) == {"peak_mem_gb"}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 60 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 72 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 3})
    assert memory_metrics(torch.device("cuda", 0)) == {
        "peak_mem_gb": 60.0,
        "peak_reserved_gb": 72.0,
        "alloc_retries": 3.0,
    }
