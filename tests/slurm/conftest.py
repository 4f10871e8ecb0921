"""The `slurm_cluster` fixture: a real multi-node Slurm cluster on this machine (slurm/dev-cluster.sh).

- Skipped (with the reason) when not root or when HPCTRAIN_SKIP_SLURM=1 -- except in CI (CI=true), where the
  cluster must come up and any problem fails the tests loudly.
- A cluster that was already running is reused and left running; one that this session started is taken down
  at the end of the session.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "dev-cluster.sh"
UP_TIMEOUT_S = 600  # a cold machine installs packages first


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs the real Slurm dev cluster (slurm/dev-cluster.sh, root)")


@dataclass(frozen=True)
class SlurmCluster:
    script: Path
    state_dir: Path
    conf: Path  # the cluster's slurm.conf (also installed as /etc/slurm/slurm.conf)
    nodes: tuple[str, ...]
    subnet: str  # first three octets of the bridge /24
    started_here: bool

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout, check=check)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _running(status: str) -> bool:
    return any(line.split()[:2] == ["slurmctld", "running"] for line in status.splitlines())


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    ci = _in_ci()
    if not ci:
        if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
            pytest.skip("HPCTRAIN_SKIP_SLURM=1: the Slurm dev cluster tests are disabled")
        if os.geteuid() != 0:
            pytest.skip("the Slurm dev cluster (slurm/dev-cluster.sh) needs root")
    elif os.geteuid() != 0:
        pytest.fail("CI=true: the Slurm dev cluster tests must run, but they need root (slurm/dev-cluster.sh)")

    was_running = _running(_script("status", timeout=60).stdout)
    try:
        up = _script("up", timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"slurm/dev-cluster.sh up did not finish in {UP_TIMEOUT_S}s:\n{e.stdout}\n{e.stderr}")
    if up.returncode != 0:
        pytest.fail(f"slurm/dev-cluster.sh up failed (rc {up.returncode}):\n{up.stdout}\n{up.stderr}")

    state_dir = Path(os.environ.get("HPCTRAIN_SLURM_DIR", "/tmp/hpctrain-slurm"))
    n = int(os.environ.get("HPCTRAIN_SLURM_NODES", "4"))
    cluster = SlurmCluster(
        script=SCRIPT,
        state_dir=state_dir,
        conf=state_dir / "etc" / "slurm.conf",
        nodes=tuple(f"n{i}" for i in range(1, n + 1)),
        subnet=os.environ.get("HPCTRAIN_SLURM_SUBNET", "10.213.77"),
        started_here=not was_running,
    )
    yield cluster
    if cluster.started_here:
        down = _script("down", timeout=120)
        if down.returncode != 0:
            print(f"slurm/dev-cluster.sh down failed:\n{down.stdout}\n{down.stderr}")
