"""Issue 46: `tools/checkpoint.py` on damaged run directories and checkpoints, and exporting to a full disk: a
message naming the file (or the file system) and what is wrong, a non-zero exit, nothing partial left behind,
never a traceback."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.checkpoint.test_checkpoint import config
from tests.checkpoint.training import train

TOOL = Path(__file__).resolve().parents[2] / "tools" / "checkpoint.py"
STEP = "checkpoints/step_00000002"


def _tool_module() -> Any:
    spec = importlib.util.spec_from_file_location("checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(compose_cfg_module, tmp_path_factory) -> Path:
    """A one-rank run of 2 steps with one committed checkpoint (step 2, in the run directory)."""
    base = tmp_path_factory.mktemp("damage")
    cfg = config(
        compose_cfg_module,
        base,
        1,
        "train.max_steps=2",
        "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 2, keep_last: 1}]",
    )
    run_dir = base / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    train(1, cfg, run_dir)
    assert (run_dir / STEP / "manifest.json").is_file()
    return run_dir


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run, for a test to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def tool(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=300, check=False, **kwargs
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return proc


def in_process(*args: Any) -> tuple[int, str]:
    """The tool's main, here (torch imported once for all the cases): exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = _tool_module().main([str(a) for a in args])
    return code, err.getvalue()


# ---------------------------------------------------------------- a damaged checkpoint


def test_an_empty_metadata_is_named(run: Path, tmp_path: Path) -> None:
    (run / STEP / ".metadata").write_bytes(b"")
    proc = tool("export", run, tmp_path / "out.pt")
    assert proc.returncode == 1, proc.stderr
    assert f"{run / STEP}" in proc.stderr and ".metadata: 0 bytes, manifest says" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("fmt", ["torch", "hf"])
def test_a_garbage_metadata_is_named(run: Path, tmp_path: Path, fmt: str) -> None:
    """The same size as the manifest says (a structural check passes): its unpickling fails, and says so."""
    metadata = run / STEP / ".metadata"
    metadata.write_bytes(os.urandom(metadata.stat().st_size))
    code, said = in_process("export", run, tmp_path / "out", "--format", fmt)
    assert code == 1 and f"checkpoint: {metadata} (" in said and "is not DCP metadata" in said, said
    assert not list(tmp_path.glob("out*"))


def test_a_shard_cut_short_is_named(run: Path, tmp_path: Path) -> None:
    shard = next((run / STEP).glob("*.distcp"))
    os.truncate(shard, 1000)
    code, said = in_process("export", run, tmp_path / "out.pt")
    assert code == 1 and f"{shard.name}: 1000 bytes, manifest says" in said, said


@pytest.mark.parametrize("case", ["missing", "a file", "no config", "binary config", "not a run config"])
def test_what_is_not_a_run_directory(run: Path, tmp_path: Path, case: str) -> None:
    target = {"missing": tmp_path / "nope", "a file": run / "config.yaml", "no config": run / "checkpoints"}.get(
        case, run
    )
    if case == "binary config":
        (run / "config.yaml").write_bytes(b"\x00\xff\xfe")
    if case == "not a run config":
        (run / "config.yaml").write_text("a: 1\n")
    words = {
        "missing": "does not exist",
        "a file": "is not a directory",
        "no config": "has no config.yaml",
        "binary config": "is not a text file",
        "not a run config": "is not an hpctrain run config",
    }[case]
    for command in (["export", target, tmp_path / "out.pt"], ["list", target], ["verify", target]):
        code, said = in_process(*command)
        assert code == 2 and said.startswith("checkpoint: ") and words in said, (command, said)


def test_where_an_export_cannot_go(run: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    code, said = in_process("export", run, tmp_path / "a-file" / "out.pt")
    assert code == 1 and f"{tmp_path / 'a-file'} is a file, not a directory" in said, said
    code, said = in_process("export", run, tmp_path / "a-dir")
    assert code == 1 and "is a directory: give the export a file name" in said, said
    code, said = in_process("export", run, tmp_path / "a-file", "--format", "hf")
    assert code == 1 and "is a file: an HF export is a directory" in said, said


# ---------------------------------------------------------------- a full disk


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[str]:
    """A 256 KiB tmpfs at `where` (root, and mount allowed): writes fail with ENOSPC. Yields "tmpfs"; "fsize"
    where no tmpfs can be mounted but a file size limit can be set (writes fail with EFBIG); skips otherwise."""
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and shutil.which("mount")
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True, check=False
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", str(where)], capture_output=True, check=False)
        return
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256 * 1024:
        pytest.skip("neither a tmpfs nor a file size limit can make a small disk here")
    yield "fsize"


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.parametrize("fmt", ["torch", "hf"])
def test_an_export_to_a_full_disk(run: Path, tmp_path: Path, fmt: str) -> None:
    disk = tmp_path / "disk"
    with small_disk(disk) as kind:
        out = disk / "export" / ("model.pt" if fmt == "torch" else "hf")
        proc = tool("export", run, out, "--format", fmt, preexec_fn=_limit_file_size if kind == "fsize" else None)
        assert proc.returncode == 1, proc.stderr
        assert f"checkpoint: writing {out} failed: " in proc.stderr, proc.stderr
        if kind == "tmpfs":
            assert f"the disk is full on the file system of {disk}: " in proc.stderr, proc.stderr
            assert "free of 256.0 KiB, the export needs about" in proc.stderr
        else:
            assert "a file is larger than this process may write: ulimit -f allows 256.0 KiB" in proc.stderr
        assert "the partial export was removed" in proc.stderr
        assert list(disk.iterdir()) == []  # not even the directory it created
