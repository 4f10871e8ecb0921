"""What a check reports: the key at fault, what is wrong, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}\n    fix: {self.fix}"


class ConfigError(Exception):
    """One or more errors found before anything was submitted."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = [f"{len(problems)} config error(s); nothing was submitted:"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))
