"""Where checkpoints live on disk, and what makes one complete.

A tier directory holds `step_<N>/` directories. A save writes into `step_<N>.partial/`; it is published by
writing `manifest.json` (step, layout, world size, every file with its size) last and renaming the
directory to `step_<N>/`. So `step_<N>/manifest.json` exists only for complete checkpoints, and anything
still named `.partial` is the debris of a save that was killed half way.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
PREFIX = "step_"
PARTIAL = ".partial"


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
    p = Path(path).expanduser()
    return p / run_id if p.is_absolute() else run_dir / p


def committed_in(directory: Path, tier: str = "") -> list[Committed]:
    """Complete checkpoints in a tier directory, oldest first."""
    found = []
    if not directory.is_dir():
        return found
    for sub in directory.iterdir():
        manifest = sub / MANIFEST
        if sub.name.startswith(PREFIX) and not sub.name.endswith(PARTIAL) and manifest.is_file():
            try:
                meta = json.loads(manifest.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            found.append(Committed(tier=tier, step=int(meta["step"]), path=sub, manifest=meta))
    return sorted(found, key=lambda c: c.step)


def list_files(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under a checkpoint directory (the manifest excluded)."""
    return {str(p.relative_to(directory)): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Atomically: a reader sees no manifest or a whole one."""
    tmp = directory / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def publish(partial: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, then rename the directory into place."""
    write_manifest(partial, manifest)
    if final.exists():  # a rerun of the same step (e.g. after a crash between commit and retention)
        shutil.rmtree(final)
    os.rename(partial, final)


def verify(ckpt: Committed) -> list[str]:
    """Problems of a committed checkpoint: files missing or of the wrong size (empty when it is sound).
    A node-local copy holds only its node's files and its peer's (`peers.py`): there, only those are checked."""
    problems = []
    node_local = ckpt.manifest.get("shared") is False
    for name, size in ckpt.manifest.get("files", {}).items():
        path = ckpt.path / name
        if not path.is_file():
            if not node_local or name == ".metadata":
                problems.append(f"missing {name}")
        elif path.stat().st_size != size:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {size}")
    if ".metadata" not in ckpt.manifest.get("files", {}):
        problems.append("no DCP .metadata in the manifest")
    return problems


def retain(directory: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last committed checkpoints, and partial saves older than the newest."""
    committed = committed_in(directory)
    removed = [c.path for c in committed[: max(0, len(committed) - keep_last)]]
    newest = committed[-1].step if committed else -1
    for sub in directory.glob(f"{PREFIX}*{PARTIAL}"):
        if int(sub.name[len(PREFIX):-len(PARTIAL)]) <= newest:
            removed.append(sub)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
