"""Durable renames: a file renamed into place survives a crash only once its directory's entries are fsynced.
Checkpoint commits and prepared datasets both end with a rename that must stay; both call this."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (files created or renamed in it) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
