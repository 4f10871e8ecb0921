"""What every command-line entry point shares: `--help` that says in its first line what the command does.

argparse prints `usage:` first and the description after it; a user who runs `--help` to learn what a tool is for
should read that first. Every tool in tools/, bench/ and each `python -m hpctrain....` module builds its parser
here (tests/tools/test_entry_help.py runs them all).
"""

from __future__ import annotations

import argparse
from typing import Any


class EntryParser(argparse.ArgumentParser):
    """An ArgumentParser whose help starts with the first line of its description (the module's docstring), then
    argparse's usage, options and the whole description, kept as written."""

    def __init__(self, description: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(description=description, **kwargs)

    def format_help(self) -> str:
        summary = next((line.strip() for line in (self.description or "").splitlines() if line.strip()), "")
        return f"{summary}\n\n{super().format_help()}" if summary else super().format_help()
