"""What a run logged as it trained, read back: its events and its metrics rows (the goodput ledger and
`python -m hpctrain.status` read them; the tracker writes them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctrain.records.paths import RunPaths

# An attempt's start-up, mark by mark, in the "attempt" event the training loop writes after its first step:
# the process began (forked by the agent), imported, joined the process group, holds the lease, watchdog and
# pre-flight done, engine built, checkpoint manager ready, state loaded, data and tracker ready, first step
# done. The goodput ledger and bench/bench_restart.py break restarts down with them.
ATTEMPT_MARKS = (
    "process_started",
    "imported",
    "joined",
    "leased",
    "checked",
    "engine_built",
    "manager_ready",
    "resumed",
    "ready",
    "first_step",
)
# What each pair of marks in a row spans.
ATTEMPT_PARTS = (
    "imports",
    "process group",
    "lease, hosts",
    "watchdog, pre-flight",
    "engine build",
    "checkpoint manager",
    "state read",
    "data, tracker",
    "first step",
)


def lines_from(path: Path, offset: int = 0) -> Iterator[tuple[dict[str, Any], int]]:
    """Each complete line from byte `offset` on, as JSON, with the offset just past it (where a later read
    resumes). It stops at a line still being written (no newline yet): the next read takes it whole."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):
                return
            offset += len(line)
            yield json.loads(line), offset


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    return (record for record, _ in lines_from(path))


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return list(_lines(RunPaths(run_dir).events))


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The metrics rows in the order they were written (a week-long run has hundreds of thousands: streamed)."""
    return _lines(RunPaths(run_dir).metrics)
