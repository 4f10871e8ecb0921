"""A run's records as `python -m hpctrain.status` reads them: bounded and tolerant.

A run directory can be damaged in every way a file system allows: a node that died mid-write leaves a truncated
last line, a disk error leaves binary junk or invalid UTF-8, a hand edit leaves a line that is JSON but not a
record, a runaway writer leaves a file of gigabytes. The page must still show what can be read: each line is
decoded on its own and checked for the fields the ledger uses (hpctrain.goodput.ledger); one that fails is
skipped and counted (`Notes`), never raised; a line longer than any record is skipped without being held in
memory; of a file larger than its limit only the tail is read (the records a page needs are the newest).

The ledger itself is `hpctrain.goodput.ledger.build_ledger`, fed as `hpctrain.goodput.measure.measure` feeds it
(the task side reads its own fresh records through that one; this one is for what a user points at).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.bounded import Unreadable, read_text
from hpctrain.goodput.ledger import Ledger, Row
from hpctrain.goodput.measure import group_dir, measure, settings_of
from hpctrain.records.history import ATTEMPT_MARKS
from hpctrain.records.paths import RunPaths

LINE_BYTES = 2**20  # no record is longer: a longer line is junk, skipped without being held
CHUNK = 2**20
# Past these sizes only the file's tail is read (a 500,000-step run's metrics are about 150 MB).
TAIL_BYTES = {"events.jsonl": 64 * 2**20, "metrics.jsonl": 512 * 2**20}
RECORDS_BYTES = 16 * 2**20  # jobs.jsonl, attempts.jsonl: a line per job
SMALL_BYTES = 2**20  # COMPLETED.json, FAILED.json, a failure record, a host map: kilobytes


@dataclass
class Notes:
    """What could not be read, by file: lines skipped, a head left out, a whole file unreadable."""

    skipped: dict[str, int] = field(default_factory=dict)
    incomplete: set[str] = field(default_factory=set)
    cut: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (bytes left out, file size)
    unreadable: dict[str, str] = field(default_factory=dict)

    def skip(self, name: str) -> None:
        self.skipped[name] = self.skipped.get(name, 0) + 1

    def absorb(self, other: Notes, prefix: str) -> None:
        """Another folder's notes (a replica group's), its files named under `prefix`."""
        for name, n in other.skipped.items():
            self.skipped[prefix + name] = self.skipped.get(prefix + name, 0) + n
        self.incomplete |= {prefix + name for name in other.incomplete}
        self.cut.update({prefix + name: cut for name, cut in other.cut.items()})
        self.unreadable.update({prefix + name: why for name, why in other.unreadable.items()})

    def lines(self) -> list[str]:
        out = []
        for name in sorted(set(self.skipped) | self.incomplete | set(self.cut)):
            said = []
            if name in self.cut:
                left, size = self.cut[name]
                said.append(f"{_size(size)}: only its last {_size(size - left)} read")
            if self.skipped.get(name):
                n = self.skipped[name]
                said.append(
                    f"{n} unreadable line{'s' if n > 1 else ''} skipped (not a JSON record of this file, or not UTF-8)"
                )
            if name in self.incomplete:
                said.append("its last line is incomplete (being written, or cut off): not read")
            out.append(f"{name}: " + "; ".join(said))
        out += [f"{name}: not read ({why})" for name, why in sorted(self.unreadable.items())]
        return out


def jsonl(path: Path, notes: Notes, accept: Callable[[Any], Any], limit: int = RECORDS_BYTES) -> Iterator[Any]:
    """`accept(record)` of each line of a JSON-lines file that decodes and that `accept` takes (it returns the
    value to yield, or None to skip the line: counted in `notes`). A missing file yields nothing; a file past
    `limit` bytes yields its tail's records; what was there at the open is read, a line still being written
    (no newline yet) is left for the next read."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as exc:
        notes.unreadable[name] = exc.strerror or str(exc)
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            notes.unreadable[name] = "not a regular file"
            return
        size = info.st_size
        start = max(0, size - limit)
        os.lseek(fd, start, os.SEEK_SET)
        remaining = size - start
        buffer, dropping = b"", start > 0  # mid-line after a seek: up to the first newline is the head's
        if start:
            notes.cut[name] = (start, size)
        while remaining > 0:
            chunk = os.read(fd, min(CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            pieces = (buffer + chunk).split(b"\n")
            buffer = pieces.pop()
            for line in pieces:
                if dropping:
                    dropping = False
                    continue
                value = _decode(line, accept)
                if value is None:
                    if line.strip():
                        notes.skip(name)
                    continue
                yield value
            if len(buffer) > LINE_BYTES:  # no newline in sight: junk, dropped up to the next one
                if not dropping:
                    notes.skip(name)
                buffer, dropping = b"", True
        if buffer.strip() and not dropping:
            notes.incomplete.add(name)
    except OSError as exc:
        notes.unreadable[name] = f"read failed: {exc.strerror or exc}"
    finally:
        os.close(fd)


def _decode(line: bytes, accept: Callable[[Any], Any]) -> Any:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (UnicodeDecodeError is a ValueError)
        return None
    try:
        return accept(record)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return None


def json_file(path: Path, notes: Notes, accept: Callable[[Any], Any]) -> Any:
    """A small JSON file's `accept`ed value; None when missing, and (noted) when unreadable or not the record."""
    if not path.exists():
        return None
    try:
        value = _decode(read_text(path, SMALL_BYTES).encode(), accept)
    except Unreadable as err:
        notes.unreadable[_rel(path)] = str(err).replace(str(path), "the file", 1)
        return None
    if value is None:
        notes.unreadable[_rel(path)] = "not a JSON record of this file"
    return value


def _rel(path: Path) -> str:
    """A record's name as the notes say it: the file name, with its attempt's folder for a failure record."""
    return (
        f"{path.parent.parent.name}/{path.parent.name}/{path.name}"
        if path.parent.parent.name == "failures"
        else path.name
    )


# What a record must hold for the ledger to read it (the fields hpctrain.goodput.ledger reads, with their types).


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return _number(value) and float(value).is_integer()


def event(e: Any) -> dict[str, Any] | None:
    if not (isinstance(e, dict) and isinstance(e.get("event"), str) and _number(e.get("time"))):
        return None
    kind = e["event"]
    if kind == "attempt" and all(m in e for m in ATTEMPT_MARKS):
        ok = (
            all(_number(e[m]) for m in ATTEMPT_MARKS)
            and e.get("job_id") is not None
            and _integer(e.get("restart"))
            and _integer(e.get("from_step"))
            and _integer(e.get("requeue", 0))
        )
        return e if ok else None
    if kind in ("stop", "attempt_end") and not _number(e.get("save_s", 0.0)):
        return None
    if kind == "resume" and ("tier" not in e or "step" not in e):
        return None
    if kind == "replica_heal" and not (
        _integer(e.get("step")) and _integer(e.get("from_step")) and _number(e.get("heal_s"))
    ):
        return None
    if kind == "diloco_round_dropped" and not _integer(e.get("step")):
        return None
    return e


def metrics_row(m: Any) -> Row | None:
    if not isinstance(m, dict):
        return None
    row = Row.of(m)
    numbers = (row.time, row.step_s, row.data_wait_s, row.compile_s, row.ckpt_s, row.eval_s, row.quorum_s)
    ok = _integer(row.step) and all(_number(x) for x in numbers)
    return row if ok and (row.participants is None or _integer(row.participants)) else None


def job(j: Any) -> dict[str, Any] | None:
    ok = isinstance(j, dict) and isinstance(j.get("job_id"), (str, int)) and _number(j.get("submitted"))
    return j if ok else None


def resubmission(r: Any) -> dict[str, Any] | None:
    if not isinstance(r, dict):
        return None
    excluded = r.get("excluded")
    return r if excluded is None or (isinstance(excluded, list) and all(isinstance(h, str) for h in excluded)) else None


def failure(r: Any) -> dict[str, Any] | None:
    ok = (
        isinstance(r, dict)
        and _integer(r.get("rank"))
        and _number(r.get("time"))
        and "step" in r
        and all(isinstance(r.get(k), str) for k in ("type", "message", "host"))
        and (r.get("blame") is None or isinstance(r.get("blame"), list))
    )
    return r if ok else None


def hosts(h: Any) -> list[str] | None:
    return h if isinstance(h, list) and all(isinstance(x, str) for x in h) else None


def completed(c: Any) -> dict[str, Any] | None:
    return c if isinstance(c, dict) and _integer(c.get("step")) and c.get("job_id") is not None else None


def report(r: Any) -> dict[str, Any] | None:
    return r if isinstance(r, dict) and isinstance(r.get("why"), str) else None


class RunRecords:
    """One run directory's records, each read once per page (`Notes` say what was not)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.paths = RunPaths(run_dir)
        self.notes = Notes()
        self.config_note: dict[str, str] = {}  # config.yaml is read once, the records on every page
        self.groups: list[tuple[str, RunRecords]] = []  # replica groups' folders read for this page

    def settings(self) -> dict[str, Any]:
        """What the ledger needs of the run's config (its last step, its scheduler, its hot spares, its replica
        groups); what config.yaml cannot say comes from the job records (the executor) or stays unknown (0 steps,
        spares, no replica groups)."""
        from omegaconf import OmegaConf

        try:
            return settings_of(OmegaConf.create(read_text(self.paths.config)))
        except Unreadable as err:
            self.config_note["config.yaml"] = str(err).replace(str(self.paths.config), "the file", 1)
        except Exception as exc:  # noqa: BLE001  (not YAML, not a mapping, not hpctrain's keys)
            self.config_note["config.yaml"] = f"not a run config: {type(exc).__name__}: {_first(exc)}"
        self.notes.unreadable.update(self.config_note)
        executors = [str(j.get("executor")) for j in self.jobs() if j.get("executor")]
        return {"max_steps": 0, "executor": executors[-1] if executors else "local"}

    def jobs(self) -> list[dict[str, Any]]:
        return list(jsonl(self.paths.jobs, self.notes, job))

    def completed(self) -> dict[str, Any] | None:
        return json_file(self.paths.completed, self.notes, completed)

    def report(self) -> dict[str, Any] | None:
        return json_file(self.paths.failed, self.notes, report)

    def failures(self, key: str) -> list[dict[str, Any]]:
        folder = self.paths.failures(key)
        if not folder.is_dir():
            return []
        records = [json_file(p, self.notes, failure) for p in sorted(folder.glob("rank*.json"))]
        return sorted((r for r in records if r is not None), key=lambda r: r["time"])

    def hosts(self, key: str) -> list[str]:
        return json_file(self.paths.hosts(key), self.notes, hosts) or []

    def events(self) -> list[dict[str, Any]]:
        return list(jsonl(self.paths.events, self.notes, event, TAIL_BYTES["events.jsonl"]))

    def rows(self) -> Iterator[Row]:
        return jsonl(self.paths.metrics, self.notes, metrics_row, TAIL_BYTES["metrics.jsonl"])

    def attempts(self) -> list[dict[str, Any]]:
        return list(jsonl(self.paths.attempts, self.notes, resubmission))

    def group(self, group: int) -> RunRecords:
        """Replica group `group`'s records (its folder), read as tolerantly: what could not be read joins this
        page's notes, under the folder's name."""
        records = RunRecords(group_dir(self.run_dir, group))
        self.groups.append((f"{group_dir(Path(), group).as_posix()}/", records))
        return records

    def measure(self, settings: dict[str, Any], now: float | None = None) -> Ledger:
        """The ledger hpctrain.goodput.measure makes, from what could be read (each page says what could not)."""
        self.notes, self.groups = Notes(unreadable=dict(self.config_note)), []
        ledger = measure(self.run_dir, now, records=self, settings=settings)
        for prefix, records in self.groups:
            self.notes.absorb(records.notes, prefix)
        return ledger


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
