"""A run's checkpoints are its own (issue 46): a run whose `checkpoints/` was a link to another run's resumed that
run's checkpoint, saved into its directory and let retention delete its steps. Now the login node refuses such a
tier (`checkpoint.tiers[i].path`, exit 2, nothing submitted), and the job's checkpoint manager refuses to load, save
or delete through a link out of the run's own directory, and to load a checkpoint another run wrote.

The acceptance test runs the real command line (two tiny runs and a continuation); the manager's refusals are
tested in process on the checkpoint suite's small model."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint.storage import MANIFEST, committed_in, retain, step_dir
from hpctrain.records.paths import RunPaths
from tests.checkpoint.test_checkpoint import SMALL
from tests.conftest import run_hpctrain


def tree_sums(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (links not followed), by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------- the real command line
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_linked_to_another_runs_checkpoints_is_refused_and_leaves_them_untouched(tmp_path: Path) -> None:
    """Run A (6 steps, a checkpoint every 2, keep 2) and run B (4 steps) of the default tiny config; B's
    checkpoints/ replaced by a link to A's. Resuming B is refused on the login node, naming the link and the key,
    and every file of A is the same after as before (same list, same sha256). Then the finished run A: a resume of
    it as it is submits nothing (exit 0, no new file), one that raises train.max_steps trains on."""
    common = [f"run.root={tmp_path}", "checkpoint.tiers.0.interval_steps=2", "checkpoint.tiers.0.keep_last=2"]
    started = time.monotonic()
    first = run_hpctrain(*common, "run.id=A", "train.max_steps=6", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    second = run_hpctrain(*common, "run.id=B", "train.max_steps=4", cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    run_a, run_b = tmp_path / "smoke" / "A", tmp_path / "smoke" / "B"
    assert [c.step for c in committed_in(run_a / "checkpoints")] == [4, 6]

    shutil.rmtree(run_b / "checkpoints")
    (run_b / "checkpoints").symlink_to(run_a / "checkpoints")
    before_a, before_b = tree_sums(run_a), tree_sums(run_b)
    resumed = run_hpctrain(f"run.root={tmp_path}", "run.resume=B", "train.max_steps=10", cwd=tmp_path)
    no_traceback(resumed)
    assert resumed.returncode == 2, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    line = next(x for x in resumed.stderr.splitlines() if x.startswith("  - checkpoint.tiers[0].path:"))
    assert f"{run_b / 'checkpoints'} is a symbolic link to {run_a / 'checkpoints'}" in line, line
    assert "nothing was submitted" in resumed.stderr and "    fix: remove the link" in resumed.stderr
    assert tree_sums(run_a) == before_a  # the same files, the same bytes: nothing loaded into, saved or deleted
    assert tree_sums(run_b) == before_b  # and nothing written in B (no job, no event)

    done = run_hpctrain(f"run.root={tmp_path}", "run.resume=A", cwd=tmp_path)
    no_traceback(done)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "run A is complete at step 6 (train.max_steps=6); nothing was submitted" in done.stdout, done.stdout
    assert "raise train.max_steps" in done.stdout
    assert tree_sums(run_a) == before_a  # no job, no event, no new config

    more = run_hpctrain(f"run.root={tmp_path}", "run.resume=A", "train.max_steps=8", cwd=tmp_path)
    no_traceback(more)
    assert more.returncode == 0, more.stdout[-2000:] + more.stderr[-3000:]
    assert "resuming at step 6" in more.stdout
    assert [json.loads(x)["step"] for x in RunPaths(run_a).metrics.read_text().splitlines()][-1] == 8
    print(f"three real runs and two refusals in {time.monotonic() - started:.1f} s")


# ---------------------------------------------------------------- the checkpoint manager, in process
def small(compose_cfg, run_id: str, *overrides: str) -> Any:
    return compose_cfg(
        *SMALL,
        "cluster.gpus_per_node=1",
        "train.global_batch=2",
        f"run.id={run_id}",
        "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 1, keep_last: 1}]",
        *overrides,
    )


def manager_of(cfg: Any, run_dir: Path) -> Any:
    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.records.fingerprint import fingerprint_of

    return CheckpointManager(
        cfg.checkpoint, 0.0, run_dir, str(cfg.run.id), 0, 1, fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()
    )


def engine_of(cfg: Any) -> Any:
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine

    return build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))


def saved_run(cfg: Any, run_dir: Path, steps: int = 2) -> Any:
    """A run directory whose tier holds the checkpoints of `steps` steps of `cfg` (keep_last 1: the last one)."""
    engine, manager = engine_of(cfg), manager_of(cfg, run_dir)
    for step in range(1, steps + 1):
        engine.step(torch.randint(0, 256, (2, 1, 2, 32), generator=torch.Generator().manual_seed(step)), 1e-3)
        manager.after_step(step, engine, {"consumed_samples": 2 * step}, manager.control_values(time.monotonic()))
    manager.wait_all()
    return engine


@pytest.fixture(scope="module")
def run_a(compose_cfg_module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run A's directory with its checkpoint of step 2 (made once; each test copies or links it, never writes)."""
    run_dir = tmp_path_factory.mktemp("runs") / "A"
    saved_run(small(compose_cfg_module, "A"), run_dir)
    assert [c.step for c in committed_in(run_dir / "checkpoints")] == [2]
    return run_dir


def test_the_manager_refuses_a_tier_linked_to_another_runs(run_a: Path, compose_cfg, tmp_path: Path) -> None:
    from hpctrain.checkpoint.manager import CheckpointError

    before = tree_sums(run_a)
    run_b = tmp_path / "B"
    run_b.mkdir()
    (run_b / "checkpoints").symlink_to(run_a / "checkpoints")
    with pytest.raises(CheckpointError) as refused:
        manager_of(small(compose_cfg, "B"), run_b)
    said = str(refused.value)
    assert f"{run_b / 'checkpoints'} is a symbolic link to {run_a / 'checkpoints'}" in said, said
    assert "run B loads, saves and deletes only checkpoints of its own" in said and "Remove the link" in said
    assert tree_sums(run_a) == before


def test_the_manager_refuses_a_checkpoint_linked_in_from_another_run(run_a: Path, compose_cfg, tmp_path: Path) -> None:
    from hpctrain.checkpoint.manager import CheckpointError

    before = tree_sums(run_a)
    run_b = tmp_path / "B"
    (run_b / "checkpoints").mkdir(parents=True)
    (run_b / "checkpoints" / "step_00000002").symlink_to(step_dir(run_a / "checkpoints", 2))
    assert committed_in(run_b / "checkpoints") == []  # not a checkpoint of B's tier
    with pytest.raises(CheckpointError, match="step_00000002 is a symbolic link to"):
        manager_of(small(compose_cfg, "B"), run_b)
    assert retain(run_b / "checkpoints", 0) == [] and (run_b / "checkpoints" / "step_00000002").is_symlink()
    assert tree_sums(run_a) == before  # retention passed the link by: A's step is whole


def test_a_link_made_while_the_run_trains_is_refused_at_its_next_save(run_a: Path, compose_cfg, tmp_path: Path) -> None:
    """The checks at start-up are not all: each save and each retention asks again, so a tier swapped for a link
    later is never written into nor pruned."""
    from hpctrain.checkpoint.manager import CheckpointError

    before = tree_sums(run_a)
    run_b = tmp_path / "B"
    cfg = small(compose_cfg, "B")
    engine, manager = engine_of(cfg), manager_of(cfg, run_b)
    shutil.rmtree(run_b / "checkpoints")
    (run_b / "checkpoints").symlink_to(run_a / "checkpoints")
    with pytest.raises(CheckpointError, match="so it does not save there"):
        manager.save_now(3, engine, {"consumed_samples": 6})
    with pytest.raises(CheckpointError, match="so it does not delete there"):
        manager._retain(manager.tiers[0])
    assert tree_sums(run_a) == before


def test_the_manager_refuses_a_checkpoint_of_another_run_id(run_a: Path, compose_cfg, tmp_path: Path) -> None:
    """A copy (no link) of A's checkpoint in B's tier: its manifest names run A, so B does not resume from it."""
    from hpctrain.checkpoint.manager import CheckpointError

    run_b = tmp_path / "B"
    shutil.copytree(run_a / "checkpoints", run_b / "checkpoints")
    cfg = small(compose_cfg, "B")
    manager = manager_of(cfg, run_b)
    with pytest.raises(CheckpointError) as refused:
        manager.resume(engine_of(cfg))
    said = str(refused.value)
    assert "belongs to run A (its manifest), not to this run B" in said and "Nothing was loaded" in said, said
    assert not [e for e in manager.events if e["event"] == "resume"]


def test_a_checkpoint_from_before_manifests_named_their_run_still_resumes(
    run_a: Path, compose_cfg, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hpctrain.checkpoint.integrity import seal

    run_dir = tmp_path / "A"
    shutil.copytree(run_a, run_dir)
    manifest_path = step_dir(run_dir / "checkpoints", 2) / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["run_id"], manifest["manifest_crc32c"]
    manifest_path.write_text(json.dumps(seal(manifest)))
    cfg = small(compose_cfg, "A")
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint.manager"):
        assert manager_of(cfg, run_dir).resume(engine_of(cfg))["step"] == 2
    assert "names no run (written before manifests did)" in caplog.text


def test_an_absolute_tier_is_the_runs_own_subdirectory(compose_cfg, tmp_path: Path) -> None:
    """An absolute tier (node-local RAM or SSD) holds `<path>/<run id>`: that subdirectory may not be a link to
    another run's; the mount above it may be a link (a scratch file system often is)."""
    from hpctrain.checkpoint.manager import CheckpointError

    real = tmp_path / "real_scratch"
    (real / "A").mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(real)
    tier = f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/scratch, interval_steps: 1}}]"
    cfg = small(compose_cfg, "B", tier)
    manager_of(cfg, tmp_path / "runB")  # scratch -> real_scratch: fine, B's own subdirectory is made there
    assert (real / "B").is_dir() and not (real / "B").is_symlink()
    shutil.rmtree(real / "B")
    (real / "B").symlink_to(real / "A")
    with pytest.raises(CheckpointError, match=f"{tmp_path}/scratch/B is a symbolic link to {real / 'A'}"):
        manager_of(cfg, tmp_path / "runB")


def test_a_file_linked_out_of_a_checkpoint_makes_it_unusable(run_a: Path, tmp_path: Path) -> None:
    from hpctrain.checkpoint.storage import verify

    run_dir = tmp_path / "A"
    shutil.copytree(run_a, run_dir)
    ckpt = committed_in(run_dir / "checkpoints")[-1]
    shard = next(ckpt.path.glob("*.distcp"))
    elsewhere = tmp_path / "elsewhere.distcp"
    shutil.move(shard, elsewhere)
    os.symlink(elsewhere, shard)
    assert any(f"{shard.name} leads out of the checkpoint" in p for p in verify(ckpt)), verify(ckpt)
