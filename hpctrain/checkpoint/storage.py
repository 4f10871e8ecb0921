"""Where checkpoints live on disk, and what makes one complete and durable.

A tier directory holds `step_<N>/` directories. A save writes into `step_<N>.partial/` (DCP fsyncs every file it
writes); it is published by the steps of `commit_steps`: the manifest (step, parallel layout, world size, every file
with its size and CRC32C, sealed with a CRC32C of its own) is written to a temporary name and fsynced, renamed into
place, the directory fsynced (its entries: the shards, `.metadata`, the manifest), renamed to `step_<N>/`, and
the tier directory fsynced (the rename). Without the fsyncs a node that crashes or loses power right after a
commit can come back with a `step_<N>/` whose manifest or files never reached the disk. A crash between any two
steps leaves the previous checkpoint and either debris or the new checkpoint, complete (`test_integrity.py`
kills a save at each point).

So `step_<N>/manifest.json` exists only for complete checkpoints; anything named `.partial` (a save killed half
way) or `.deleting` (retention killed half way) is debris, removed at start-up; `.corrupt` is a checkpoint a
resume found damaged, kept for inspection and never loaded again.

Nothing here reads, writes or deletes through a symbolic link that leads out of a tier directory (issue 46): a
`step_<N>` linked to another run's checkpoint is not a checkpoint of this tier, retention and the removal of
debris pass it by, and a file of a checkpoint linked out of it makes the checkpoint unusable. The tier directory
itself is held to its run by the manager (`hpctrain.records.paths.tier_directory`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.integrity import METADATA, seal, seal_problem
from hpctrain.durable import fsync_dir
from hpctrain.records.paths import escape, escaping_entries, tier_directory, within

MANIFEST = "manifest.json"
PREFIX = "step_"
PARTIAL = ".partial"
DELETING = ".deleting"
CORRUPT = ".corrupt"
DEBRIS = (PARTIAL, DELETING)


@dataclass(frozen=True)
class Committed:
    tier: str
    step: int
    path: Path
    manifest: dict[str, Any]


def step_dir(tier_path: Path, step: int) -> Path:
    return tier_path / f"{PREFIX}{step:08d}"


def partial_dir(tier_path: Path, step: int) -> Path:
    return tier_path / f"{PREFIX}{step:08d}{PARTIAL}"


def tier_path(path: str, run_dir: Path, run_id: str) -> Path:
    """Relative tier paths live in the run directory; absolute ones (RAM, local SSD) get the run id appended."""
    return tier_directory(path, run_dir, run_id)[0]


def _inside(sub: Path) -> bool:
    """Whether a tier directory's entry stays in it (a link to another run's checkpoint does not)."""
    return not sub.is_symlink() or within(sub, Path(os.path.realpath(sub.parent)))


def linked_out(directory: Path) -> list[tuple[Path, str]]:
    """The `step_*` entries of a tier directory that are links leading out of it, with why: never loaded, never
    written through, never deleted (a run's checkpoints are its own)."""
    return escaping_entries(directory, PREFIX)


def step_of(path: Path) -> int:
    """The step a checkpoint directory holds, whatever its state (committed, partial, deleting, corrupt)."""
    return int(path.name[len(PREFIX) :].split(".")[0])


def _step_dirs(directory: Path) -> Iterator[Path]:
    if directory.is_dir():
        yield from (
            sub
            for sub in directory.iterdir()
            if sub.name.startswith(PREFIX)
            and sub.name[len(PREFIX) :].isdigit()
            and _inside(sub)
            and (sub / MANIFEST).is_file()
        )


def read_manifest(sub: Path) -> tuple[dict[str, Any] | None, str]:
    """A checkpoint directory's manifest, or None and why it cannot be trusted (unreadable, not JSON, no step,
    or its seal does not match its content)."""
    try:
        meta = json.loads((sub / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"manifest unreadable: {err}"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or not isinstance(meta.get("files"), dict):
        return None, "manifest has no step or file list"
    problem = seal_problem(meta)
    return (None, problem) if problem else (meta, "")


def committed_in(directory: Path, tier: str = "") -> list[Committed]:
    """Complete checkpoints in a tier directory, oldest first (a manifest that cannot be trusted: see `broken_in`)."""
    found = []
    for sub in _step_dirs(directory):
        meta, _ = read_manifest(sub)
        if meta is not None:
            found.append(Committed(tier=tier, step=meta["step"], path=sub, manifest=meta))
    return sorted(found, key=lambda c: c.step)


def broken_in(directory: Path) -> list[tuple[Path, str]]:
    """Checkpoint directories whose manifest exists but cannot be trusted, with the reason."""
    return sorted((sub, why) for sub in _step_dirs(directory) for meta, why in [read_manifest(sub)] if meta is None)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _manifest_steps(directory: Path, manifest: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """A manifest written atomically and durably: to a temporary name, fsynced, renamed, the directory fsynced."""
    tmp = directory / f".{MANIFEST}.{os.getpid()}"
    return [
        ("write manifest", lambda: _write_durably(tmp, json.dumps(seal(manifest), indent=1))),
        ("rename manifest", lambda: os.replace(tmp, directory / MANIFEST)),
        ("fsync checkpoint directory", lambda: fsync_dir(directory)),
    ]


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Atomically and durably: a reader sees no manifest or a whole one, and a whole one is on the disk."""
    for _, step in _manifest_steps(directory, manifest):
        step()


def commit_steps(partial: Path, final: Path, manifest: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """The commit protocol, step by step (named, so that a test can kill a save between any two of them)."""

    def replace_final() -> None:
        if final.exists():  # a rerun of the same step (e.g. after a crash between commit and retention)
            shutil.rmtree(final)
        os.rename(partial, final)

    return [
        *_manifest_steps(partial, manifest),
        ("rename checkpoint directory", replace_final),
        ("fsync tier directory", lambda: fsync_dir(final.parent)),
    ]


def publish(partial: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, durably, then rename the directory into place, durably."""
    for _, step in commit_steps(partial, final, manifest):
        step()


def verify(ckpt: Committed) -> list[str]:
    """Structural problems of a committed checkpoint: files missing or of the wrong size (empty when it is sound);
    the content is checked by `integrity.check_files` and, on resume, as the records are read.
    A node-local copy holds only its node's files and its peer's (`peers.py`): there, only those are checked."""
    problems = []
    node_local = ckpt.manifest.get("shared") is False
    for name, size in ckpt.manifest.get("files", {}).items():
        path = ckpt.path / name
        if path.is_symlink() and (out := escape(path, Path(os.path.realpath(ckpt.path)))):
            problems.append(f"{name} leads out of the checkpoint: {out}")
        elif not path.is_file():
            if not node_local or name == METADATA:
                problems.append(f"missing {name}")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {size}")
    if METADATA not in ckpt.manifest.get("files", {}):
        problems.append("no DCP .metadata in the manifest")
    return problems


def quarantine(path: Path) -> Path:
    """Take a damaged checkpoint out of every later search (a resume, a resubmitted job), keeping its files."""
    target = path.with_name(path.name + CORRUPT)
    if target.exists():
        shutil.rmtree(target)
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def remove_debris(directory: Path) -> list[Path]:
    """Saves and deletions that a crash cut short (nothing else writes to a tier while a run starts)."""
    stale = [sub for suffix in DEBRIS for sub in directory.glob(f"{PREFIX}*{suffix}") if _inside(sub)]
    for sub in stale:
        shutil.rmtree(sub, ignore_errors=True)
    return stale


def retain(directory: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last committed checkpoints, and partial, half-deleted or quarantined ones
    of a step no newer than the newest. Each goes out of the committed set with one rename first: a deletion
    killed half way must not leave a manifest beside missing files. An entry that is a link out of the
    directory is never deleted (nor counted: `committed_in` does not list it)."""
    committed = committed_in(directory)
    removed = [c.path for c in committed[: max(0, len(committed) - keep_last)]]
    newest = committed[-1].step if committed else -1
    for suffix in (*DEBRIS, CORRUPT):
        for sub in directory.glob(f"{PREFIX}*{suffix}"):
            if step_of(sub) <= newest and _inside(sub):
                removed.append(sub)
    for path in removed:
        doomed = path if path.name.endswith((*DEBRIS, CORRUPT)) else path.with_name(path.name + DELETING)
        if doomed != path:
            os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
