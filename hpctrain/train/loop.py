"""The training loop that runs on every task, under the local executor and under Slurm alike.

environment (ranks, variables, process group) -> engine (mesh, model, layout) -> checkpoint (resume) ->
steps (data, step, metrics, periodic save) -> tracking. Nothing here imports the launch side.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config.layout import resolve_layout
from hpctrain.config.schema import Config
from hpctrain.data.sampler import SampleIndex, micro_batches, step_samples
from hpctrain.data.sources import open_tokens
from hpctrain.distributed.environment import discover, init_distributed, shutdown
from hpctrain.distributed.task_env import task_environment
from hpctrain.parallel.engine import build_engine
from hpctrain.tracking.tracker import Tracker
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
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"[rank{env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("submitit").propagate = False  # submitit prints its own lines already
    log.info("task rank %d/%d local %d on %s (job %s), rendezvous %s:%d", env.rank, env.world_size,
             env.local_rank, env.hostname, env.job_id, env.master_addr, env.master_port)
    init_distributed(env)
    try:
        return _train(cfg, Path(run_dir), env)
    finally:
        shutdown()


def _train(cfg: Any, run_dir: Path, env: Any) -> dict[str, Any]:
    layout = resolve_layout(cfg)
    if layout.world_size != env.world_size:
        raise RuntimeError(f"the job has {env.world_size} tasks but the layout needs {layout.world_size}")
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    engine = build_engine(cfg, layout, device)
    run_id = str(cfg.run.id)
    ckpt = CheckpointManager(cfg, run_dir, run_id, env.rank, layout.as_dict())
    start_step = 0
    latest = ckpt.latest()
    if latest is not None:
        manifest = ckpt.load(latest, engine)
        start_step = int(manifest["step"])
        log.info("resuming at step %d from %s tier (%s)", start_step, latest.tier, latest.path)

    data = SampleIndex(open_tokens(cfg.data), cfg.train.seq_len, cfg.train.seed, cfg.data.vocab_size)
    tracker = Tracker(cfg, run_dir, run_id, OmegaConf.to_container(cfg, resolve=True)) if env.is_main else None
    t = cfg.train
    tokens_per_step = layout.global_batch * t.seq_len
    progress = Progress(total_steps=t.max_steps, start_step=start_step)
    stats = None
    for step in range(start_step, t.max_steps):
        started = time.perf_counter()
        samples = step_samples(step, layout.global_batch, engine.dp_size, engine.dp_rank)
        batches = [data.batch(r) for r in micro_batches(samples, layout.micro_batch)]
        lr = lr_at(step, cfg.optim, t.max_steps)
        stats = engine.step(batches, lr)
        step_time = time.perf_counter() - started
        done = step + 1
        if tracker is not None:
            metrics = {"step": done, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
                       "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                       "consumed_samples": done * layout.global_batch}
            tracker.log(metrics)
            line = progress.update(done, step_time, metrics)
            if done % t.log_every == 0 or done == t.max_steps or done == start_step + 1:
                print(line, flush=True)
        ckpt.maybe_save(done, engine, {"consumed_samples": done * layout.global_batch}, final=done == t.max_steps)
    if tracker is not None:
        tracker.close()
    return {"rank": env.rank, "steps": t.max_steps, "start_step": start_step,
            "final_loss": stats.loss if stats else None}
