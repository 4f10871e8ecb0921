"""Checkpoints on real gloo ranks: tiers, atomic commits, fallback, bit-identical resume, exact data position."""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

import hpctrain.checkpoint.manager as manager_module
from hpctrain.checkpoint.inspect import export_model, find, list_checkpoints
from hpctrain.checkpoint.manager import ReusingStager
from hpctrain.checkpoint.storage import Committed, committed_in, verify
from hpctrain.records.failures import read_failures
from tests.checkpoint.training import consumed_samples, losses_by_step, train
from tests.distributed_harness import DistributedTestError

SMALL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.micro_batch=2",
    "optim.warmup_steps=2",
    "data.max_bytes=300000",
    "checkpoint.when_busy=wait",
]  # every interval saved, whatever the machine's speed: deterministic tests


def config(compose_cfg, tmp_path: Path, world: int, *overrides: str) -> dict[str, Any]:
    cfg = compose_cfg(*SMALL, f"cluster.gpus_per_node={world}", "run.id=test", f"run.root={tmp_path}", *overrides)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def tiers(tmp_path: Path, ram: int = 2, local: int = 3, shared: int = 6) -> list[str]:
    return [
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_steps: {ram}, keep_last: 2}},"
        f"{{name: local, path: {tmp_path}/ssd, interval_steps: {local}, keep_last: 2}},"
        f"{{name: shared, path: checkpoints, interval_steps: {shared}, keep_last: 1}}]"
    ]


def steps_in(path: Path) -> list[int]:
    return [c.step for c in committed_in(path)]


def model_weights(ckpt_path: Path) -> dict[str, torch.Tensor]:
    manifest = json.loads((ckpt_path / "manifest.json").read_text())
    out = ckpt_path.parent / "export.pt"
    export_model(Committed("x", manifest["step"], ckpt_path, manifest), out)
    return torch.load(out)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("gpu_rules")  # the staging, writer and commit threads use no device group, touch no CUDA
def test_tier_intervals_and_retention(compose_cfg, tmp_path: Path) -> None:
    cfg = config(compose_cfg, tmp_path, 2, "train.max_steps=12", *tiers(tmp_path))
    run_dir = tmp_path / "run"
    train(2, cfg, run_dir)
    assert steps_in(tmp_path / "shm" / "test") == [10, 12]  # every 2, keep 2
    assert steps_in(tmp_path / "ssd" / "test") == [9, 12]  # every 3, keep 2
    assert steps_in(run_dir / "checkpoints") == [12]  # every 6, keep 1 (and the final state)
    for c in list_checkpoints_of(run_dir, tmp_path):
        assert verify(c) == [] and c.manifest["consumed_samples"] == c.step * 8 and c.manifest["world_size"] == 2
    assert not list((tmp_path / "shm" / "test").glob("*.partial"))
    # Written by DCP's background threads without torch.save's record CRC32s (the manager's switch reached them).
    shards = list((run_dir / "checkpoints").rglob("*.distcp"))
    assert shards and all(crc == 0 for shard in shards for crc in tensor_record_crcs(shard.read_bytes()))


def tensor_record_crcs(blob: bytes) -> list[int]:
    """CRC32s of the tensor records in the zip central directories of torch.save archives laid end to end."""
    crcs, i = [], blob.find(b"PK\x01\x02")
    while i >= 0:
        crc, name_len = struct.unpack_from("<I", blob, i + 16)[0], struct.unpack_from("<H", blob, i + 28)[0]
        if b"/data/" in blob[i + 46 : i + 46 + name_len]:
            crcs.append(crc)
        i = blob.find(b"PK\x01\x02", i + 4)
    return crcs


def list_checkpoints_of(run_dir: Path, tmp_path: Path) -> list:
    return [
        c
        for p in (tmp_path / "shm" / "test", tmp_path / "ssd" / "test", run_dir / "checkpoints")
        for c in committed_in(p)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [[], ["parallel.cp=2"]], ids=["dp2", "cp2"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(compose_cfg, tmp_path: Path, layout: list[str]) -> None:
    """Both ranks read different samples (DP 2), or the two halves of the same sequences (CP 2)."""
    common = ["train.max_steps=12", *tiers(tmp_path / "a", ram=4, local=100, shared=100), *layout]
    straight = tmp_path / "straight"
    train(2, config(compose_cfg, tmp_path / "a", 2, *common), straight)
    common = ["train.max_steps=12", *tiers(tmp_path / "b", ram=4, local=100, shared=100), *layout]
    stopped = tmp_path / "stopped"
    cfg = config(compose_cfg, tmp_path / "b", 2, *common)
    first = train(2, cfg, stopped, signal_at=7, signal_rank=1)  # USR2 to rank 1 only, in step 8
    assert all("preempted" in r and "step 8" in r["preempted"] for r in first), first  # all ranks stop together
    assert steps_in(tmp_path / "b" / "shm" / "test") == [4, 8]  # the stop saved to the fastest tier
    train(2, cfg, stopped)
    a, b = losses_by_step(straight), losses_by_step(stopped)
    assert list(b) == list(range(1, 13))
    assert all(a[s] == b[s] for s in range(1, 13)), [(s, a[s], b[s]) for s in range(1, 13) if a[s] != b[s]]
    wa = model_weights(straight / "checkpoints" / "step_00000012")
    wb = model_weights(stopped / "checkpoints" / "step_00000012")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert consumed_samples(stopped) == list(range(12 * 8))


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(compose_cfg, tmp_path: Path) -> None:
    cfg = config(compose_cfg, tmp_path, 2, "train.max_steps=12", *tiers(tmp_path, ram=4, local=100, shared=100))
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedTestError, match="died"):
        train(2, cfg, run_dir, timeout=120, kill_rank_in_save=1, kill_step=8)
    ram = tmp_path / "shm" / "test"
    assert steps_in(ram) == [4]  # step 8 never committed
    assert list(ram.glob("step_00000008.partial"))  # its debris is there, ignored
    train(2, cfg, run_dir)  # resumes from step 4
    assert not list(ram.glob("*.partial"))  # cleaned on start
    assert steps_in(ram) == [8, 12]
    assert consumed_samples(run_dir) == list(range(12 * 8))  # steps 5-8 redone, nothing skipped


@pytest.mark.timeout(300)
def test_fallback_to_a_slower_tier_when_the_fast_one_is_gone(compose_cfg, tmp_path: Path, capfd) -> None:
    cfg = config(
        compose_cfg,
        tmp_path,
        2,
        "train.max_steps=6",
        "checkpoint.save_final=false",
        *tiers(tmp_path, ram=2, local=3, shared=100),
    )
    run_dir = tmp_path / "run"
    train(2, cfg, run_dir)
    assert steps_in(tmp_path / "shm" / "test") == [4, 6] and steps_in(tmp_path / "ssd" / "test") == [3, 6]
    shutil.rmtree(tmp_path / "shm")  # the node's RAM is gone (e.g. the job moved to other nodes)
    shard = tmp_path / "ssd" / "test" / "step_00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])  # and local's newest is damaged
    capfd.readouterr()
    cfg8 = config(
        compose_cfg,
        tmp_path,
        2,
        "train.max_steps=8",
        "checkpoint.save_final=false",
        *tiers(tmp_path, ram=2, local=3, shared=100),
    )
    train(2, cfg8, run_dir)
    out = capfd.readouterr()
    logs = out.out + out.err
    assert "skipping tier local step 6" in logs and "resumed from tier local step 3" in logs, logs[-3000:]
    assert list(losses_by_step(run_dir)) == list(range(1, 9))
    assert consumed_samples(run_dir) == list(range(8 * 8))


@pytest.mark.timeout(200)
def test_resume_refuses_a_changed_batch_unless_forced(compose_cfg, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=4", *tiers(tmp_path, 2, 100, 100)), run_dir)
    changed = config(
        compose_cfg, tmp_path, 2, "train.max_steps=6", "train.global_batch=16", *tiers(tmp_path, 2, 100, 100)
    )
    with pytest.raises(DistributedTestError, match="checkpoint.force_resume=true"):
        train(2, changed, run_dir, timeout=60)
    # A start-up error leaves failure records too, so the supervisor sees the same error twice and stops.
    records = read_failures(run_dir, "test")
    assert {r["rank"] for r in records} == {0, 1}
    assert all(r["type"] == "CheckpointError" and not r["peer"] for r in records), records
    forced = config(
        compose_cfg,
        tmp_path,
        2,
        "train.max_steps=6",
        "train.global_batch=16",
        "checkpoint.force_resume=true",
        *tiers(tmp_path, 2, 100, 100),
    )
    train(2, forced, run_dir)
    assert losses_by_step(run_dir)[6] > 0


@pytest.mark.timeout(200)
def test_dp2_to_dp1_continues_the_data_exactly(compose_cfg, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=4", *tiers(tmp_path, 2, 100, 100)), run_dir)
    train(
        1,
        config(compose_cfg, tmp_path, 1, "train.max_steps=7", "train.micro_batch=4", *tiers(tmp_path, 2, 100, 100)),
        run_dir,
    )
    assert consumed_samples(run_dir) == list(range(7 * 8))


def test_checkpoint_tool_lists_verifies_and_exports(compose_cfg, tmp_path: Path) -> None:
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    cfg = config(compose_cfg, tmp_path, 2, "train.max_steps=4", *tiers(tmp_path, 2, 100, 100))
    (run_dir).mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    train(2, cfg, run_dir)
    tool = Path(__file__).resolve().parents[2] / "tools" / "checkpoint.py"
    listed = subprocess.run([sys.executable, str(tool), "list", str(run_dir)], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert "ram" in listed.stdout and "shared" in listed.stdout and " 4 " in listed.stdout and "ok" in listed.stdout
    ok = subprocess.run([sys.executable, str(tool), "verify", str(run_dir)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout
    newest = find(run_dir)
    victim = next(p for p in newest.path.iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:100])
    bad = subprocess.run(
        [sys.executable, str(tool), "verify", str(run_dir), "--step", str(newest.step), "--tier", newest.tier],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "BROKEN" in bad.stdout
    out = tmp_path / "export" / "model.pt"
    exported = subprocess.run(
        [sys.executable, str(tool), "export", str(run_dir), str(out), "--tier", "shared"],
        capture_output=True,
        text=True,
    )
    assert exported.returncode == 0, exported.stderr
    state = torch.load(out)
    assert state["tok_emb.weight"].shape == (256, 64) and len(list_checkpoints(run_dir)) >= 2


@pytest.mark.timeout(200)
def test_automatic_interval_follows_the_measured_cost_and_the_failure_rate(compose_cfg, tmp_path: Path) -> None:
    import math

    from hpctrain.goodput.model import daly_interval

    auto = [
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_steps: 2, keep_last: 2, auto: true}}]",
        "cluster.failure_rate_per_gpu_day=1000",
    ]  # MTBF 86400 / (1000 x 2 GPUs) = 43.2 s
    run_dir = tmp_path / "run"
    train(2, config(compose_cfg, tmp_path, 2, "train.max_steps=6", *auto), run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    tuned = [e for e in events if e["event"] == "interval_auto"]
    assert tuned and tuned[0]["mtbf_s"] == pytest.approx(43.2)
    expected = daly_interval(tuned[0]["blocked_s"], 43.2) / 60
    assert tuned[0]["minutes"] == pytest.approx(max(expected, tuned[0]["minutes"])) and math.isfinite(expected)
    assert tuned[0]["minutes"] < 1.0  # seconds between saves at this failure rate


RESHARD = {
    "dp4-zero3-to-dp2": ((4, ["zero=stage3"]), (2, ["zero=stage3"])),
    "tp2-to-tp1": ((2, ["parallel.tp=2"]), (1, [])),
    "pp2-to-pp1": ((2, ["parallel.pp=2"]), (1, [])),
    # uneven stages (1 + 3 layers) onto an even cut (2 + 2) and back: the checkpoint names layers globally
    "pp2-uneven-to-pp2": (
        (2, ["model.n_layers=4", "parallel.pp=2", "parallel.first_stage_layers=1"]),
        (2, ["model.n_layers=4", "parallel.pp=2"]),
    ),
    "pp2-to-pp2-uneven": (
        (2, ["model.n_layers=4", "parallel.pp=2"]),
        (2, ["model.n_layers=4", "parallel.pp=2", "parallel.last_stage_layers=3"]),
    ),
    "zero1-to-zero3": ((2, ["zero=stage1"]), (2, ["zero=stage3"])),
    # context parallelism: FSDP's shards over dp_shard x cp onto DP alone, and a plain DDP run onto CP x ZeRO-2
    "cp2-zero3-to-dp2-zero3": ((2, ["parallel.cp=2", "zero=stage3"]), (2, ["zero=stage3"])),
    "dp2-to-cp2-zero2": ((2, []), (2, ["parallel.cp=2", "zero=stage2"])),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(RESHARD))
def test_resume_in_another_layout_continues_exactly(compose_cfg, tmp_path: Path, case: str) -> None:
    """Stop in one layout, resume in another: losses continue within 1e-4 of an uninterrupted run, and the
    data position is exact (sample ids recorded on every rank)."""
    (world_a, layout_a), (world_b, layout_b) = RESHARD[case]
    steps = ["train.max_steps=6", *tiers(tmp_path, ram=100, local=100, shared=100), "optim.eps=1e-4"]
    reference = tmp_path / "reference"
    train(world_b, config(compose_cfg, tmp_path / "r", world_b, *steps, *layout_b), reference)
    run_dir = tmp_path / "run"
    stopped = train(world_a, config(compose_cfg, tmp_path, world_a, *steps, *layout_a), run_dir, signal_at=2)
    assert all("preempted" in r for r in stopped)  # saved at step 3 in layout A
    train(world_b, config(compose_cfg, tmp_path, world_b, *steps, *layout_b), run_dir)
    a, b = losses_by_step(reference), losses_by_step(run_dir)
    assert list(b) == list(range(1, 7))
    for step in range(4, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a[step], b[step])
    assert consumed_samples(run_dir) == list(range(6 * 8))


def test_staging_reuses_its_buffers_and_copies_in_its_thread_on_one_intra_op_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every save of a tier stages into the same host buffers, the state's values bit for bit as they were when
    the save started, in the staging thread with one intra-op thread (an OpenMP copy stalls at its barriers on
    a busy machine: `docs/checkpoint.md`), the caller's count untouched."""
    during: list[tuple[str, int]] = []
    copy = manager_module._copy_state_dict

    def counting(*args: Any, **kwargs: Any) -> Any:
        during.append((threading.current_thread().name, torch.get_num_threads()))
        return copy(*args, **kwargs)

    monkeypatch.setattr(manager_module, "_copy_state_dict", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage")
    try:
        state = {"model": {"w": torch.randn(64, 32)}, "optim": {"w.exp_avg": torch.randn(64, 32), "w.step": 3}}
        stager = ReusingStager(torch.device("cpu"), copier)
        first = stager.stage(state).result()
        state["model"]["w"].add_(1.0)
        second = stager.stage(state).result()
        assert torch.get_num_threads() == 2
        assert [n for n, _ in during] == ["stage_0"] * 2 and [t for _, t in during] == [1, 1]
    finally:
        torch.set_num_threads(before)
        copier.shutdown()
    assert second["model"]["w"] is first["model"]["w"]  # the same buffer, no allocation
    assert second["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy, not the live tensor
    assert torch.equal(second["model"]["w"], state["model"]["w"]) and second["optim"]["w.step"] == 3


def test_the_optimizer_step_waits_for_a_saves_copy_of_the_state(
    compose_cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's copy runs while the next step computes; its optimizer step waits for it. Made adversarial: the
    copy starts only when the step reaches its optimizer (the engine's before_update) and is slow, so without
    the wait the optimizer would change the parameters under it and the checkpoint would hold step 2's
    weights with step 1's number. The wait is booked as the save's blocked time and as checkpoint time."""
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.records.fingerprint import fingerprint_of

    cfg = compose_cfg(
        *SMALL,
        "cluster.gpus_per_node=1",
        "train.global_batch=2",
        "run.id=fence",
        f"checkpoint.tiers=[{{name: disk, path: {tmp_path}/tier, interval_steps: 1, keep_last: 2}}]",
    )
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    manager = CheckpointManager(
        cfg.checkpoint, 0.0, tmp_path, "fence", 0, 1, fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
    )
    reached_optimizer = threading.Event()
    copy = manager_module._copy_state_dict

    def late_and_slow(*args: Any, **kwargs: Any) -> Any:
        assert reached_optimizer.wait(60), "the step never reached its optimizer with a copy pending"
        time.sleep(0.5)
        return copy(*args, **kwargs)

    def fence() -> None:
        reached_optimizer.set()
        manager.wait_for_staging()

    monkeypatch.setattr(manager_module, "_copy_state_dict", late_and_slow)
    engine.before_update = fence
    data = torch.randint(0, 256, (2, 1, 2, 32))
    engine.step(data, 1e-3)
    reached_optimizer.clear()
    at_step_1 = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    manager.after_step(1, engine, {"consumed_samples": 2}, manager.control_values(time.monotonic()))
    assert not manager.in_flight["disk"].staged.done()  # training goes on while the copy waits
    engine.step(data, 1e-3)
    assert manager.take_staging_wait() >= 0.4 and manager.take_staging_wait() == 0.0
    changed = {k: v for k, v in engine.model.state_dict().items() if not torch.equal(v, at_step_1[k])}
    assert changed  # step 2 moved the weights after the copy
    manager.wait_all()
    saved = model_weights(committed_in(tmp_path / "tier" / "fence")[-1].path)
    assert all(torch.equal(saved[k], at_step_1[k]) for k in at_step_1), "the checkpoint of step 1 holds other weights"
    committed = [e for e in manager.events if e["event"] == "save_committed"][-1]
    assert committed["step"] == 1 and committed["blocked_s"] >= 0.4


def test_a_checkpoint_never_loads_into_other_shapes_even_when_forced(compose_cfg, tmp_path: Path) -> None:
    """Issue 46: model.moe.n_experts 8 -> 4 with checkpoint.force_resume=true kept the first 4 experts (the load
    took any first-dimension change for the vocabulary's padding and copied the leading rows). The fingerprint
    now holds the experts (issue 47), so the manager refuses another count before anything else; and for a
    manifest of an hpctrain that did not record them, it compares every tensor's saved shape with the model's
    before reading a byte: another expert count is refused, naming the weight and both shapes, and the model is
    left as it was. Another vocabulary padding (the one first-dimension change a load may make) still loads."""
    from hpctrain.checkpoint.manager import CheckpointError, CheckpointManager
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine
    from hpctrain.records.fingerprint import EXPERTS, fingerprint_of

    moe = [
        "model.arch=qwen3_moe",
        "model.n_kv_heads=1",
        "model.head_dim=32",
        "model.ffn_hidden=64",
        "model.moe.top_k=2",
    ]

    def start(tier: str, *overrides: str) -> tuple[Any, CheckpointManager]:
        cfg = compose_cfg(
            *SMALL,
            "cluster.gpus_per_node=1",
            "train.global_batch=2",
            "run.id=shape",
            f"checkpoint.tiers=[{{name: disk, path: {tmp_path}/{tier}, interval_steps: 1}}]",
            *overrides,
        )
        return (
            build_engine(cfg, resolve_layout(cfg), torch.device("cpu")),
            CheckpointManager(
                cfg.checkpoint, 0.0, tmp_path, "shape", 0, 1, fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
            ),
        )

    def save(engine: Any, manager: CheckpointManager) -> None:
        engine.step(torch.randint(0, 256, (2, 1, 2, 32), generator=torch.Generator().manual_seed(0)), 1e-3)
        manager.after_step(1, engine, {"consumed_samples": 2}, manager.control_values(time.monotonic()))
        manager.wait_all()

    save(*start("moe", *moe, "model.moe.n_experts=4"))
    engine, manager = start("moe", *moe, "model.moe.n_experts=2", "checkpoint.force_resume=true")
    before = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="cannot be loaded"):  # the fingerprint's n_experts: 4 there, 2 here
        manager.resume(engine)
    for path in (tmp_path / "moe").rglob("manifest.json"):  # as written before the experts were recorded
        manifest = json.loads(path.read_text())
        manifest["fingerprint"]["model"] = {
            k: v for k, v in manifest["fingerprint"]["model"].items() if k not in EXPERTS
        }
        for key in ("crc32c", "manifest_crc32c"):
            manifest.pop(key, None)
        path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as refused:
        manager.resume(engine)
    said = str(refused.value)
    assert "does not fit this model" in said and "is [4, 64, 64] there, [2, 64, 64] here" in said, said
    assert "checkpoint.force_resume does not change that" in said
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # nothing was loaded

    save(*start("pad", "model.vocab_pad_multiple=96"))  # 288 embedding rows, then 256
    padded, manager = start("pad")
    assert manager.resume(padded)["step"] == 1


def test_the_shape_check_lets_an_older_llama_checkpoint_through(old_llama_checkpoint) -> None:
    """The weights a family renamed since a checkpoint was written (Llama's interleaved `mlp.fc.weight`, now
    `mlp.gate` and `mlp.up`) are converted on load: the shape check counts the old tensor as theirs, neither
    missing nor extra."""
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.config.schema import CheckpointConfig
    from hpctrain.records.fingerprint import fingerprint_of
    from tests.checkpoint.test_llama_legacy import _engine as llama_engine

    path, _, _ = old_llama_checkpoint
    cfg, engine = llama_engine(1)
    manager = CheckpointManager(
        CheckpointConfig(enabled=False),
        0.0,
        path.parent,
        "old",
        0,
        1,
        fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict(),
    )
    state = {"train": engine.state_dict()}
    from hpctrain.checkpoint.integrity import read_metadata

    saved = read_metadata(path / ".metadata").state_dict_metadata
    assert "train.model.layers.0.mlp.fc.weight" in saved and "train.model.layers.0.mlp.gate.weight" not in saved
    manager._check_shapes(Committed("old", 2, path, {}), state)  # no CheckpointError


@pytest.fixture(scope="module")
def old_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.checkpoint.test_llama_legacy import old_checkpoint

    return old_checkpoint.__wrapped__(tmp_path_factory)
