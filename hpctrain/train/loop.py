"""The training loop that runs on every task, under the local executor and under Slurm alike.

environment (ranks, variables, process group) -> engine (mesh, model, layout) -> checkpoint (resume) ->
steps (data, step, metrics, periodic save) -> tracking. Nothing here imports the launch side.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config.layout import resolve_layout
from hpctrain.config.schema import TIMEOUT_MARGIN_S, Config, DataKind
from hpctrain.data.sampler import SampleIndex, micro_batches, step_samples
from hpctrain.data.sources import open_tokens
from hpctrain.distributed.environment import discover, init_distributed, shutdown, task_device
from hpctrain.distributed.task_env import task_environment
from hpctrain.health.monitor import RunMonitor
from hpctrain.health.preflight import UnhealthyNodes, run_preflight
from hpctrain.health.watchdog import Watchdog
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.metrics import mfu, peak_memory_gb
from hpctrain.parallel.precision import configure_device_math
from hpctrain.tracking.tracker import Tracker
from hpctrain.train.failure import record_failure, record_hosts
from hpctrain.train.control import StepControl
from hpctrain.train.faults import Fault
from hpctrain.train.preemption import (
    REASONS,
    StopFlag,
    agree_any,
    requeue_slurm_job,
    wait_to_be_ended,
)
from hpctrain.train.progress import Progress
from hpctrain.train.schedule import lr_at

log = logging.getLogger("hpctrain")


def load_config(config: dict[str, Any]) -> Any:
    """Rebuild the typed config on the task from the plain dict the launcher pickled."""
    return OmegaConf.merge(OmegaConf.structured(Config), config)


def train(config: dict[str, Any], run_dir: str) -> dict[str, Any]:
    cfg = load_config(config)
    os.environ.update(task_environment(cfg))
    torch.set_num_threads(cfg.train.threads_per_rank)
    env = discover()
    device = task_device(env.local_rank)
    if device.type == "cuda":  # NCCL reads these when its communicators start: set them before
        os.environ.update(node_nccl_environment(cfg, env.local_rank))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[rank{env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("submitit").propagate = False  # submitit prints its own lines already
    log.info("task rank %d/%d local %d on %s (job %s), rendezvous %s:%d", env.rank, env.world_size,
             env.local_rank, env.hostname, env.job_id, env.master_addr, env.master_port)
    init_distributed(env, device, timeout_s=cfg.launcher.collective_timeout_s)
    try:
        return _train(cfg, Path(run_dir), env)
    except UnhealthyNodes as exc:  # the supervisor resubmits without the nodes named here
        record_failure(Path(run_dir), env.job_id, env.rank, 0, exc, peer=False, blame=exc.hosts)
        raise
    finally:
        shutdown()


class Preempted(Exception):
    """Training stopped at a step boundary on a signal, after a checkpoint; the job was requeued if possible."""


def fingerprint(cfg: Any) -> dict[str, Any]:
    """What must match for a resume to continue exactly (the model must match for it to load at all)."""
    m, d = cfg.model, cfg.data
    return {
        "model": [m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.context, m.ffn_mult],
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed,
        "data": [d.kind.value, d.path if d.kind != DataKind.text_bytes else d.max_bytes],
    }


def _train(cfg: Any, run_dir: Path, env: Any) -> dict[str, Any]:
    layout = resolve_layout(cfg)
    if layout.world_size != env.world_size:
        raise RuntimeError(f"the job has {env.world_size} tasks but the layout needs {layout.world_size}")
    device = task_device(env.local_rank)
    configure_device_math(bool(cfg.precision.tf32), device)
    hosts = _record_hosts(run_dir, env)
    # Started before the pre-flight (whose collectives can hang too), with a limit below the collective
    # timeout: it must fire before NCCL's own watchdog, to leave stacks, the flight recorder and a record.
    watchdog = Watchdog(run_dir, env.job_id, env.rank, cfg.health.hang_timeout_s, cfg.health.hang_factor,
                        cfg.health.startup_timeout_s,
                        ceiling_s=cfg.launcher.collective_timeout_s - TIMEOUT_MARGIN_S).start()
    run_preflight(cfg, env.rank, env.local_rank, env.job_id, run_dir, device)
    stop, tracker, stats, done = StopFlag(), None, None, 0
    try:  # from here every error leaves a failure record: start-up (engine, resume) as much as the steps
        monitor = RunMonitor(cfg, env.rank, device, hosts)
        engine = build_engine(cfg, layout, device)
        run_id = str(cfg.run.id)
        ckpt = CheckpointManager(cfg, run_dir, run_id, env.rank, env.world_size, env.local_rank, fingerprint(cfg),
                                 device)
        manifest = ckpt.resume(engine)
        start_step = done = int(manifest["step"]) if manifest else 0
        consumed = int(manifest["consumed_samples"]) if manifest else 0
        if manifest:
            log.info("resuming at step %d (%d samples consumed) from %s tier", start_step, consumed,
                     manifest["tier"])
        data = SampleIndex(open_tokens(cfg.data), cfg.train.seq_len, cfg.train.seed, cfg.data.vocab_size)
        if env.is_main:
            tracker = Tracker(cfg, run_dir, run_id, OmegaConf.to_container(cfg, resolve=True))
            for e in ckpt.events:  # what the resume did: the tier used and the ones skipped, and why
                tracker.event(e.pop("event"), **e)
            ckpt.events.clear()
        t = cfg.train
        tokens_per_step = layout.global_batch * t.seq_len
        progress = Progress(total_steps=t.max_steps, start_step=start_step)
        fault = Fault.from_env()
        control = StepControl(stop, ckpt, monitor)
        stop.install()
        for step in range(start_step, t.max_steps):
            started = time.perf_counter()
            if fault is not None:
                fault.maybe_fire(step + 1, env.rank, run_dir)
            samples = step_samples(consumed, layout.global_batch, engine.dp_size, engine.dp_rank)
            batches = [data.batch(r) for r in micro_batches(samples, layout.micro_batch)]
            lr = lr_at(step, cfg.optim, t.max_steps)
            stats = engine.step(batches, lr, control.values(step + 1))
            agreed = control.decode(stats.control)
            step_time = time.perf_counter() - started
            done, consumed = step + 1, consumed + layout.global_batch
            watchdog.beat(done, step_time)
            ckpt.after_step(done, engine, {"consumed_samples": consumed}, agreed.checkpoint)
            health_metrics, health_events = monitor.after_step(done, step_time, agreed.probes)
            if tracker is not None:
                metrics = {"step": done, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
                           "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                           "consumed_samples": consumed, "time": time.time(), "loss_scale": stats.loss_scale,
                           "skipped": int(stats.skipped),
                           "mfu": mfu(cfg, tokens_per_step / step_time, env.world_size),
                           "peak_mem_gb": peak_memory_gb(device)}
                metrics.update(_checkpoint_metrics(ckpt.events))
                for e in ckpt.events:
                    if e["event"] not in ("save_started", "save_committed"):
                        tracker.event(e["event"], **{k: v for k, v in e.items() if k != "event"})
                metrics.update(health_metrics)
                tracker.log(metrics)
                for e in health_events:
                    tracker.event(e.pop("event"), **e)
                line = progress.update(done, step_time, metrics)
                line += f" | MFU {metrics['mfu']:.2%} | peak mem {metrics['peak_mem_gb']:.2f} GB"
                if cfg.precision.loss_scaling:
                    line += f" | loss scale {stats.loss_scale:g}" + (" (overflow: step skipped)" if stats.skipped else "")
                if done % t.log_every == 0 or done == t.max_steps or done == start_step + 1:
                    print(line, flush=True)
            ckpt.events.clear()
            signum = agreed.signum
            if signum is not None and done < t.max_steps:
                if tracker is not None:
                    tracker.event("stop", reason=REASONS[signum], step=done)
                    tracker.close()
                    tracker = None
                _stop_for_signal(signum, ckpt, engine, done, consumed, env, device)
        ckpt.finish(done, engine, {"consumed_samples": consumed})
    except Preempted:
        raise
    except Exception as exc:  # the supervisor reads these to exclude nodes and to spot deterministic errors
        watchdog.stand_down()
        path = record_failure(run_dir, env.job_id, env.rank, done + 1, exc)
        log.error("rank %d failed at step %d: %s: %s (record: %s)", env.rank, done + 1, type(exc).__name__, exc, path)
        raise
    finally:
        watchdog.stop()
        stop.restore()
        if tracker is not None:
            tracker.close()
    return {"rank": env.rank, "steps": t.max_steps, "start_step": start_step,
            "final_loss": stats.loss if stats else None}


def _stop_for_signal(signum: int, ckpt: CheckpointManager, engine: Any, done: int, consumed: int, env: Any,
                     device: torch.device) -> None:
    """All ranks: save to the fastest tier and wait for the commit; rank 0 requeues on SIGUSR2; then stop."""
    log.warning("%s at step %d: saving and stopping", REASONS[signum], done)
    ckpt.save_now(done, engine, {"consumed_samples": consumed})
    requeued = env.is_main and signum == signal.SIGUSR2 and requeue_slurm_job()
    if agree_any(requeued, device):
        # Slurm ends every task of a requeued job; exiting first would make srun report a failure.
        wait_to_be_ended()
    raise Preempted(f"stopped at step {done} on {REASONS[signum]}; checkpoint committed")


def node_nccl_environment(cfg: Any, local_rank: int) -> dict[str, str]:
    """NCCL variables from this node's topology and InfiniBand ports, for what the config left unset."""
    from hpctrain.distributed.nccl_env import apply, nccl_environment
    from hpctrain.health.node import ib_report, topology_report

    env = nccl_environment(cfg.cluster.nccl, local_rank, topology_report(), ib_report())
    chosen = apply(env, {k: v for k, v in os.environ.items() if k not in task_environment(cfg)})
    log.info("NCCL environment from the node: %s", chosen)
    return chosen


def _record_hosts(run_dir: Path, env: Any) -> list[str]:
    """Every rank's host, by rank (once at start-up), for the supervisor and for naming stragglers."""
    hosts = [env.hostname]
    if dist.is_initialized():
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, env.hostname)
    if env.is_main:
        record_hosts(run_dir, env.job_id, hosts)
    return hosts


def _checkpoint_metrics(events: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for e in events:
        if e["event"] == "save_started":
            out[f"ckpt/{e['tier']}/blocked_s"] = e["blocked_s"]
        elif e["event"] == "save_committed":
            out[f"ckpt/{e['tier']}/total_s"] = e["total_s"]
            out[f"ckpt/{e['tier']}/bytes"] = e["bytes"]
        elif e["event"] == "save_skipped":
            out[f"ckpt/{e['tier']}/skipped"] = 1
    return out
