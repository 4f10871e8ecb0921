"""Checkpoints that can be trusted: checksums computed as the files are written (checked against the bytes on
disk, not against a switch), damage found by `verify` and on resume, the next newest checkpoint loaded, and a
commit that leaves the old or the new checkpoint, complete, wherever it is killed."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from hpctrain.checkpoint import integrity, storage
from hpctrain.checkpoint.reshard import load_state
from hpctrain.checkpoint.storage import committed_in, partial_dir, step_dir, verify
from tests.checkpoint.test_checkpoint import SMALL, model_weights
from tests.checkpoint.training import consumed_samples, train

TOOL = Path(__file__).resolve().parents[2] / "tools" / "checkpoint.py"
TIER = ["checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 3, keep_last: 3}]"]


def config(compose_cfg, tmp_path: Path, max_steps: int) -> dict[str, Any]:
    cfg = compose_cfg(
        *SMALL, "cluster.gpus_per_node=2", "run.id=test", f"run.root={tmp_path}", f"train.max_steps={max_steps}", *TIER
    )
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def runs(compose_cfg_module, tmp_path_factory) -> dict[str, Any]:
    """A 2-rank run saved at steps 3 and 6, and the weights of the same run trained straight to step 8."""
    base = tmp_path_factory.mktemp("integrity")
    six = base / "six"
    six.mkdir()
    cfg6 = config(compose_cfg_module, base, 6)
    (six / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg6)))
    train(2, cfg6, six)
    straight = base / "straight"
    train(2, config(compose_cfg_module, base, 8), straight)
    return {
        "six": six,
        "cfg8": config(compose_cfg_module, base, 8),
        "reference": model_weights(straight / "checkpoints" / "step_00000008"),
    }


def test_every_file_and_record_of_a_real_two_rank_save_carries_its_checksum(runs) -> None:
    """Fails the day the writer stops computing checksums, whatever a switch says: the manifest and `.metadata`
    of a real run, against the bytes on disk."""
    ckpt = step_dir(runs["six"] / "checkpoints", 6)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == sorted(manifest["crc32c"]) == on_disk
    assert {n.split("_")[2] for n in on_disk if n.endswith(".distcp")} == {"0", "1"}  # both ranks' files
    for name in on_disk:
        data = (ckpt / name).read_bytes()
        assert manifest["files"][name] == len(data)
        assert manifest["crc32c"][name] == f"{crc32c.crc32c(data):08x}", name
    assert integrity.seal_problem(manifest) is None and integrity.SELF in manifest
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    covered: dict[str, list[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        data = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert info.checksum == f"{crc32c.crc32c(data):08x}", index
        covered.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, ranges in covered.items():  # the records tile each file: no byte goes unchecked on load
        ranges.sort()
        assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
        assert ranges[-1][0] + ranges[-1][1] == manifest["files"][name]


def flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def reseal_with(ckpt: Path, change: Callable[[dict[str, Any]], None], seal: bool) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    change(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(integrity.seal(manifest) if seal else manifest))


def _largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {  # what `verify` and the resume say (the reader names
    # the record a flipped bit hit: `test_a_flipped_bit_is_named_by_file_and_tensor`)
    "bit flip in a shard": (lambda c: flip(_largest_shard(c)), "mismatch"),
    "truncated shard": (
        lambda c: os.truncate(_largest_shard(c), _largest_shard(c).stat().st_size // 2),
        "manifest says",
    ),
    "missing shard": (lambda c: _largest_shard(c).unlink(), "missing __"),
    "garbage manifest": (lambda c: (c / "manifest.json").write_bytes(os.urandom(200)), "manifest unreadable"),
    "manifest edited, its checksum not": (
        lambda c: reseal_with(c, lambda m: m.update(consumed_samples=1), seal=False),
        "of its content",
    ),
    "metadata not what the manifest sums": (
        lambda c: reseal_with(c, lambda m: m["crc32c"].update({".metadata": "00000000"}), seal=True),
        ".metadata: crc32c mismatch",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_found_skipped_and_the_run_redoes_its_steps_exactly(
    runs, tmp_path: Path, damage: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["six"], run_dir)
    newest = step_dir(run_dir / "checkpoints", 6)
    harm, said = DAMAGE[damage]
    harm(newest)

    checked = tool("verify", str(run_dir))
    assert checked.returncode == 1 and "step 6" in checked.stdout and said in checked.stdout, checked.stdout
    assert "step 3" in checked.stdout and "ok" in checked.stdout.split("step 3")[1].splitlines()[0]

    train(2, runs["cfg8"], run_dir)  # skips step 6, resumes from step 3, redoes 4-6, goes on to 8
    skipped = [e for e in events(run_dir) if e["event"] == "resume_skip"]
    assert [e["step"] for e in skipped] == [6] and skipped[0]["damaged"] and said in skipped[0]["reason"], skipped
    assert [e["step"] for e in events(run_dir) if e["event"] == "resume"][-1] == 3
    assert consumed_samples(run_dir) == list(range(8 * 8))  # steps 4-6 redone, nothing skipped
    final = model_weights(run_dir / "checkpoints" / "step_00000008")
    assert all(torch.equal(final[k], runs["reference"][k]) for k in runs["reference"])
    after = tool("verify", str(run_dir))  # steps 6 (saved anew) and 8 are sound; the quarantined one is gone
    assert after.returncode == 0 and "step 6" in after.stdout and "corrupt" not in after.stdout, after.stdout


def test_a_quarantined_checkpoint_is_never_tried_again(runs, tmp_path: Path, compose_cfg) -> None:
    """A requeued or resubmitted attempt must not meet the same damage: the first resume moves it aside."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["six"], run_dir)
    _largest_shard(step_dir(run_dir / "checkpoints", 6)).unlink()
    at_three = config(compose_cfg, tmp_path, 3)  # nothing to train past step 3: nothing new is saved
    for attempt in (1, 2):
        (run_dir / "events.jsonl").unlink(missing_ok=True)
        train(2, at_three, run_dir)
        skipped = [e["step"] for e in events(run_dir) if e["event"] == "resume_skip"]
        assert skipped == ([6] if attempt == 1 else []), (attempt, skipped)
        assert (run_dir / "checkpoints" / "step_00000006.corrupt").is_dir()
    listed = tool("list", str(run_dir))
    assert "quarantined" in listed.stdout and "BROKEN" in listed.stdout, listed.stdout


def test_a_flipped_bit_is_named_by_file_and_tensor(runs, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["six"], run_dir)
    ckpt = step_dir(run_dir / "checkpoints", 6)
    shard = _largest_shard(ckpt)
    records = integrity.record_sums(integrity.read_metadata(ckpt / ".metadata"))[shard.name]
    offset, length, _, name = max(records, key=lambda r: r[1])  # the largest tensor of the largest shard
    data = bytearray(shard.read_bytes())
    data[offset + length - 100] ^= 1  # in its data, near the end of its record
    shard.write_bytes(bytes(data))
    checked = tool("verify", str(run_dir), "--step", "6")
    assert checked.returncode == 1, checked.stdout
    assert f"{shard.name}: crc32c mismatch" in checked.stdout and name in checked.stdout, checked.stdout
    hit = [line for line in checked.stdout.splitlines() if "records hit" in line]
    assert hit and hit[0].count("bytes") == 1, hit  # that one record, no other
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.utils import CheckpointException

    from hpctrain.checkpoint.reader import CorruptCheckpoint, FastReader

    with pytest.raises(CheckpointException) as found:  # the same bytes on a resume: the reader names the record
        dcp.load({}, storage_reader=FastReader(str(ckpt)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    ((error, _),) = found.value.failures.values()
    assert isinstance(error, CorruptCheckpoint) and error.file == shard.name
    assert error.records == [name.split("@")[0]], error.records


# ---------------------------------------------------------------- commits killed at every point
def _save(tier: Path, step: int, value: float) -> Path:
    """A real DCP save of a small state into a tier's partial directory, by hpctrain's writer."""
    partial = partial_dir(tier, step)
    writer = integrity.SummingWriter(partial, thread_count=2)
    dcp.save({"w": torch.full((64, 64), value), "b": torch.arange(100) * step}, storage_writer=writer, no_dist=True)
    sums = writer.written()
    return partial, {
        "step": step,
        "files": {n: s for n, (s, _) in sums.items()},
        "crc32c": {n: c for n, (_, c) in sums.items()},
    }


def _save_and_commit(tier: Path, step: int, value: float, kill_after: int | None) -> None:
    partial, manifest = _save(tier, step, value)
    for i, (_, run) in enumerate(storage.commit_steps(partial, step_dir(tier, step), manifest)):
        if i == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        run()


def _in_child(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def _loads(ckpt: storage.Committed) -> float:
    state = {"w": torch.empty(64, 64), "b": torch.empty(100, dtype=torch.int64)}
    load_state(state, str(ckpt.path), None, no_dist=True)
    assert torch.equal(state["b"], torch.arange(100) * ckpt.step)
    return float(state["w"][0, 0])


POINTS = (
    ["in the shard writes"]
    + [f"before: {name}" for name, _ in storage.commit_steps(Path("p"), Path("f"), {})]
    + ["after the last step"]
)


@pytest.mark.parametrize("point", range(len(POINTS)), ids=POINTS)
def test_a_commit_killed_at_any_point_leaves_the_old_or_the_new_checkpoint_complete(tmp_path: Path, point: int) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    partial, manifest = _save(tier, 1, 1.0)
    storage.publish(partial, step_dir(tier, 1), manifest)
    if point == 0:  # killed while DCP writes its files
        status = _in_child(lambda: (_save(tier, 2, 2.0), os.kill(os.getpid(), signal.SIGKILL)))
    else:
        status = _in_child(lambda: _save_and_commit(tier, 2, 2.0, point - 1 if point < len(POINTS) - 1 else None))
    assert os.WIFSIGNALED(status) == (point < len(POINTS) - 1)
    found = committed_in(tier)
    assert [c.step for c in found] == ([1, 2] if point > POINTS.index("before: rename checkpoint directory") else [1])
    for c in found:  # whatever is committed is whole and sound
        assert verify(c) == [] and integrity.check_files(c.path, c.manifest) == []
        assert _loads(c) == float(c.step)
    storage.remove_debris(tier)  # what a restart does
    assert sorted(p.name for p in tier.iterdir()) == [step_dir(tier, c.step).name for c in found]


def test_a_deletion_killed_half_way_never_leaves_a_manifest_beside_missing_files(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    tier.mkdir()
    for step in (1, 2):
        partial, manifest = _save(tier, step, float(step))
        storage.publish(partial, step_dir(tier, step), manifest)

    def killed_in_rmtree() -> None:
        real = shutil.rmtree

        def half(path: Any, *args: Any, **kwargs: Any) -> None:
            next(Path(path).glob("*.distcp")).unlink()  # one file gone, then the node dies
            os.kill(os.getpid(), signal.SIGKILL)

        shutil.rmtree = half
        try:
            storage.retain(tier, keep_last=1)
        finally:
            shutil.rmtree = real

    assert os.WIFSIGNALED(_in_child(killed_in_rmtree))
    assert [c.step for c in committed_in(tier)] == [2]
    assert [p.name for p in storage.remove_debris(tier)] == ["step_00000001.deleting"]


def test_the_commit_fsyncs_each_file_before_its_rename_and_the_directory_after(tmp_path: Path, monkeypatch) -> None:
    """Durability cannot be seen without pulling the power; the order of the calls that make it can."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def name_of(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", name_of(fd))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("rename", str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", str(b))), real_rename(a, b))[1])
    tier = tmp_path / "tier"
    partial, manifest = _save(tier, 1, 1.0)
    shards = {str(p) + (".tmp" if p.name == ".metadata" else "") for p in partial.iterdir()}
    assert shards <= {name for op, name in calls if op == "fsync"}  # DCP fsyncs every file it writes (.metadata
    # under its temporary name, then renames it)
    calls.clear()
    storage.publish(partial, step_dir(tier, 1), manifest)
    final = str(step_dir(tier, 1))
    assert [op for op, _ in calls] == ["fsync", "rename", "fsync", "rename", "fsync"], calls
    assert calls[0][1].startswith(str(partial / ".manifest.json"))  # the manifest's data, under its temporary name
    assert calls[1] == ("rename", str(partial / "manifest.json"))
    assert calls[2] == ("fsync", str(partial))  # the entries: shards, .metadata, manifest
    assert calls[3] == ("rename", final)
    assert calls[4] == ("fsync", str(tier))  # the rename itself


def test_a_one_thread_save_never_syncs_cuda_streams_on_the_save_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one write thread and a GPU, DCP's overlapping loader syncs CUDA streams on the save thread, whose
    current device is GPU 0: a stray context there from every rank. hpctrain's state is staged in host memory
    already, so its writer copies nothing ahead and DCP takes the serial loader."""
    from torch.distributed.checkpoint import filesystem

    def overlapping(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("DCP's overlapping loader (CUDA stream syncs on the save thread)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what DCP asks before it picks the loader
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", overlapping)
    dcp.save(
        {"w": torch.arange(8.0)},
        storage_writer=integrity.SummingWriter(tmp_path / "ckpt", thread_count=1),
        no_dist=True,
    )
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(8.0))
