"""What a check reports: the key at fault, what is wrong, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.config.layout import Layout


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


@dataclass
class CheckReport:
    """All the checks found: errors and warnings, each naming its key and fix."""

    layout: Layout
    estimates: Any = None  # hpctrain.plan.estimate.Estimates once the layout is valid
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    def error(self, key: str, message: str, fix: str) -> None:
        self.errors.append(Problem(key, message, fix))

    def warn(self, key: str, message: str, fix: str) -> None:
        self.warnings.append(Problem(key, message, fix))
