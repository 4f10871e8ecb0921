"""The GPU-rules mode (tests/gpu_rules.py) fails each rule it claims to check, and the elastic agent does not
initialise CUDA before it forks its workers (on a GPU every worker died at its first CUDA call)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import gpu_rules
from tests.distributed_harness import DistributedTestError, run_distributed

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cuda_spy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The rules' CUDA spies in this process for one test; what they record starts empty."""
    for name in gpu_rules.QUERIES + gpu_rules.INITIALISING:
        original = getattr(torch.cuda, name, None)
        if original is not None and not getattr(original, "__gpu_rules__", False):
            monkeypatch.setattr(torch.cuda, name, gpu_rules._spy(name, original, name in gpu_rules.QUERIES))
    monkeypatch.setattr(gpu_rules.STATE, "cuda_initialised_at", None)
    monkeypatch.setattr(gpu_rules.STATE, "poisoned_by", None)
    return gpu_rules.STATE


def test_the_agent_forks_its_workers_without_initialising_cuda(
    cuda_spy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A one-node agent runs for real up to the moment torch's agent would fork the workers (its launch), which
    this test takes over: by then nothing may have initialised CUDA in the agent's process. torch's LaunchConfig
    asked torch.cuda.is_available(), which initialises CUDA through cudaGetDeviceCount."""
    import gc

    import torch.distributed.launcher.api as launcher

    from hpctrain.distributed import elastic
    from hpctrain.train.worker import run_worker  # as the task imports it, before its agent forks

    seen: dict[str, Any] = {}

    def launch_agent(config: Any, entrypoint: Any, args: list[Any], **_: Any) -> dict[int, Any]:
        seen["cuda"] = gpu_rules.cuda_initialised_at()
        seen["workers"] = config.nproc_per_node
        return {0: "trained"}

    monkeypatch.setattr(launcher, "launch_agent", launch_agent)
    monkeypatch.setattr(gc, "freeze", lambda: None)  # the agent's, not pytest's
    for key in (
        elastic.NVML_CUDA_CHECK,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "HPCTRAIN_JOB_ID",
        "HPCTRAIN_RESTART_BASE",
    ):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    usr2 = signal.getsignal(signal.SIGUSR2)
    agent = elastic.NodeAgent(
        job_id="cuda-spy", node=0, nodes=1, workers=2, hosts=("127.0.0.1",), max_restarts=0, join_timeout_s=30
    )
    try:
        assert elastic.run_agent(agent, types.SimpleNamespace(run_dir=str(tmp_path)), run_worker) == {0: "trained"}
    finally:
        signal.signal(signal.SIGUSR2, usr2)
    assert seen == {"cuda": None, "workers": 2}, seen["cuda"]


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


@pytest.mark.parametrize("nvml", [False, True], ids=["cuda_initialised", "nvml_check"])
def test_a_child_forked_after_cuda_was_initialised_fails_at_its_first_cuda_call(nvml: bool) -> None:
    """Through the sitecustomize every test-started process gets: the parent asks is_available (which
    initialises CUDA unless the NVML check is on), forks, and the child asks device_count."""
    env = gpu_rules.environment({**os.environ, **({gpu_rules.NVML_CHECK: "1"} if nvml else {})})
    if not nvml:
        env.pop(gpu_rules.NVML_CHECK, None)
    proc = _python(
        """
        import os, sys, torch
        torch.cuda.is_available()
        pid = os.fork()
        if pid == 0:
            try:
                torch.cuda.device_count()
            except Exception as exc:
                print(type(exc).__name__, exc)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """,
        env,
    )
    if nvml:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1 and "GpuRuleViolation GPU rule (fork after CUDA)" in proc.stdout, proc.stdout
        assert "torch.cuda.is_available" in proc.stdout and "Cannot re-initialize CUDA" in proc.stdout


def test_the_rules_are_off_without_the_switch() -> None:
    env = {k: v for k, v in os.environ.items() if k != gpu_rules.ENV}
    proc = _python(
        """
        import torch
        print(getattr(torch.cuda.is_available, "__gpu_rules__", False))
        """,
        {**env, "PYTHONPATH": f"{gpu_rules.site_dir()}{os.pathsep}{REPO}"},
    )
    assert proc.stdout.strip() == "False", proc.stderr


def _collective_from_a_thread(rank: int, world: int, gloo: bool) -> str:
    group = dist.new_group(backend="gloo") if gloo else None
    errors: list[str] = []

    def background() -> None:
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=background, name="save")
    thread.start()
    thread.join()
    if errors:
        raise RuntimeError(errors[0])
    dist.all_reduce(torch.ones(1))  # the owner thread itself may
    return "ok"


def test_a_collective_on_a_device_group_from_another_thread_fails(gpu_rules: None) -> None:
    assert run_distributed(_collective_from_a_thread, 2, True, timeout=60) == ["ok", "ok"]  # a gloo group: fine
    with pytest.raises(
        DistributedTestError,
        match=r"GPU rule \(one thread per device group\): dist.all_reduce "
        r"on the default group from thread 'save'",
    ):
        run_distributed(_collective_from_a_thread, 2, False, timeout=60)


def _step_with_extra_syncs(rank: int, world: int, extra: int) -> list[float]:
    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel import engine as engine_module
    from tests.parallel.layouts import make_cfg, rank_batches

    cfg = make_cfg(world)
    engine = engine_module.build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    share = engine_module.squared_norm_share
    namespace = {"__name__": "hpctrain.parallel.clipping", "share": share, "extra": extra}
    exec(
        "def syncing(*args):\n    value = share(*args)\n    for _ in range(extra):\n        value.item()\n"
        "    return value",
        namespace,
    )  # a host sync from hpctrain's own code inside the step
    engine_module.squared_norm_share = namespace["syncing"]
    return [
        engine.step(rank_batches(step, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr).loss for step in range(2)
    ]


def test_a_second_host_sync_in_one_step_fails(gpu_rules: None) -> None:
    assert len(run_distributed(_step_with_extra_syncs, 2, 0, timeout=120)[0]) == 2  # the control plane's one
    with pytest.raises(
        DistributedTestError,
        match=r"GPU rule \(host syncs per step\): 2 copies .*"
        r"Tensor.item at hpctrain.parallel.clipping:4; "
        r"Tensor.tolist at hpctrain.parallel.engine",
    ):
        run_distributed(_step_with_extra_syncs, 2, 1, timeout=120)
