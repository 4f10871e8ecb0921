"""The layer rules (pyproject.toml [tool.importlinter]), checked over the real import graph with import-linter: one
layers contract over every package of hpctrain (a package imports only from the layers below its own), and the
login node's planning and checking import no torch. Direct and indirect imports, function-level and type-only ones
included."""

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
    assert "2 kept, 0 broken" in proc.stdout


def test_the_layers_name_every_package() -> None:
    """The layers contract is exhaustive: a new package of hpctrain that is in no layer fails lint-imports."""
    import tomllib

    contract = next(
        c
        for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers"
    )
    named = {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}
    packages = {p.name for p in (REPO / "hpctrain").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (REPO / "hpctrain").glob("*.py") if p.stem != "__init__"}
    assert contract["exhaustive"] and named == packages | modules


LAYERS = "the layers, top to bottom"
TORCH_FREE = "the login node's planning and checking import no torch"


@pytest.mark.parametrize(
    "module,planted,contract",
    [
        ("models/params.py", "from hpctrain.parallel import engine", LAYERS),  # models know nothing of parallelism
        ("plan/bubble.py", "import torch", TORCH_FREE),
        ("health/monitor.py", "from hpctrain.launch import submit", LAYERS),  # the task side never imports launch
        ("parallel/engine.py", "from hpctrain.simulate import rank", LAYERS),  # nor the simulator
        ("config/problems.py", "from hpctrain.train import loop", LAYERS),  # config imports no runtime
        ("config/schema.py", "from hpctrain.plan.estimate import estimate", LAYERS),  # nor the planner
        ("config/schema.py", "from hpctrain.models import registry", LAYERS),  # nor the models (type-only too)
        ("distributed/elastic.py", "from hpctrain.train import worker", LAYERS),  # the agent is below the loop
        ("checkpoint/manager.py", "from hpctrain.parallel import engine", LAYERS),  # siblings are independent
        ("checks/runner.py", "import torch", TORCH_FREE),
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
