"""The per-step control plane on real gloo ranks: one collective per step, on the engine's device, on the default
group, and a default group that carries CPU tensors the way the GPU path creates it.

On GPUs the default group used to be created as plain "nccl", which has a backend for cuda tensors only, and
the stop flag all-reduced a CPU tensor on it at the end of every step: every multi-GPU run crashed at step 1.
On this machine a group created as "cuda:gloo" rejects CPU tensors exactly as NCCL does.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hpctrain.distributed.environment import process_group_backend
from tests.checkpoint.test_checkpoint import SMALL
from tests.distributed_harness import DistributedTestError, run_distributed

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "gather_object",
    "reduce",
    "all_to_all",
    "all_to_all_single",
)


def _count_collectives(rank: int, world: int, config: dict[str, Any], run_dir: str) -> dict[int, list[tuple]]:
    """Run the real per-task loop; record every collective hpctrain's own code issues, by step window
    (the calls between the watchdog beats of step k-1 and step k belong to window k)."""
    from hpctrain.health import watchdog
    from tests.checkpoint import training

    window = [1]
    calls: dict[int, list[tuple]] = {}
    for name in COLLECTIVES:

        def wrapped(*args: Any, __orig: Any = getattr(dist, name), __name: str = name, **kwargs: Any) -> Any:  # noqa: B008
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("hpctrain."):
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
                group = kwargs.get("group", args[2] if __name == "all_reduce" and len(args) > 2 else None)
                calls.setdefault(window[0], []).append(
                    (
                        __name,
                        caller,
                        group in (None, dist.group.WORLD),
                        tensor.device.type if tensor is not None else None,
                    )
                )
            return __orig(*args, **kwargs)

        setattr(dist, name, wrapped)
    beat = watchdog.Watchdog.beat

    def counting_beat(self: Any, step: int, step_time: float) -> None:
        window[0] = step + 1
        beat(self, step, step_time)

    watchdog.Watchdog.beat = counting_beat
    training._rank_main(rank, world, config, run_dir, {})
    return calls


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,layout",
    [
        (2, []),  # DDP
        (4, ["parallel.tp=2", "zero=stage3"]),  # FSDP2 x TP: the gradient norm's groups used to cost 6 more
        (2, ["parallel.cp=2", "zero=stage2"]),  # CP: its gathers are functional collectives on the CP group, not these
    ],
    ids=["ddp2", "fsdp2xtp2", "cp2_zero2"],
)
def test_one_collective_per_step_on_the_default_group(
    compose_cfg, tmp_path: Path, world: int, layout: list[str]
) -> None:
    """A clock-timed checkpoint tier, straggler probes every 2 steps and the stop flag all ride on the loss
    reduction. Before this change a steady step issued 3 of hpctrain's own collectives with DDP (the stop flag's
    CPU tensor on the default group, the loss, the checkpoint agreement over gloo on every rank) plus an
    all_gather_object of the straggler probes every 2 steps; FSDP2 x TP added 6 for the gradient norm (measured
    on the previous code: 4 and 10 on probe steps)."""
    cfg = compose_cfg(
        *SMALL,
        f"cluster.gpus_per_node={world}",
        "run.id=test",
        f"run.root={tmp_path}",
        "train.max_steps=8",
        "health.straggler_every=2",
        "health.preflight=off",
        *layout,
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_minutes: 600, keep_last: 1}}]",
        "checkpoint.save_final=false",
    )
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    results = run_distributed(_count_collectives, world, config, str(tmp_path / "run"), timeout=240)
    for calls in results:
        for step in range(2, 8):  # steady steps (the first has start-up's collectives before it)
            assert calls[step] == [("all_reduce", "hpctrain.parallel.engine", True, "cpu")], (step, calls[step])


@pytest.mark.timeout(300)
def test_expert_parallelism_adds_only_its_dispatch(compose_cfg, tmp_path: Path) -> None:
    """An MoE model under EP 2: the step's one reduction stays the only control collective (the routing counts
    ride it); each MoE layer forward adds one all-to-all of its counts on the EP group (here the whole world; the
    rows go through torch's functional collectives, forward and backward, not counted here), 2 layers x 2
    micro-batches."""
    from tests.checkpoint.test_moe_resume import MOE

    cfg = compose_cfg(
        *SMALL,
        "cluster.gpus_per_node=2",
        "run.id=test",
        f"run.root={tmp_path}",
        *MOE,
        "parallel.ep=2",
        "train.max_steps=4",
        "health.preflight=off",
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm, interval_minutes: 600, keep_last: 1}}]",
        "checkpoint.save_final=false",
    )
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for calls in run_distributed(_count_collectives, 2, config, str(tmp_path / "run"), timeout=240):
        for step in range(2, 4):
            control = [c for c in calls[step] if c[0] != "all_to_all_single"]
            assert control == [("all_reduce", "hpctrain.parallel.engine", True, "cpu")], (step, calls[step])
            dispatch = [c[:2] for c in calls[step] if c[0] == "all_to_all_single"]
            assert dispatch == [("all_to_all_single", "hpctrain.models.common.moe")] * 2 * 2, dispatch


def _agree_on_cpu(rank: int, world: int) -> bool:
    from hpctrain.train.preemption import agree_any

    return agree_any(rank == 1, torch.device("cpu"))


def test_a_device_only_group_rejects_cpu_control_tensors() -> None:
    """What a plain "nccl" default group does to a CPU tensor, reproduced with "cuda:gloo"."""
    with pytest.raises(DistributedTestError, match="No backend type associated with device type cpu"):
        run_distributed(_agree_on_cpu, 2, backend="cuda:gloo", timeout=60)


def _train_steps(rank: int, world: int, overrides: dict[str, Any]) -> list[float]:
    from tests.parallel.layouts import run_engine

    return run_engine(rank, world, overrides, 2)["loss"]


def test_the_gpu_paths_default_group_carries_cpu_and_device_tensors() -> None:
    """The GPU path creates the default group with a backend for each device type; with gloo standing in for
    NCCL the control collectives and the engine (its mesh inherits both backends) run on it unchanged."""
    backend = process_group_backend(torch.device("cuda"))
    assert backend == "cpu:gloo,cuda:nccl" and process_group_backend(torch.device("cpu")) == "gloo"
    stand_in = backend.replace("nccl", "gloo")
    assert run_distributed(_agree_on_cpu, 2, backend=stand_in, timeout=60) == [True, True]
    losses = run_distributed(_train_steps, 2, {}, backend=stand_in, timeout=120)
    assert losses == run_distributed(_train_steps, 2, {}, timeout=120)


def test_stop_flag_values_sum_to_the_agreed_signal() -> None:
    from hpctrain.train.preemption import StopFlag

    term, usr2, idle = StopFlag(), StopFlag(), StopFlag()
    term.signum, usr2.signum = signal.SIGTERM, signal.SIGUSR2
    summed = [sum(v) for v in zip(term.control_values(), usr2.control_values(), idle.control_values())]
    assert StopFlag.agreed(summed) == signal.SIGUSR2  # USR2 (requeue) wins over TERM
    assert StopFlag.agreed([0.0, 2.0]) == signal.SIGTERM and StopFlag.agreed(idle.control_values()) is None


def test_straggler_probes_travel_as_each_ranks_own_slots(monkeypatch) -> None:
    """Summed over ranks, the probe block holds every rank's probe: rank 0 judges without a gather."""
    from hpctrain.config.schema import Config
    from hpctrain.health import monitor as monitor_module

    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"health": {"straggler_every": 2, "straggler_patience": 1}})
    hosts = [f"n{r}" for r in range(6)]
    monitors = [monitor_module.RunMonitor(cfg.health, r, torch.device("cpu"), hosts) for r in range(6)]
    for r, mon in enumerate(monitors):
        monkeypatch.setattr(monitor_module, "matmul_seconds", lambda device, repeats, r=r: 0.05 if r == 4 else 0.01)
        assert mon.control_values(1) == []  # not a probe step: nothing travels
        blocks = mon.control_values(2)
        assert len(blocks) == 12 and [i for i, v in enumerate(blocks) if v] == [2 * r]
        mon._block = blocks
    summed = [sum(vals) for vals in zip(*(m._block for m in monitors))]
    _, events = monitors[0].after_step(2, 0.1, summed)
    assert [(e["event"], e["rank"], e["host"]) for e in events] == [("straggler", 4, "n4")]
