"""`dry_run=simulate` on fake CUDA (hpctrain.simulate.fake_cuda): the rank steps on "cuda" tensors with the
attention kernels an H100 runs, where g++ can build the fake-CUDA library; elsewhere on the CPU, saying why
(`plan.simulate_device`, docs/simulate.md). DDP and compile, which fake CUDA cannot run, are refused for any
simulation by the checks (tests/fake_cuda/test_layouts.py has why)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.simulate import fake_cuda
from tests.conftest import REPO, run_hpctrain

pytestmark = pytest.mark.usefixtures("gpu_rules")
# GPT-3 1.3B's layout (ZeRO-2 over 8 GPUs, bf16, selective recompute, 2,048 tokens), two of its 24 layers
SMALL = ("+experiment=gpt3_1.3b_1node", "model.n_layers=2", "dry_run=simulate")


def _simulation(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = run_hpctrain(*SMALL, *args, "plan.format=json", f"run.root={tmp_path}", cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["simulation"], proc.stdout


@pytest.mark.skipif(fake_cuda.unavailable_reason() is not None, reason="no g++ to build fake CUDA")
def test_the_simulation_runs_on_fake_cuda_with_the_gpu_attention_kernels(tmp_path: Path) -> None:
    sim, _ = _simulation(tmp_path)
    assert (sim["device"], sim["why_cpu"]) == ("cuda (fake)", "")
    # 2 layers x 3 micro-batches, each forward once and again in backward's recomputation (selective)
    assert sim["attention"] == {"flash": 12}
    assert not any("attention kernel" in item for item in sim["unseen"])
    assert sim["model_states"]["within"]


def test_without_a_compiler_the_simulation_runs_on_the_cpu_and_says_so(tmp_path: Path) -> None:
    env = {"CXX": str(tmp_path / "no-such-g++"), "HPCTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_hpctrain(*SMALL, f"run.root={tmp_path}", cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "one training step on fake tensors on the CPU (no C++ compiler (g++) to build the fake-CUDA library: "
        "apt-get install g++)" in proc.stdout
    )
    assert not (tmp_path / "cache" / "fake_cuda").exists() or not any((tmp_path / "cache" / "fake_cuda").rglob("*.so"))


def test_plan_simulate_device_cpu_keeps_the_cpu(tmp_path: Path) -> None:
    sim, _ = _simulation(tmp_path, "plan.simulate_device=cpu")
    assert (sim["device"], sim["why_cpu"], sim["attention"]) == ("cpu", "", {})


def test_asking_for_fake_cuda_where_it_cannot_run_is_an_error_with_the_fix(tmp_path: Path) -> None:
    env = {"CXX": str(tmp_path / "no-such-g++"), "HPCTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_hpctrain(
        *SMALL, "plan.simulate_device=cuda", f"run.root={tmp_path / 'runs'}", cwd=REPO, timeout=300, env=env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "plan.simulate_device=cuda: fake CUDA cannot run this here: no C++ compiler (g++)" in proc.stderr
    assert "fix: plan.simulate_device=auto" in proc.stderr
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
