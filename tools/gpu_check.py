#!/usr/bin/env python3
"""A ready GPU check: one command that says whether hpctrain trains correctly and fast on this GPU node.

    python tools/gpu_check.py                          # on a GPU node (one GPU is enough; <= 8 min on an H200)
    python tools/gpu_check.py --cpu                    # the same checks on CPU (gloo, tiny model; the test suite)
    python tools/gpu_check.py --json out.json --keep   # also save the results; keep the logs and run directories
    python tools/gpu_check.py --only b1,b2             # some checks only

Checks (one table row each; docs/gpu_check.md says exactly what each one does):
  a   a one-rank NCCL world ("cpu:gloo,cuda:nccl") through the real train(): control plane, preflight,
      straggler probe, checkpoint save, all on step 1 onwards
  b1  GPT-3 1.3B, bf16, recompute=none, 25 steps through train(): MFU (goal >= 45%), peak memory vs the plan
  b2  the same with recompute=selective
  c   a checkpoint saved from the device and resumed into a fresh engine, compared bit for bit; with
      dropout, the resumed step's loss equals the uninterrupted run's only if the RNG streams were restored
  d   a one-rank (dp_shard, tp) mesh: TP + sequence parallel + FSDP2 with the optimizer offloaded to the CPU,
      3 steps with the engine's gradient norm and clipping on offloaded DTensor gradients
  e   two processes on the one GPU over a "cpu:gloo,cuda:gloo" group, DDP (ZeRO-0) then ZeRO-1 through
      train(): the final losses must agree within 1e-3

Each check runs in a forked process of its own (a crash, a hang or a CUDA error cannot take the table with
it) under a time limit, and reports PASS or FAIL with the first line of its error. The exit code is 1 if any
check failed. With --cpu the same checks run on the CPU: gloo instead of NCCL, the tiny model instead of 1.3B
(b only reports MFU), fp32 instead of bf16 (emulated on most CPUs), in under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"
if str(REPO) not in sys.path:  # `python tools/gpu_check.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

MFU_GOAL = 0.45
DEFAULT_BUDGET_S = {"gpu": 470.0, "cpu": 300.0}  # the whole run: under 8 minutes on one H200
EXIT_HANG = 3  # hpctrain.health.watchdog.EXIT_HANG: the watchdog saw no step completing


# ---------------------------------------------------------------------------------------------------------
# What a check gets and gives back


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


# ---------------------------------------------------------------------------------------------------------
# Configs, process groups, runs


def compose(ctx: Ctx, overrides: list[str]) -> dict[str, Any]:
    """The config as the launcher builds it: Hydra composition against the schema, then hpctrain's checks."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from hpctrain.config.checks import check_config
    from hpctrain.config.schema import register

    register()
    with initialize_config_dir(version_base=None, config_dir=str(CONF_DIR)):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check_config(cfg)  # raises ConfigError naming the key and the fix
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def common_overrides(ctx: Ctx, name: str, world: int, gpu_type: str | None = None) -> list[str]:
    startup = max(30, int(ctx.timeout_s) - 20)  # a hang dumps its stacks (hangs/ in the run dir) before the kill
    return [f"run.root={ctx.workdir}", "run.name=gpu_check", f"run.id={name}", "cluster=local", "cluster.nodes=1",
            f"cluster.gpus_per_node={world}", f"cluster.gpu_type={gpu_type or ctx.gpu_type}", "tracking=disabled",
            "health.hang_timeout_s=60", f"health.startup_timeout_s={startup}", "train.log_every=1"]


def small_overrides(ctx: Ctx, name: str, world: int, steps: int, gpu_type: str | None = None) -> list[str]:
    """The tiny GPT (4 layers, d 128) on synthetic tokens: the plumbing, not the speed."""
    return [*common_overrides(ctx, name, world, gpu_type), "model=tiny", "data=synthetic", "data.vocab_size=256",
            f"precision={precision(ctx)}", "train.seq_len=128", "train.global_batch=8",
            f"train.micro_batch={4 // world}",
            f"train.max_steps={steps}", "optim.lr=2e-3", "optim.warmup_steps=1",
            f"health.allreduce_mb={1 if ctx.cpu else 16}"]


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

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kwargs: dict[str, Any] = {}
    if not ctx.cpu:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if "nccl" in backend:
            kwargs["device_id"] = device  # NCCL communicators start now, as hpctrain's init_distributed does
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(60.0, ctx.timeout_s)), **kwargs)


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
    path = run_dir / "metrics.jsonl"
    expect(path.is_file(), f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---------------------------------------------------------------------------------------------------------
# a. one-rank world through train()


def check_a(ctx: Ctx) -> Outcome:
    steps = 4 if ctx.cpu else 6
    tier = "checkpoint.tiers=[{name: shared, path: checkpoints, interval_steps: 2, keep_last: 2}]"
    config = compose(ctx, [*small_overrides(ctx, "a_one_rank", 1, steps), "checkpoint=default", tier,
                           "health.straggler_every=2", "health.preflight=warn"])
    run_dir = ctx.workdir / "a_one_rank"
    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    result = run_train(config, run_dir)  # destroys the group when it ends
    metrics = read_metrics(run_dir)
    from hpctrain.checkpoint.layout import committed_in

    saved = [c.step for c in committed_in(run_dir / "checkpoints")]
    losses = [m["loss"] for m in metrics]
    expect(finite(result.get("final_loss")), f"final loss {result.get('final_loss')}")
    expect([m["step"] for m in metrics] == list(range(1, steps + 1)), f"metrics steps {[m['step'] for m in metrics]}")
    expect(saved and saved[-1] == steps, f"committed checkpoints at steps {saved}, expected the last at {steps}")
    s_per_step = statistics.median(m["step_time_s"] for m in metrics[1:]) if len(metrics) > 1 else 0.0
    numbers = {"backend": backend, "steps": steps, "first_loss": losses[0], "final_loss": losses[-1],
               "checkpoint_steps": saved, "step_time_s": s_per_step}
    return Outcome(True, f"{backend}, {steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                         f"checkpoints at {saved}, {s_per_step * 1e3:.0f} ms/step", numbers)


# ---------------------------------------------------------------------------------------------------------
# b. GPT-3 1.3B: MFU and peak memory against the plan


def check_b(ctx: Ctx, recompute: str) -> Outcome:
    import torch

    from hpctrain.config.layout import resolve_layout
    from hpctrain.plan.estimate import estimate
    from hpctrain.train.loop import load_config

    name = f"b_{recompute}"
    if ctx.cpu:  # the tiny model: the script's own logic; MFU is only reported
        steps = 8
        overrides = [*small_overrides(ctx, name, 1, steps)]
    else:
        steps, mb = ctx.steps, ctx.micro_batch
        overrides = [*common_overrides(ctx, name, 1), "model=gpt3_1.3b", "data=synthetic", "precision=bf16",
                     "train.seq_len=2048", f"train.micro_batch={mb}", f"train.global_batch={2 * mb}",
                     f"train.max_steps={steps}", "optim.lr=3e-4", "optim.warmup_steps=5",
                     "health.straggler_every=0"]
    overrides += ["checkpoint=none", f"parallel.recompute={recompute}", "health.preflight=off"]
    config = compose(ctx, overrides)
    cfg = load_config(config)  # the typed config, composed as the loop does from the same dict
    planned = estimate(cfg, resolve_layout(cfg)).memory
    if not ctx.cpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    result = run_train(config, ctx.workdir / name)
    torch_peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if not ctx.cpu else None
    metrics = read_metrics(ctx.workdir / name)
    expect(len(metrics) == steps, f"{len(metrics)} steps recorded, expected {steps}")
    expect(finite(result.get("final_loss")), f"final loss {result.get('final_loss')}")
    later = [m for m in metrics if m["step"] > 5] or metrics[1:] or metrics  # after the warm-up steps
    mfu = statistics.median(m["mfu"] for m in later)
    step_s = statistics.median(m["step_time_s"] for m in later)
    measured = max(m["peak_mem_gb"] for m in metrics)  # GiB: CUDA max allocated (max RSS on CPU)
    planned_gib = planned.total / 2**30
    tokens = cfg.train.global_batch * cfg.train.seq_len
    numbers = {"model": cfg.model.name, "recompute": recompute, "micro_batch": cfg.train.micro_batch,
               "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len, "steps": steps,
               "gpu_type": cfg.cluster.gpu_type, "mfu_median": mfu, "mfu_goal": None if ctx.cpu else ctx.mfu_goal,
               "step_time_s": step_s, "tokens_per_s": tokens / step_s, "final_loss": result.get("final_loss"),
               "peak_mem_gib_measured": measured, "peak_mem_gib_torch": torch_peak,
               "peak_mem_gib_planned": planned_gib, "planned_usable_gib": planned.usable / 2**30,
               "measured_over_planned": measured / planned_gib if planned_gib else None}
    ok = ctx.cpu or mfu >= ctx.mfu_goal
    summary = (f"{cfg.model.name} {cfg.train.micro_batch}x{cfg.train.seq_len}: MFU {mfu:.1%}"
               + ("" if ctx.cpu else f" (goal {ctx.mfu_goal:.0%})")
               + f", {tokens / step_s:,.0f} tok/s, peak {measured:.2f} GiB measured / {planned_gib:.2f} GiB "
               f"planned = {measured / planned_gib:.2f}")
    if ctx.cpu:
        summary += " (CPU: max RSS)"
    return Outcome(ok, summary, numbers)


# ---------------------------------------------------------------------------------------------------------
# c. a checkpoint saved from the device, resumed, compared bit for bit


def cpu_copy(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A flat deep copy of a state dict, tensors on the CPU (DTensors gathered), keyed by path."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(cpu_copy(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(cpu_copy(v, f"{prefix}{i}/"))
    elif isinstance(tree, torch.Tensor):
        t = tree.full_tensor() if isinstance(tree, DTensor) else tree
        out[prefix.rstrip("/")] = t.detach().to("cpu", copy=True)
    else:
        out[prefix.rstrip("/")] = copy.deepcopy(tree)
    return out


def bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def differences(saved: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(loaded))
    return [k for k in keys if k not in saved or k not in loaded or not bitwise_equal(saved[k], loaded[k])]


def check_c(ctx: Ctx) -> Outcome:
    """Through the real loop: run A trains 3 steps and saves (the engine's state is copied to the CPU inside
    the save's own state_dict() call); run B resumes A's run directory into a fresh engine (weights from the
    seed) and trains step 4; run C trains 4 steps without interruption. The state B loaded must equal A's
    saved copy bit for bit, and B's step-4 loss must equal C's."""
    import torch

    from hpctrain.train import loop

    save_at, steps = 3, 4
    tier = (f"checkpoint.tiers=[{{name: fast, path: {ctx.workdir / 'c_tier'}, interval_steps: {save_at}, "
            "keep_last: 2}]")

    def config(name: str, max_steps: int) -> dict[str, Any]:
        # A constant lr: the 3-step run A and the 4-step runs B and C take the same first 3 steps. Dropout:
        # step 4's masks come from the generator the checkpoint restored (the CUDA one on a GPU).
        return compose(ctx, [*small_overrides(ctx, name, 1, max_steps), "checkpoint=default", tier,
                             "checkpoint.save_final=false", "optim.decay=constant", "model.dropout=0.1"])

    seen: dict[str, Any] = {"saved": [], "before_load": None, "after_load": None, "fresh": None}
    original = loop.build_engine

    def capturing(cfg: Any, layout: Any, device: Any) -> Any:  # the loop's own engine, observed
        engine = original(cfg, layout, device)
        state_dict, load_state_dict = engine.state_dict, engine.load_state_dict
        if seen["before_load"] is not None:  # runs B and C: the weights from the seed, read from the parameters:
            # engine.state_dict() on a fresh engine would initialise AdamW's state (torch runs a zero-lr step, so
            # the step count starts at 1 and the run changes), and DCP loads in place into its tensors.
            seen["fresh"] = {f"model/{name.removeprefix('module.')}": p.detach().to("cpu", copy=True)
                             for part in getattr(engine, "model_parts", []) for name, p in part.named_parameters()}

        def saving_state_dict() -> dict[str, Any]:
            state = state_dict()
            if seen["before_load"] is None:  # run A: this call is the save's, staged right after this copy
                seen["saved"].append(cpu_copy(state))
            return state

        def observed_load(state: dict[str, Any]) -> None:
            seen["before_load"] = seen["fresh"]
            load_state_dict(state)
            seen["after_load"] = cpu_copy(state_dict())

        engine.state_dict, engine.load_state_dict = saving_state_dict, observed_load
        return engine

    loop.build_engine = capturing
    run_dir = ctx.workdir / "c_checkpoint"
    try:
        for name, max_steps, where in (("c_checkpoint", save_at, run_dir), ("c_checkpoint", steps, run_dir),
                                       ("c_uninterrupted", steps, ctx.workdir / "c_uninterrupted")):
            init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
            run_train(config(name, max_steps), where)
            if max_steps == save_at:
                expect(len(seen["saved"]) == 1, f"run A called state_dict() {len(seen['saved'])} times, expected "
                                                "once (its save at step 3)")
                seen["before_load"] = False  # from here on, state_dict() calls are not saves
    finally:
        loop.build_engine = original
    saved, before, after = seen["saved"][0], seen["before_load"], seen["after_load"]
    expect(isinstance(after, dict), "run B did not load a checkpoint")
    changed_by_training = sum(1 for k, v in before.items() if k in saved and not bitwise_equal(saved[k], v))
    expect(changed_by_training > 0, "the saved weights equal the fresh engine's: the comparison would prove nothing")
    diff = differences(saved, after)
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    n_bytes = sum(saved[k].numel() * saved[k].element_size() for k in tensors)
    optim_tensors = sum(1 for k in tensors if k.startswith("optim/"))
    expect(optim_tensors > 0, "the saved state holds no optimizer tensors")
    expect(not diff, f"{len(diff)} of {len(saved)} entries differ after the resume, e.g. {diff[:3]}")
    resumed = read_metrics(run_dir)
    uninterrupted = {m["step"]: m for m in read_metrics(ctx.workdir / "c_uninterrupted")}
    last = resumed[-1]
    expect(last["step"] == steps and last["consumed_samples"] == uninterrupted[steps]["consumed_samples"],
           f"the resumed run ended at step {last['step']} with {last['consumed_samples']} samples consumed")
    expect(last["loss"] == uninterrupted[steps]["loss"],
           f"step {steps} loss {last['loss']!r} after the resume != {uninterrupted[steps]['loss']!r} without one")
    numbers = {"saved_step": save_at, "entries": len(saved), "tensors": len(tensors),
               "optimizer_tensors": optim_tensors,
               "bytes": n_bytes, "weights_changed_by_training": changed_by_training, "step4_loss": last["loss"]}
    return Outcome(True, f"step {save_at}: {len(tensors)} tensors ({optim_tensors} optimizer, {n_bytes / 1e6:.1f} MB)"
                         f" bitwise equal after resume; step {steps} loss = uninterrupted run's ({last['loss']:.4f})",
                   numbers)


# ---------------------------------------------------------------------------------------------------------
# d. TP + SP + FSDP2 with CPU offload on a one-rank mesh, the engine's norm and clipping


def grad_norm_and_clip(params: list[Any], max_norm: float, device: Any) -> float:
    """The engine's global gradient norm, then its clipping; returns the norm before clipping.

    As the engine does it: Partial TP gradients reduced, this rank's share of the squared norm moved to the
    engine's device (the gradients are CPU DTensors under offload, the groups NCCL), one all-reduce."""
    import torch.distributed as dist

    from hpctrain.parallel import clipping

    clipping.reduce_partial_grads_(params)
    share = clipping.squared_norm_share(params, dist.get_world_size(), device)
    dist.all_reduce(share)
    norm = float(share.sqrt())
    clipping.clip_grads_(params, max_norm, norm)
    return norm


def check_d(ctx: Ctx) -> Outcome:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpctrain.models.gpt import GPT, gpt_args
    from hpctrain.parallel.data_parallel import apply_fsdp
    from hpctrain.parallel.engine import build_optimizer
    from hpctrain.parallel.tensor_parallel import apply_tp
    from hpctrain.train.loop import load_config

    max_norm = 0.01  # far below the tiny model's gradient norm: every step really scales the CPU gradients
    config = compose(ctx, [*small_overrides(ctx, "d_tp_fsdp_offload", 1, 3), "zero=stage2_offload",
                           f"optim.grad_clip={max_norm}"])
    cfg = load_config(config)
    expect(bool(cfg.zero.offload_optimizer), "zero.offload_optimizer is not set")
    init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
    device = ctx.device
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp_shard", "tp"))
    with torch.device("meta"):
        gpt = GPT(gpt_args(cfg))
    apply_tp(gpt, mesh["tp"], sequence_parallel=True)
    apply_fsdp(gpt, mesh["dp_shard"], cfg, reshard_after_forward=True)
    gpt.to_empty(device="cpu")  # offload: FSDP2 keeps the sharded parameters on the CPU
    gpt.init_weights(seed=cfg.train.seed)
    optimizer = build_optimizer(gpt.parameters(), cfg)
    params = list(gpt.parameters())
    expect(all(isinstance(p, DTensor) for p in params), "some parameters are not DTensors after TP + FSDP2")
    where = sorted({p.to_local().device.type for p in params})
    expect(where == ["cpu"], f"parameters live on {where}, expected the CPU (offload)")
    vocab, seq = cfg.model.vocab_size, cfg.train.seq_len
    tokens = torch.randint(0, vocab, (4, seq + 1), generator=torch.Generator().manual_seed(cfg.train.seed))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # one batch, three times: the loss must fall
    losses, norms, after = [], [], []
    grad_devices: set[str] = set()
    for _ in range(3):
        logits = gpt(x)
        loss = F.cross_entropy(logits[..., :vocab].reshape(-1, vocab).float(), y.reshape(-1))
        loss.backward()
        grad_devices |= {(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).device.type
                         for p in params if p.grad is not None}
        norm = grad_norm_and_clip(params, max_norm, device)
        after.append(grad_norm_and_clip(params, 0.0, device))  # max_norm 0: measures, does not clip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm)
    expect(all(math.isfinite(v) for v in losses + norms), f"losses {losses}, gradient norms {norms}")
    expect("cpu" in grad_devices, f"gradients on {sorted(grad_devices)}: the offload path was not exercised")
    for n, a in zip(norms, after):
        if n > max_norm:
            expect(abs(a - max_norm) <= 1e-3 * max_norm + 1e-7, f"norm {n:.4g} clipped to {a:.6g}, expected {max_norm}")
    decreased = losses[-1] < losses[0]
    numbers = {"losses": losses, "grad_norms": norms, "clipped_norms": after, "max_norm": max_norm,
               "loss_decreased": decreased, "param_device": where, "grad_devices": sorted(grad_devices),
               "mesh_device": device.type}
    return Outcome(True, f"3 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                         f"{'' if decreased else ' (did not decrease)'}, grad norm {norms[0]:.3g} clipped to "
                         f"{after[0]:.3g} on {'/'.join(sorted(grad_devices))} gradients", numbers)


# ---------------------------------------------------------------------------------------------------------
# e. two processes on one device, gloo for CUDA tensors: DDP and ZeRO-1 agree


def _e_worker(ctx: Ctx, rank: int, configs: dict[int, dict[str, Any]], ports: dict[int, int], out: Path) -> None:
    """One rank: DDP then ZeRO-1 through train(), each in a process group of its own."""
    import torch

    record: dict[str, Any] = {"rank": rank, "final_loss": {}}
    try:
        backend = "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo"  # NCCL refuses two ranks on one GPU
        for stage, config in configs.items():
            init_world(ctx, rank, 2, ports[stage], backend)
            record["device"] = "cpu" if ctx.cpu else torch.cuda.get_device_name()
            result = run_train(config, ctx.workdir / f"e_zero{stage}")
            record["final_loss"][str(stage)] = result.get("final_loss")
            destroy_world()
        record["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which prints it
        traceback.print_exc()
        record.update(ok=False, error=first_line(exc))
    _write_json(out, record)


def check_e(ctx: Ctx) -> Outcome:
    steps = 4
    # gpu_type=cpu: the local executor's check (one task per GPU) forbids 2 tasks on 1 GPU, which is the point
    # here; train() takes the GPU whatever gpu_type says (it only sets the MFU peak, unused here).
    configs = {stage: compose(ctx, [*small_overrides(ctx, f"e_zero{stage}", 2, steps, "cpu"), f"zero=stage{stage}",
                                    "checkpoint=none", "health.straggler_every=2"])
               for stage in (0, 1)}
    ports = {0: free_port(), 1: free_port()}
    while ports[1] == ports[0]:
        ports[1] = free_port()
    deadline = time.monotonic() + ctx.timeout_s - 10
    outs = [ctx.workdir / f"e_rank{r}.json" for r in range(2)]
    pids = [fork_call(lambda r=r: _e_worker(ctx, r, configs, ports, outs[r]), ctx.workdir / f"e_rank{r}.log",
                      new_group=False) for r in range(2)]
    status = wait_all(pids, deadline, grace_s=10)
    records = [_read_json(p) for p in outs]
    for r, (rec, st) in enumerate(zip(records, status)):
        if rec is None or not rec.get("ok"):
            detail = rec.get("error") if rec else describe_exit(st, ctx.workdir / f"e_rank{r}.log")
            raise CheckFailed(f"rank {r}: {detail}")
    losses = {int(k): v for k, v in records[0]["final_loss"].items()}
    expect(all(finite(v) for v in losses.values()), f"final losses {losses}")
    expect(records[1]["final_loss"] == records[0]["final_loss"],
           f"ranks disagree on the final loss: {records[0]['final_loss']} vs {records[1]['final_loss']}")
    gap = abs(losses[0] - losses[1])
    expect(gap <= 1e-3, f"DDP final loss {losses[0]:.6f} vs ZeRO-1 {losses[1]:.6f}: differ by {gap:.2e} > 1e-3")
    backend = "gloo" if ctx.cpu else "cpu:gloo,cuda:gloo"
    ctx.device_name = records[0].get("device", ctx.device_name)
    numbers = {"backend": backend, "device": ctx.device_name, "steps": steps, "final_loss_ddp": losses[0],
               "final_loss_zero1": losses[1],
               "difference": gap}
    return Outcome(True, f"2 ranks, {backend}, {steps} steps: DDP loss {losses[0]:.5f}, ZeRO-1 {losses[1]:.5f}, "
                         f"|diff| {gap:.1e}", numbers)


# ---------------------------------------------------------------------------------------------------------
# Running checks in processes of their own


@dataclass(frozen=True)
class Check:
    key: str
    title: str
    fn: Callable[[Ctx], Outcome]
    timeout_gpu_s: float
    timeout_cpu_s: float
    # False: the check forks processes that use the GPU, so it must not initialise CUDA itself (a forked
    # child cannot use CUDA after its parent did); its ranks find the device.
    uses_cuda: bool = True
    cpu_title: str = ""  # the title with --cpu, where it differs

    def title_for(self, cpu: bool) -> str:
        return self.cpu_title if cpu and self.cpu_title else self.title


CHECKS = [
    Check("a", "one-rank NCCL world through train()", check_a, 150, 60,
          cpu_title="one-rank gloo world through train()"),
    Check("b1", "1.3B bf16, recompute=none: MFU, memory", lambda ctx: check_b(ctx, "none"), 200, 60,
          cpu_title="tiny, recompute=none: MFU, memory"),
    Check("b2", "1.3B bf16, recompute=selective", lambda ctx: check_b(ctx, "selective"), 200, 60,
          cpu_title="tiny, recompute=selective"),
    Check("c", "checkpoint save/resume bitwise", check_c, 150, 60),
    Check("d", "TP+SP + FSDP2 CPU offload, clipping", check_d, 150, 60),
    Check("e", "2 ranks on 1 device: DDP vs ZeRO-1", check_e, 240, 120, uses_cuda=False),
]


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def fork_call(fn: Callable[[], None], log_path: Path, new_group: bool = True) -> int:
    """fn() in a forked child whose stdout and stderr go to log_path; the child's pid (its own process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            if new_group:
                os.setpgid(0, 0)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            # Python's streams onto the log too, whatever they were (pytest's capture, for one).
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            fn()
            code = 0
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    if new_group:
        try:
            os.setpgid(pid, pid)  # also from the parent: no race with a kill right after the fork
        except OSError:
            pass
    return pid


def wait_all(pids: list[int], deadline: float, grace_s: float = 0.0, group: bool = False) -> list[int | None]:
    """Exit statuses (os.waitpid's) of our own children; the ones still running at the deadline, or `grace_s`
    after another one failed, are killed (by pid; with `group`, with the process group they lead) and get None."""
    status: list[int | None] = [None] * len(pids)
    running = set(range(len(pids)))
    while running and time.monotonic() < deadline:
        for i in list(running):
            done, st = os.waitpid(pids[i], os.WNOHANG)
            if done:
                status[i] = st
                running.discard(i)
                if st != 0 and grace_s:
                    deadline = min(deadline, time.monotonic() + grace_s)
        if running:
            time.sleep(0.05)
    for i in running:
        _kill(pids[i], group=group)
    return status


def _kill(pid: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)  # the child and what it started (check e's two ranks)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def describe_exit(status: int | None, log_path: Path) -> str:
    if status is None:
        what = "timed out and was killed"
    elif os.WIFSIGNALED(status):
        what = f"died of signal {os.WTERMSIG(status)}"
    elif os.WEXITSTATUS(status) == EXIT_HANG:
        what = "was stopped by hpctrain's hang watchdog (stacks under <run dir>/hangs/)"
    else:
        what = f"exited with code {os.WEXITSTATUS(status)} without a result"
    try:
        lines = [s for s in log_path.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        lines = []
    return f"the check process {what}" + (f"; last log line: {lines[-1].strip()[:200]}" if lines else "")


def resolve_gpu_type(ctx: Ctx) -> None:
    """Fill in the device name and, with --gpu-type auto, the config's gpu_type for the MFU peak."""
    import torch

    if ctx.cpu:
        ctx.device_name, ctx.gpu_type = "cpu", "cpu"
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: run on a GPU node, or use --cpu")
    props = torch.cuda.get_device_properties(0)
    ctx.device_name = props.name
    if ctx.gpu_type == "auto":
        name = props.name.upper()
        if "H200" in name:
            ctx.gpu_type = "h200"
        elif "H100" in name:
            ctx.gpu_type = "h100_80gb"
        elif "A100" in name:
            ctx.gpu_type = "a100_80gb" if props.total_memory > 50 * 2**30 else "a100_40gb"
        else:
            ctx.gpu_type = "h200"
            print(f"unknown GPU {props.name!r}: MFU is computed against the H200's peak (use --gpu-type)",
                  flush=True)


def _child(check: Check, ctx: Ctx, result_path: Path) -> None:
    """Inside the forked process: run one check, write its result."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    record: dict[str, Any] = {"ok": False, "summary": "", "numbers": {}, "error": None}
    try:
        if check.uses_cuda or ctx.cpu:
            resolve_gpu_type(ctx)
        else:
            ctx.device_name = "?"
            ctx.gpu_type = "cpu"  # its ranks report the device; see check_e
        record["device"] = ctx.device_name
        outcome = check.fn(ctx)
        record.update(ok=bool(outcome.ok), summary=outcome.summary, numbers=outcome.numbers)
    except BaseException as exc:  # noqa: BLE001 - the table must always print
        traceback.print_exc()
        record.update(error=first_line(exc), traceback=traceback.format_exc())
    finally:
        try:
            destroy_world()
        except Exception:  # noqa: BLE001
            pass
    record["device"] = ctx.device_name
    _write_json(result_path, record)


def run_check(check: Check, ctx: Ctx, deadline: float) -> dict[str, Any]:
    started = time.monotonic()
    remaining = deadline - started
    limit = min(check.timeout_cpu_s if ctx.cpu else check.timeout_gpu_s, remaining)
    log_path = ctx.workdir / f"{check.key}.log"
    row: dict[str, Any] = {"check": check.key, "title": check.title_for(ctx.cpu), "result": "FAIL", "seconds": 0.0,
                           "summary": "", "numbers": {}, "error": None, "log": str(log_path)}
    if remaining < 5:
        row["error"] = "skipped: the time budget (--budget) is spent"
        return row
    child_ctx = copy.copy(ctx)
    child_ctx.timeout_s = limit
    result_path = ctx.workdir / f"{check.key}.result.json"
    result_path.unlink(missing_ok=True)
    pid = fork_call(lambda: _child(check, child_ctx, result_path), log_path)
    status = wait_all([pid], started + limit, group=True)[0]  # a check that overran: killed with its ranks
    row["seconds"] = time.monotonic() - started
    record = _read_json(result_path)
    if record is None:
        row["error"] = describe_exit(status, log_path)
        return row
    row.update(result="PASS" if record["ok"] and not record.get("error") else "FAIL",
               summary=record.get("summary", ""), numbers=record.get("numbers", {}), error=record.get("error"),
               device=record.get("device"))
    if record.get("traceback"):
        row["traceback"] = record["traceback"]
    return row


# ---------------------------------------------------------------------------------------------------------
# The table


def table(rows: list[dict[str, Any]]) -> str:
    header = ("check", "what", "result", "seconds", "key numbers")
    lines = []
    width = max(len(header[1]), *(len(r["title"]) for r in rows)) if rows else len(header[1])
    lines.append(f"{header[0]:<5}  {header[1]:<{width}}  {header[2]:<6}  {header[3]:>7}  {header[4]}")
    for r in rows:
        text = r["summary"] or ""
        if r["error"]:
            text = (text + "; " if text else "") + r["error"]
        elif r["result"] == "FAIL" and not text:
            text = "failed"
        lines.append(f"{r['check']:<5}  {r['title']:<{width}}  {r['result']:<6}  {r['seconds']:>7.1f}  {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, the tiny model): the test suite")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--only", help="comma-separated checks to run (a,b1,b2,c,d,e; b = b1,b2)")
    parser.add_argument("--workdir", type=Path, help="keep run directories and logs in a new directory inside "
                        "this one (default: a temporary directory, removed when every check passed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--gpu-type", default="auto", help="conf/cluster gpu_type for the MFU peak "
                        "(default: from the device name; h200, h100_80gb, a100_80gb, a100_40gb)")
    parser.add_argument("--micro-batch", type=int, default=8, help="check b: sequences of 2048 tokens per "
                        "micro-batch (default 8; the global batch is twice that)")
    parser.add_argument("--steps", type=int, default=25, help="check b: steps per run (MFU: median after step 5)")
    parser.add_argument("--mfu-goal", type=float, default=MFU_GOAL, help="check b fails below this MFU (GPU)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (default 470 on GPU, 300 on CPU);"
                        " checks that would start after it are reported as FAIL")
    args = parser.parse_args(argv)

    mode = "cpu" if args.cpu else "gpu"
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # --cpu is CPU only, even on a GPU node
    # This process forks the checks, which then use the GPU: it must never initialise CUDA itself, and should
    # anything ask torch.cuda.is_available() here, NVML answers without initialising it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    for var in ("SUBMITIT_EXECUTOR", "SLURM_PROCID", "TORCHELASTIC_RUN_ID"):  # this process is the whole job
        os.environ.pop(var, None)
    os.environ.setdefault("WANDB_MODE", "disabled")
    selected = CHECKS
    if args.only:
        wanted = {k.strip() for k in args.only.split(",") if k.strip()}
        if "b" in wanted:
            wanted |= {"b1", "b2"}
        unknown = wanted - {c.key for c in CHECKS} - {"b"}
        if unknown:
            parser.error(f"unknown check(s) {sorted(unknown)}; known: {[c.key for c in CHECKS]}")
        selected = [c for c in CHECKS if c.key in wanted]

    started = time.monotonic()
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[mode]
    temporary = args.workdir is None
    if not temporary:  # a fresh directory per run inside it: run directories of an earlier run would be resumed
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}-",
                                    dir=None if temporary else args.workdir)).resolve()
    ctx = Ctx(cpu=args.cpu, workdir=workdir, gpu_type=args.gpu_type, micro_batch=args.micro_batch,
              steps=args.steps, mfu_goal=args.mfu_goal)

    # Import once here, so that every forked check starts warm. CUDA is never touched in this process
    # (a forked child could not use it after that); a broken import shows in every check's row.
    try:
        import torch

        import hpctrain.parallel.engine
        import hpctrain.train.loop  # noqa: F401
        torch_version = torch.__version__
    except Exception as exc:  # noqa: BLE001
        torch_version = "?"
        print(f"import failed: {first_line(exc)}", file=sys.stderr)

    rows = []
    for check in selected:
        row = run_check(check, ctx, started + budget)
        rows.append(row)
        print(f"[{row['check']}] {row['result']} in {row['seconds']:.1f} s", file=sys.stderr, flush=True)
    total = time.monotonic() - started
    passed = all(r["result"] == "PASS" for r in rows)
    device = next((r["device"] for r in rows if r.get("device")), "cpu" if args.cpu else "?")

    print(f"hpctrain GPU check ({mode} mode): device {device}, torch {torch_version}")
    print(table(rows))
    failed = [r["check"] for r in rows if r["result"] != "PASS"]
    if passed:
        print(f"all {len(rows)} checks passed in {total:.1f} s")
    else:
        print(f"{len(failed)} of {len(rows)} checks FAILED ({', '.join(failed)}) in {total:.1f} s")
    keep = args.keep or not temporary or not passed
    if keep:
        print(f"logs and run directories: {workdir}")
    if args.json:
        summary = {"tool": "hpctrain tools/gpu_check.py", "mode": mode, "device": device, "torch": torch_version,
                   "passed": passed, "seconds": total, "workdir": str(workdir) if keep else None,
                   "checks": [{k: v for k, v in r.items() if k != "log" or keep} for r in rows]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        _write_json(args.json, summary)
    if not keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
