"""What the login node's checks found for one run: its layout, the plan's estimates, errors and warnings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpctrain.config.layout import Layout
from hpctrain.config.problems import Problem


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
