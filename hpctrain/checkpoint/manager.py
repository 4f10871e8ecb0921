"""Checkpoints with torch.distributed.checkpoint (DCP): sharded as the state lives, committed atomically.

A checkpoint is written into a hidden temporary directory by every rank, then rank 0 writes the manifest
and renames the directory into place: a directory named step_<N> exists only once it is complete, so a
save killed half way leaves earlier checkpoints as they were and the partial one is ignored. Retention
deletes old checkpoints only after a newer one in that tier is committed.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step_"


@dataclass
class Tier:
    name: str
    path: Path
    interval_steps: int
    interval_minutes: float
    keep_last: int
    last_save_time: float = 0.0

    def due(self, step: int, now: float) -> bool:
        by_steps = self.interval_steps > 0 and step % self.interval_steps == 0
        by_time = self.interval_minutes > 0 and now - self.last_save_time >= 60 * self.interval_minutes
        return by_steps or by_time


@dataclass(frozen=True)
class Committed:
    tier: str
    step: int
    path: Path
    manifest: dict[str, Any]


def tier_path(path: str, run_dir: Path, run_id: str) -> Path:
    """Relative tier paths live in the run directory; absolute ones (RAM, local SSD) get the run id appended."""
    p = Path(path).expanduser()
    return p / run_id if p.is_absolute() else run_dir / p


def committed_in(directory: Path, tier: str = "") -> list[Committed]:
    """Complete checkpoints in a directory, oldest first."""
    found = []
    for sub in directory.glob(f"{PREFIX}*"):
        manifest = sub / MANIFEST
        if sub.is_dir() and manifest.exists():
            meta = json.loads(manifest.read_text())
            found.append(Committed(tier=tier, step=int(meta["step"]), path=sub, manifest=meta))
    return sorted(found, key=lambda c: c.step)


class CheckpointManager:
    """Saves and finds checkpoints of an engine (anything with state_dict() / load_state_dict())."""

    def __init__(self, cfg: Any, run_dir: Path, run_id: str, rank: int, layout: dict[str, int]) -> None:
        self.enabled = bool(cfg.checkpoint.enabled)
        self.save_final = bool(cfg.checkpoint.save_final)
        self.rank = rank
        self.run_id = run_id
        self.layout = layout
        start = time.monotonic()
        self.tiers = [
            Tier(t.name, tier_path(t.path, run_dir, run_id), t.interval_steps, t.interval_minutes, t.keep_last, start)
            for t in cfg.checkpoint.tiers
        ]

    def latest(self) -> Committed | None:
        """The newest committed checkpoint over all tiers (a faster tier wins a tie)."""
        best: Committed | None = None
        for tier in self.tiers:
            ckpts = committed_in(tier.path, tier.name)
            if ckpts and (best is None or ckpts[-1].step > best.step):
                best = ckpts[-1]
        return best

    def maybe_save(self, step: int, engine: Any, extra: dict[str, Any], final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        due = [t for t in self.tiers if t.due(step, now)]
        if any(t.interval_minutes > 0 for t in self.tiers):
            due = self._agree(due)
        if final and self.save_final and not due and self.tiers:
            due = [self.tiers[-1]]  # the end of training goes to the most durable tier
        for tier in due:
            self.save(tier, step, engine, extra)
            tier.last_save_time = now

    def _agree(self, due: list[Tier]) -> list[Tier]:
        """Clocks differ by rank: rank 0 decides which time-based tiers are due, every step, for all."""
        if not dist.is_initialized():
            return due
        names = [[t.name for t in due]]
        dist.broadcast_object_list(names, src=0)
        return [t for t in self.tiers if t.name in names[0]]

    def save(self, tier: Tier, step: int, engine: Any, extra: dict[str, Any]) -> Path:
        started = time.perf_counter()
        final = tier.path / f"{PREFIX}{step:08d}"
        tmp = tier.path / f".tmp-{PREFIX}{step:08d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(engine.state_dict(), checkpoint_id=str(tmp))
        if self.rank == 0:
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
            manifest = {"step": step, "run_id": self.run_id, "layout": self.layout, "files": files,
                        "time": time.time(), **extra}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._retain(tier)
            log.info("checkpoint step %d -> %s (%.2f s)", step, final, time.perf_counter() - started)
        _barrier()
        return final

    def _retain(self, tier: Tier) -> None:
        ckpts = committed_in(tier.path, tier.name)
        for old in ckpts[: max(0, len(ckpts) - tier.keep_last)]:
            shutil.rmtree(old.path, ignore_errors=True)
        for stale in tier.path.glob(f".tmp-{PREFIX}*"):  # partial saves of a killed run
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, ckpt: Committed, engine: Any) -> dict[str, Any]:
        """Load into the engine's live (possibly sharded) state: DCP reshards to this layout."""
        state = engine.state_dict()
        dcp.load(state, checkpoint_id=str(ckpt.path))
        engine.load_state_dict(state)
        log.info("resumed from tier %s step %d (%s)", ckpt.tier, ckpt.step, ckpt.path)
        return ckpt.manifest


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


