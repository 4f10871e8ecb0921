"""What a step reports: the metrics row (metrics.jsonl, W&B), its events, and the progress line a user
watches (step, loss, lr, throughput, time to go; for a Mixture-of-Experts model, how its router balances)."""

from __future__ import annotations

import datetime
import logging
import math
import time
from typing import Any

import torch

from hpctrain.config.schema import Config
from hpctrain.parallel.metrics import memory_metrics, mfu
from hpctrain.parallel.moe_stats import IdleExperts, MoEStepStats
from hpctrain.scheduler import scheduler_for

log = logging.getLogger(__name__)


class Progress:
    """ETA from an exponential average of step times, so the first (warm-up) step does not dominate."""

    def __init__(self, total_steps: int, start_step: int, smoothing: float = 0.1) -> None:
        self.total = total_steps
        self.start = start_step
        self.smoothing = smoothing
        self.avg_step_s: float | None = None

    def update(self, step: int, step_time: float, metrics: dict[str, Any]) -> str:
        if self.avg_step_s is None or step <= self.start + 2:
            self.avg_step_s = step_time
        else:
            self.avg_step_s += self.smoothing * (step_time - self.avg_step_s)
        eta = datetime.timedelta(seconds=round(self.avg_step_s * (self.total - step)))
        return (
            f"step {step}/{self.total} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
            f"grad_norm {metrics['grad_norm']:.3f} | {metrics['tokens_per_s']:,.0f} tok/s | "
            f"{step_time:.3f} s/step | ETA {eta}"
        )


class StepReporter:
    """Rank 0's per-step report: one metrics row, the step's checkpoint and health events, and every
    `train.log_every` steps the progress line."""

    def __init__(
        self,
        cfg: Config,
        tokens_per_step: int,
        world_size: int,
        device: torch.device,
        start_step: int,
        stop_tier: str | None = None,
    ) -> None:
        self.cfg, self.tokens_per_step, self.world_size, self.device = cfg, tokens_per_step, world_size, device
        self.start_step = start_step
        self.progress = Progress(total_steps=cfg.train.max_steps, start_step=start_step)
        self.stop_tier = stop_tier  # where a stop for a signal saves (CheckpointManager.stop_tier)
        # Checked only where a long run stops at the warning signal to go on in its next allocation
        self._lead_checked = not scheduler_for(cfg.cluster.executor).capabilities.warning_signal
        self.idle_experts = IdleExperts()

    def step(
        self,
        tracker: Any,
        done: int,
        consumed: int,
        stats: Any,
        lr: float,
        step_time: float,
        ckpt_events: list[dict[str, Any]],
        health: tuple[dict[str, float], list[dict[str, Any]]],
        data: dict[str, float] | None = None,
    ) -> None:
        """`data`: the step's wait for its batches (`data_wait_s`) and, at an evaluation, `val_loss`, `eval_s`."""
        tokens_per_s = self.tokens_per_step / step_time
        metrics = {
            "step": done,
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": tokens_per_s,
            "step_time_s": step_time,
            "consumed_samples": consumed,
            "time": time.time(),
            "loss_scale": stats.loss_scale,
            "skipped": int(stats.skipped),
            "mfu": mfu(self.cfg, tokens_per_s, self.world_size),
            **memory_metrics(self.device),
        }
        metrics.update(data or {})
        if stats.moe is not None:
            metrics.update(stats.moe.metrics())
        metrics.update(checkpoint_metrics(ckpt_events))
        self._check_signal_lead(tracker, done, step_time, ckpt_events)
        for e in ckpt_events:
            if e["event"] not in ("save_started", "save_committed"):
                tracker.event(e["event"], **{k: v for k, v in e.items() if k != "event"})
        health_metrics, health_events = health
        metrics.update(health_metrics)
        tracker.log(metrics)
        for e in health_events:
            tracker.event(e.pop("event"), **e)
        if stats.moe is not None:
            self._check_idle_experts(tracker, done, stats.moe)
        self._print(done, step_time, metrics, stats)

    def _check_signal_lead(self, tracker: Any, done: int, step_time: float, ckpt_events: list[dict[str, Any]]) -> None:
        """Once, from the first measured save to the stop's tier: the warning signal (`cluster.signal_delay_s`
        before the time limit) must leave time for the step in flight and that save, or Slurm kills the stop
        before it commits. The plan can only guess these; the run measures them."""
        saved = next((e for e in ckpt_events if e["event"] == "save_committed" and e["tier"] == self.stop_tier), None)
        if self._lead_checked or saved is None:
            return
        self._lead_checked = True
        lead, needed = self.cfg.cluster.signal_delay_s, step_time + saved["total_s"]
        if needed <= lead:
            return
        message = (
            f"cluster.signal_delay_s={lead} s is shorter than a step ({step_time:.1f} s) plus a save to tier "
            f"{self.stop_tier} ({saved['total_s']:.1f} s, measured at step {done}): a stop at the time limit "
            f"would be killed before its checkpoint commits; set cluster.signal_delay_s>={math.ceil(2 * needed)}"
        )
        log.warning(message)
        tracker.event(
            "timeout_inconsistent", key="cluster.signal_delay_s", needed_s=needed, lead_s=lead, message=message
        )

    def _check_idle_experts(self, tracker: Any, done: int, moe: MoEStepStats) -> None:
        """An expert the router has starved for `IdleExperts.steps` steps in a row: one warning and one event per
        layer, when its idle run reaches that length (not every step after)."""
        reached = self.idle_experts.update(moe)
        if not reached:
            return
        n = self.idle_experts.steps
        where = "; ".join(f"layer {layer}: {', '.join(map(str, experts))}" for layer, experts in reached.items())
        log.warning(
            "MoE experts with no token for %d steps (to step %d): %s; the router starves them: check the "
            "balancing (model.moe.balance_coef, or model.moe.bias_update_rate for the sigmoid router)",
            n,
            done,
            where,
        )
        for layer, experts in reached.items():
            tracker.event("expert_idle", layer=layer, experts=experts, steps=n)

    def _print(self, done: int, step_time: float, metrics: dict[str, Any], stats: Any) -> None:
        line = self.progress.update(done, step_time, metrics)
        line += f" | MFU {metrics['mfu']:.2%} | peak mem {metrics['peak_mem_gb']:.2f} GB"
        if "data_wait_s" in metrics:
            line += f" | data wait {metrics['data_wait_s'] / step_time:.1%}"
        if self.cfg.precision.loss_scaling:
            line += f" | loss scale {stats.loss_scale:g}" + (" (overflow: step skipped)" if stats.skipped else "")
        if stats.moe is not None:
            line += self._moe_part(stats.moe)
        if "val_loss" in metrics:
            line += f" | val loss {metrics['val_loss']:.4f}"
        t = self.cfg.train
        if done % t.log_every == 0 or done == t.max_steps or done == self.start_step + 1 or "val_loss" in metrics:
            print(line, flush=True)

    def _moe_part(self, moe: MoEStepStats) -> str:
        """The router at a glance: balancing loss, the worst layer's max/mean tokens per expert, and what
        capacity dropped (only with a capacity: dropless routing never drops)."""
        worst = moe.worst_layer()
        part = f" | moe balance {moe.balance_loss:.3f}, imbalance {moe.layers()[worst].imbalance:.2f} (layer {worst})"
        if self.cfg.model.moe.capacity_factor > 0:
            part += f", dropped {moe.dropped_fraction():.2%}"
        return part


def checkpoint_metrics(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The step's checkpoint figures as metrics: blocked and total seconds, bytes, skipped saves, per tier."""
    out: dict[str, Any] = {}
    for e in events:
        if e["event"] == "save_started":
            out[f"ckpt/{e['tier']}/blocked_s"] = e["blocked_s"]
        elif e["event"] == "save_committed":
            out[f"ckpt/{e['tier']}/step"] = e["step"]  # the newest checkpoint of the tier (hpctrain.status)
            out[f"ckpt/{e['tier']}/total_s"] = e["total_s"]
            out[f"ckpt/{e['tier']}/bytes"] = e["bytes"]
        elif e["event"] == "save_skipped":
            out[f"ckpt/{e['tier']}/skipped"] = 1
    return out
