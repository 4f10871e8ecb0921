"""hpctrain.bounded: a file a user names is read only when it is a regular file of at most the limit, as text; what
is not comes back as `Unreadable`, never a block, a long read or a traceback (issue 46)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hpctrain.bounded import CONFIG_BYTES, Unreadable, read_bytes, read_text


def _refused(path: object, words: str, limit: int = CONFIG_BYTES, text: bool = False) -> None:
    started = time.monotonic()
    with pytest.raises(Unreadable) as err:
        (read_text if text else read_bytes)(path, limit)  # type: ignore[arg-type]
    assert words in str(err.value), str(err.value)
    assert time.monotonic() - started < 1.0


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    f = tmp_path / "ds.json"
    f.write_text('{"train_batch_size": 8}\n')
    assert read_text(f) == '{"train_batch_size": 8}\n' and read_bytes(str(f)) == f.read_bytes()
    (tmp_path / "empty.json").touch()
    assert read_text(tmp_path / "empty.json") == ""


def test_the_limit_is_inclusive(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert read_bytes(f, 100) == b"x" * 100
    _refused(f, "is 100 bytes, more than the 99 bytes such a file can be", limit=99)


def test_a_large_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    f = tmp_path / "big.json"
    with open(f, "wb") as out:
        out.truncate(20 * 2**30)  # 20 GiB, sparse: reading it would take minutes
    _refused(f, "is 20.0 GiB, more than the 16.0 MiB")


def test_what_is_not_a_regular_file(tmp_path: Path) -> None:
    _refused(tmp_path / "missing.json", "does not exist")
    _refused(tmp_path, "is not a regular file (it is a directory)")
    _refused("/dev/zero", "is not a regular file (it is a character device)")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _refused(fifo, "is not a regular file (it is a FIFO)")  # no writer: an open() without O_NONBLOCK would block


def test_a_fifo_with_a_writer_is_refused_too(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = threading.Event()

    def writer() -> None:
        try:
            fd = os.open(fifo, os.O_WRONLY)  # blocks until a reader opens it (or the test's own open below)
            os.close(fd)
        except OSError:
            pass
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    _refused(fifo, "it is a FIFO")
    with open(fifo, "rb"):  # let the writer go
        pass
    assert done.wait(5)


def test_links_are_followed_to_what_they_name(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("{}")
    (tmp_path / "link.json").symlink_to(target)
    assert read_text(tmp_path / "link.json") == "{}"
    (tmp_path / "to_dev").symlink_to("/dev/zero")
    _refused(tmp_path / "to_dev", "character device")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    _refused(tmp_path / "dangling", "does not exist")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    _refused(tmp_path / "loop", "cannot be opened")


def test_binary_and_undecodable_files_are_not_text(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x00\x01\x02PK\x03\x04")
    assert read_bytes(binary) == b"\x00\x01\x02PK\x03\x04"
    _refused(binary, "is not a text file (it holds NUL bytes)", text=True)
    latin = tmp_path / "latin1.json"
    latin.write_bytes('{"name": "Zürich"}'.encode("latin-1"))
    _refused(latin, "is not UTF-8 text (byte 11: b'\\xfc')", text=True)


def test_a_path_with_a_nul_byte_is_refused(tmp_path: Path) -> None:
    _refused(f"{tmp_path}/a\0b", "is not a path (it holds a NUL byte)")


def test_a_path_through_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file" / "below", "cannot be opened")


def test_unreadable_is_a_value_error() -> None:
    """Callers that caught ValueError for bad JSON keep catching a bad file the same way."""
    assert issubclass(Unreadable, ValueError)
