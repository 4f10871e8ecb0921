"""What a check gets (Ctx) and gives back (Outcome), and the helpers every check uses: the config as the launcher
composes it, a process group on this machine, a run through the real train()."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.records.paths import RunPaths

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
MFU_GOAL = 0.45


@dataclass
class Ctx:
    cpu: bool
    workdir: Path
    gpu_type: str = "auto"  # conf/cluster gpu_type (the MFU peak); "auto": from the device name
    micro_batch: int = 8  # check b: sequences of 2048 tokens per forward/backward
    steps: int = 25  # check b: steps per run
    mfu_goal: float = MFU_GOAL
    timeout_s: float = 120.0  # this check's limit (the watchdog's startup limit is set below it)
    device_name: str = "cpu"

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu") if self.cpu else torch.device("cuda", 0)


@dataclass
class Outcome:
    ok: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)


class CheckFailed(AssertionError):
    """A check ran but its result is wrong; the message says what was expected and what came out."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def first_line(exc: BaseException) -> str:
    problems = getattr(exc, "problems", None)  # hpctrain's ConfigError: the first problem, not the count
    text = str(problems[0]) if problems else str(exc)
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------------------------------
# Configs, process groups, runs


def compose(ctx: Ctx, overrides: list[str]) -> dict[str, Any]:
    """The config as the launcher builds it: Hydra composition against the schema, then hpctrain's checks."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from hpctrain.checks.runner import check_config
    from hpctrain.config.schema import register

    register()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check_config(cfg)  # raises ConfigError naming the key and the fix
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def common_overrides(ctx: Ctx, name: str, world: int, gpu_type: str | None = None) -> list[str]:
    startup = max(30, int(ctx.timeout_s) - 20)  # a hang dumps its stacks (hangs/ in the run dir) before the kill
    return [
        f"run.root={ctx.workdir}",
        "run.name=gpu_check",
        f"run.id={name}",
        "cluster=local",
        "cluster.nodes=1",
        f"cluster.gpus_per_node={world}",
        f"cluster.gpu_type={gpu_type or ctx.gpu_type}",
        "tracking=disabled",
        "health.hang_timeout_s=60",
        f"health.startup_timeout_s={startup}",
        "train.log_every=1",
    ]


def small_overrides(
    ctx: Ctx,
    name: str,
    world: int,
    steps: int,
    gpu_type: str | None = None,
    model: str = "tiny",
    precision_name: str | None = None,
) -> list[str]:
    """The tiny GPT (4 layers, d 128; or `model`, e.g. llama_tiny) on synthetic tokens: the plumbing, not the
    speed. `precision_name`: conf/precision (default: bf16 on GPUs, fp32 with --cpu)."""
    return [
        *common_overrides(ctx, name, world, gpu_type),
        f"model={model}",
        "data=synthetic",
        "data.vocab_size=256",
        f"precision={precision_name or precision(ctx)}",
        "train.seq_len=128",
        "train.global_batch=8",
        f"train.micro_batch={4 // world}",
        f"train.max_steps={steps}",
        "optim.lr=2e-3",
        "optim.warmup_steps=1",
        f"health.allreduce_mb={1 if ctx.cpu else 16}",
    ]


def precision(ctx: Ctx) -> str:
    """bf16 on GPUs; fp32 with --cpu, where bf16 autocast is emulated on most CPUs (9x slower on 2 cores)."""
    return "fp32" if ctx.cpu else "bf16"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(ctx: Ctx, rank: int, world: int, port: int, backend: str) -> None:
    """A real process group of `world` ranks on this machine, as a launcher's task would see it."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    kwargs: dict[str, Any] = {}
    if not ctx.cpu:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if "nccl" in backend:
            kwargs["device_id"] = device  # NCCL communicators start now, as hpctrain's init_distributed does
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=max(60.0, ctx.timeout_s)),
        **kwargs,
    )


def one_rank_backend(ctx: Ctx) -> str:
    return "gloo" if ctx.cpu else "cpu:gloo,cuda:nccl"


def destroy_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_train(config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    from hpctrain.train.loop import train

    run_dir.mkdir(parents=True, exist_ok=True)
    return train(config, str(run_dir))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = RunPaths(run_dir).metrics
    expect(path.is_file(), f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
