"""Shared fixtures: compose configs the way `python -m hpctrain` does, without a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from hpctrain.config.schema import register
from tests.gpu_rules import environment as rules_environment

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"

os.environ.setdefault("WANDB_MODE", "offline")
register()

# Tests a measured run found slow (tools/quick_tier.py): the quick tier, -m "not slow and not slurm", leaves them out.
SLOW = {
    line.strip()
    for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg("+experiment=175b", "parallel.tp=4") -> the composed, schema-checked config."""
    return _compose


@pytest.fixture(scope="module")
def compose_cfg_module() -> Callable[..., DictConfig]:
    """compose_cfg, for module-scoped fixtures (a run several tests share)."""
    return _compose


@pytest.fixture(scope="module")
def gpu_rules() -> Iterator[None]:
    """GPU-rules mode (tests/gpu_rules.py) for every rank and process the module's tests start: what would
    fail on GPUs with NCCL fails there too, naming the rule."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in rules_environment({}).items():
            patch.setenv(key, value)
        yield


TRACEBACK = "Traceback (most recent call last)"


def run_hpctrain(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None, module: str = "hpctrain"
) -> subprocess.CompletedProcess:
    """Run the real command line (`python -m hpctrain`, or another of its modules), as a user would, in
    GPU-rules mode (tests/gpu_rules.py): the login process, the submitit tasks, the elastic agents and their
    forked workers fail where a GPU run would.

    Whatever the input, the console never shows a Python traceback (issue 46): a bad input gets a message with
    the key and the fix, a failed job the failure record and its log's path. Every command the suite runs is held
    to that here; a task's traceback belongs in its log file."""
    full_env = rules_environment({**os.environ, "WANDB_MODE": "offline", **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if TRACEBACK in proc.stdout + proc.stderr:
        pytest.fail(
            f"`python -m {module} {' '.join(args)}` printed a Python traceback on the console:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


@pytest.fixture
def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `sbatch` on PATH that only answers job id 4242, and the `srun` submitit's executor insists on finding
    (nothing runs it: a fresh machine has no Slurm yet). Returns their folder."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool, body in {"sbatch": "echo 'Submitted batch job 4242'", "srun": "exit 1"}.items():
        (fake / tool).write_text(f"#!/bin/sh\n{body}\n")
        (fake / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return fake
