"""Bounded reads of files a user names or a run directory holds: a regular file, at most a limit, text decoded.

`+deepspeed=/dev/zero` read 11.4 GB in 30 s before this; a FIFO would block forever; a binary `config.yaml` ended in
a UnicodeDecodeError's traceback. Every file the login node (or a tool on it) reads goes through here, and what is
wrong comes back as `Unreadable`, whose message says what the file is and why it was not read; the caller names
the key and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# Limits by kind: a config or a JSON settings file is kilobytes; a record (events.jsonl, metrics.jsonl) grows with
# the run, so its readers take the tail they need instead of the whole file.
CONFIG_BYTES = 16 * 2**20


class Unreadable(ValueError):
    """Not read: not there, not a regular file, larger than the limit, not text, or the system refused."""


def read_bytes(path: str | os.PathLike[str], limit: int = CONFIG_BYTES) -> bytes:
    """The whole file, if it is a regular file (after links) of at most `limit` bytes. The size is checked on the
    open descriptor and the read stops at limit + 1 bytes, so a file that grows meanwhile is refused too."""
    path = Path(path)
    try:
        # What the path is, before it is opened: opening some devices does something (a tape rewinds, a watchdog
        # device starts its timer). The open descriptor is checked again below (the path may change meanwhile).
        _regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO opens without a writer, then is refused
    except FileNotFoundError:
        raise Unreadable(f"{path} does not exist") from None
    except OSError as exc:
        raise Unreadable(f"{path} cannot be opened: {exc.strerror or exc}") from None
    except ValueError as exc:
        if isinstance(exc, Unreadable):
            raise
        raise Unreadable(f"{str(path)!r} is not a path (it holds a NUL byte)") from None  # no file has such a name
    try:
        info = os.fstat(fd)
        _regular(path, info.st_mode)
        if info.st_size > limit:
            raise Unreadable(f"{path} is {_size(info.st_size)}, more than the {_size(limit)} such a file can be")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise Unreadable(f"{path} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise Unreadable(f"{path} grew past {_size(limit)} while it was read")
    return data


def read_text(path: str | os.PathLike[str], limit: int = CONFIG_BYTES) -> str:
    """`read_bytes`, decoded as UTF-8; a file with NUL bytes or invalid UTF-8 is not a text file."""
    data = read_bytes(path, limit)
    if b"\0" in data:
        raise Unreadable(f"{path} is not a text file (it holds NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"{path} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})") from None


def _regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise Unreadable(f"{path} is not a regular file (it is {_kind(mode)})")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
