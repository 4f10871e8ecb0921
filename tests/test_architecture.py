"""The layer rules (pyproject.toml [tool.importlinter]), checked over the real import graph with import-linter:
models know nothing of parallelism; plan is pure math without torch; the task side never imports the launch
side; config imports no runtime and not the planner. Direct and indirect imports, function-level ones included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_layer_rules_hold() -> None:
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(
    "module,planted,contract",
    [
        ("models/params.py", "from hpctrain.parallel import engine", "models know nothing of parallelism"),
        ("plan/bubble.py", "import torch", "plan is pure math"),
        ("health/monitor.py", "from hpctrain.launch import submit", "the task side never imports the launch side"),
        ("config/problems.py", "from hpctrain.train import loop", "config imports no runtime"),
        ("config/checks.py", "from hpctrain.plan.estimate import estimate", "not the planner"),
    ],
)
def test_a_planted_violation_fails(tmp_path: Path, module: str, planted: str, contract: str) -> None:
    shutil.copytree(REPO / "hpctrain", tmp_path / "hpctrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "hpctrain" / module
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n    {planted}  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    assert f"{contract}" in proc.stdout and "BROKEN" in proc.stdout, proc.stdout[-3000:]
