"""A checkpoint cannot run code (issue 29): nothing hpctrain reads from a checkpoint is unpickled without a
restriction. A crafted `.metadata` or byte record (its checksums updated, the manifest resealed with hpctrain's own
functions as an attacker could, or left without a seal, which is trusted) must not run its payload on a resume,
on `tools/checkpoint.py export` or on `verify`: the load fails naming the file and what the pickle asked for.
And the metadata of every layout hpctrain saves still loads, through exactly the allow-list."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from hpctrain.checkpoint import integrity, storage
from hpctrain.checkpoint.inspect import consolidated_model, find
from hpctrain.checkpoint.integrity import METADATA_CLASSES, TORCH_DTYPES, UnsafeCheckpoint, read_metadata
from hpctrain.checkpoint.reader import FastReader
from hpctrain.checkpoint.storage import step_dir
from hpctrain.records.failures import read_failures
from tests.checkpoint.test_checkpoint import SMALL
from tests.checkpoint.training import train
from tests.distributed_harness import DistributedTestError

TOOL = Path(__file__).resolve().parents[2] / "tools" / "checkpoint.py"
TIER = ["checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 3, keep_last: 3}]"]
# FSDP2's DTensor shards (ZeRO-3) and fp16, whose loss scaler DCP saves as byte records (non-tensor values)
FP16_ZERO3 = ["zero=stage3", "precision=fp16"]


def config(compose_cfg, root: Path, max_steps: int, *overrides: str) -> dict[str, Any]:
    cfg = compose_cfg(
        *SMALL,
        "cluster.gpus_per_node=2",
        "run.id=test",
        f"run.root={root}",
        f"train.max_steps={max_steps}",
        *TIER,
        *overrides,
    )
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def trained(compose_cfg, root: Path, *overrides: str) -> Path:
    """A real 2-rank run saved at step 3, with its config.yaml (for the tool)."""
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    cfg = config(compose_cfg, root, 3, *overrides)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    train(2, cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def run(compose_cfg_module, tmp_path_factory) -> Path:
    return trained(compose_cfg_module, tmp_path_factory.mktemp("pickle_safety"), *FP16_ZERO3)


def tool(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        capture_output=True,
        text=True,
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )


class Payload:
    """What an attacker pickles: unpickling it runs a shell command (here: creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def _legit_metadata(ckpt: Path) -> Any:
    with open(ckpt / ".metadata", "rb") as f:  # the test's own save, just written: plain pickle is fine here
        return pickle.load(f)


def _reseal(ckpt: Path, changed: list[str], seal: bool) -> None:
    """Update the manifest's sizes and CRC32Cs of the changed files, and seal it with hpctrain's own function
    (as an attacker could), or drop the seal (a manifest without one is trusted, as older versions wrote)."""
    manifest = json.loads((ckpt / storage.MANIFEST).read_text())
    for name in changed:
        data = (ckpt / name).read_bytes()
        manifest["files"][name] = len(data)
        manifest[integrity.ALGORITHM][name] = integrity.hexdigest(crc32c.crc32c(data))
    if seal:
        storage.write_manifest(ckpt, manifest)
    else:
        manifest.pop(integrity.SELF, None)
        (ckpt / storage.MANIFEST).write_text(json.dumps(manifest))
    assert integrity.check_files(ckpt, json.loads((ckpt / storage.MANIFEST).read_text())) == []  # sums all match


def craft_metadata(ckpt: Path, marker: Path, seal: bool = True) -> None:
    """`.metadata` with a payload in a harmless place: once run, the load would go on and succeed."""
    metadata = _legit_metadata(ckpt)
    metadata.storage_meta.save_id = Payload(marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(ckpt, [".metadata"], seal)


def craft_byte_record(ckpt: Path, marker: Path, fqn: str = "train.loss_scaler.scale") -> str:
    """The loss scaler's byte record replaced by a payload (appended to its file, `.metadata` pointing at it
    with the right CRC32C): DCP's planner would torch.load it with weights_only=False. Returns the file."""
    metadata = _legit_metadata(ckpt)
    assert isinstance(metadata.state_dict_metadata[fqn], BytesStorageMetadata)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    name = metadata.storage_data[index].relative_path
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    payload = buffer.getvalue()
    offset = (ckpt / name).stat().st_size
    with open(ckpt / name, "ab") as f:
        f.write(payload)
    info = _StorageInfo(name, offset, len(payload))
    info.checksum = integrity.hexdigest(crc32c.crc32c(payload))
    metadata.storage_data[index] = info
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(ckpt, [".metadata", name], seal=True)
    return name


def copy_of(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    return run_dir, step_dir(run_dir / "checkpoints", 3)


# ---------------------------------------------------------------- the payload never runs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seal", [True, False], ids=["manifest resealed", "manifest without a seal"])
def test_a_crafted_metadata_does_not_run_on_resume(run, tmp_path: Path, compose_cfg, seal: bool) -> None:
    run_dir, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt, marker, seal)
    with pytest.raises(DistributedTestError) as failed:  # through the checkpoint manager's resume, on 2 ranks
        train(2, config(compose_cfg, tmp_path, 6, *FP16_ZERO3), run_dir)
    assert not marker.exists()
    said = f"{ckpt / '.metadata'}: refused to load: its pickle asks for posix.system"
    assert said in str(failed.value) and "UnsafeCheckpoint" in str(failed.value), str(failed.value)[-3000:]
    records = read_failures(run_dir, "test")
    assert records and all(said in r["message"] and r["type"] == "UnsafeCheckpoint" for r in records), records
    assert ckpt.is_dir() and not (run_dir / "checkpoints" / "step_00000006").exists()  # nothing trained on


@pytest.mark.timeout(300)
def test_a_crafted_byte_record_does_not_run_on_resume(run, tmp_path: Path, compose_cfg) -> None:
    run_dir, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    name = craft_byte_record(ckpt, marker)
    read_metadata(ckpt / ".metadata")  # the metadata itself is sound: the record is what is crafted
    with pytest.raises(DistributedTestError) as failed:
        train(2, config(compose_cfg, tmp_path, 6, *FP16_ZERO3), run_dir)
    assert not marker.exists()
    said = f"{ckpt / name}: refused to load: its record train.loss_scaler.scale"
    assert said in str(failed.value) and "asks for posix.system" in str(failed.value), str(failed.value)[-3000:]
    assert all(said in r["message"] for r in read_failures(run_dir, "test"))


@pytest.mark.parametrize("fmt", ["torch", "hf"])
def test_a_crafted_metadata_does_not_run_on_export(run, tmp_path: Path, fmt: str) -> None:
    run_dir, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt, marker)
    out = tmp_path / "out" / ("model.pt" if fmt == "torch" else "hf")
    exported = tool("export", str(run_dir), str(out), "--format", fmt)
    assert not marker.exists()
    assert exported.returncode == 2, exported.stderr
    assert f"{ckpt / '.metadata'}: refused to load: its pickle asks for posix.system" in exported.stderr, (
        exported.stderr
    )
    assert "Traceback" not in exported.stderr and not out.exists()


@pytest.mark.parametrize("damaged", [True, False], ids=["damaged shard", "sound shards"])
def test_a_crafted_metadata_does_not_run_on_verify(run, tmp_path: Path, damaged: bool) -> None:
    """`verify` unpickles `.metadata` to name the records a damaged file holds; a crafted one is reported (also
    when every sum matches: the resume would refuse it), never run."""
    run_dir, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt, marker)
    if damaged:
        shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    checked = tool("verify", str(run_dir))
    assert not marker.exists()
    assert checked.returncode == 1 and "BROKEN" in checked.stdout, checked.stdout + checked.stderr
    assert ".metadata: refused to load: its pickle asks for posix.system" in checked.stdout, checked.stdout
    assert ("crc32c mismatch" in checked.stdout) == damaged, checked.stdout


def test_the_reader_names_the_file_and_the_class_and_dcp_never_unpickles_it(run, tmp_path: Path) -> None:
    run_dir, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    craft_metadata(ckpt, marker)
    for read in (
        lambda: read_metadata(ckpt / ".metadata"),
        lambda: FastReader(str(ckpt)).read_metadata(),
        lambda: consolidated_model(find(run_dir)),
    ):
        with pytest.raises(UnsafeCheckpoint) as refused:
            read()
        assert refused.value.file == str(ckpt / ".metadata") and refused.value.forbidden == "posix.system"
    assert not marker.exists()
    # Anything but DCP's Metadata, or a record outside the checkpoint's directory, is refused too.
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(UnsafeCheckpoint, match="a dict where DCP writes its Metadata"):
        read_metadata(ckpt / ".metadata")
    metadata = _legit_metadata(step_dir(run / "checkpoints", 3))
    next(iter(metadata.storage_data.values())).relative_path = "../../elsewhere.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match="not a file of the checkpoint's own directory"):
        read_metadata(ckpt / ".metadata")


@pytest.mark.parametrize("verify", [True, False], ids=["checked", "unchecked"])
def test_dcp_never_unpickles_a_byte_record_without_the_restriction(run, tmp_path: Path, verify: bool) -> None:
    """DCP's planner loads byte records with torch.load(weights_only=False); through `FastReader` it is given
    only what torch.load(weights_only=True) built. A record whose bytes match their checksum and ask for a
    forbidden global is crafted (`UnsafeCheckpoint`); one that could not be checked may be damaged (a flipped
    bit in a class name): refused as unreadable. Neither runs."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.utils import CheckpointException

    from hpctrain.checkpoint.reader import CorruptCheckpoint

    _, ckpt = copy_of(run, tmp_path)
    marker = tmp_path / "pwned"
    name = craft_byte_record(ckpt, marker)
    with pytest.raises(CheckpointException) as failed:
        load(
            {}, storage_reader=FastReader(str(ckpt), verify=verify), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    assert not marker.exists()
    ((error, _),) = failed.value.failures.values()
    if verify:
        assert isinstance(error, UnsafeCheckpoint) and error.file == str(ckpt / name), error
        assert error.forbidden == "posix.system"
    else:
        assert isinstance(error, CorruptCheckpoint) and error.records == ["train.loss_scaler.scale"], error
        assert "posix.system" in str(error) and "weights_only=False" not in str(error), error


# ---------------------------------------------------------------- what hpctrain writes still loads
class _Recording(pickle.Unpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.found: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.found.add((module, name))
        return super().find_class(module, name)


LAYOUTS = {  # beside the module's run (FSDP2 DTensor shards, fp16 with its loss scaler's byte records)
    "tp2": ["parallel.tp=2"],  # DTensor shards over the TP mesh
    "pp2": ["parallel.pp=2"],  # pipeline stages
    "zero1-ddp": ["zero=stage1"],  # plain tensors, ZeRO-1's optimizer state
    "cpu-offload": ["zero=stage3_offload"],  # parameters and optimizer state in host memory
    "nvme": ["zero=stage3_nvme", "zero.nvme_path={tmp}/nvme"],  # Adam's moments streamed from NVMe files
}


@pytest.mark.timeout(600)
def test_the_metadata_of_every_layout_loads_through_exactly_the_allow_list(run, compose_cfg, tmp_path: Path) -> None:
    found: set[tuple[str, str]] = set()
    runs = {"fp16-zero3": run}
    for name, overrides in LAYOUTS.items():
        runs[name] = trained(compose_cfg, tmp_path / name, *(o.format(tmp=tmp_path) for o in overrides))
    for name, run_dir in runs.items():
        ckpt = step_dir(run_dir / "checkpoints", 3)
        with open(ckpt / ".metadata", "rb") as f:
            recording = _Recording(f)
            expected = recording.load()
        found |= recording.found
        assert read_metadata(ckpt / ".metadata") == expected, name
        loaded = FastReader(str(ckpt)).read_metadata()
        assert loaded.state_dict_metadata == expected.state_dict_metadata, name
        assert loaded.storage_data == expected.storage_data, name
        assert consolidated_model(find(run_dir)), name  # DCP's load of the weights, through the same reader
    dtypes = {(m, n) for m, n in found if m == "torch" and n in TORCH_DTYPES}
    assert found - dtypes == METADATA_CLASSES  # every entry is needed by some layout, and nothing else is
    assert dtypes and all(isinstance(getattr(torch, n), torch.dtype) for _, n in dtypes)


@pytest.mark.timeout(300)
def test_the_real_run_resumes_through_the_restricted_reader(run, tmp_path: Path, compose_cfg) -> None:
    """The module's run (fp16 byte records, DTensor shards) resumes through the restricted reader, the loss
    scaler's state with it."""
    run_dir, _ = copy_of(run, tmp_path)
    train(2, config(compose_cfg, tmp_path, 4, *FP16_ZERO3), run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [3]


# ---------------------------------------------------------------- exported files are ordinary files
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_weights_get_the_mode_of_a_normal_file(run, tmp_path: Path, umask: int) -> None:
    """safetensors' save_file creates its files 0600; an export is for others to read: 0666 less the umask."""
    out = tmp_path / "hf"
    assert tool("export", str(run), str(out), "--format", "hf", umask=umask).returncode == 0
    assert tool("export", str(run), str(tmp_path / "pt" / "model.pt"), umask=umask).returncode == 0
    files = [*out.iterdir(), *(tmp_path / "pt").iterdir()]
    assert any(f.suffix == ".safetensors" for f in out.iterdir()) and (tmp_path / "pt" / "model.safetensors").exists()
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
