"""Metrics out of the training loop: a JSONL file always, Weights & Biases when configured.

Only one rank tracks. The W&B run id is the hpctrain run id, resumed with resume="allow", so a requeued
job continues the same W&B run instead of starting a new one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpctrain.config.schema import TrackingMode

METRICS_FILE = "metrics.jsonl"


class Tracker:
    def __init__(self, cfg: Any, run_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        self._file = open(run_dir / METRICS_FILE, "a", buffering=1)
        self._wandb = None
        mode = cfg.tracking.mode
        if mode != TrackingMode.disabled:
            import wandb

            self._wandb = wandb.init(
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=mode.value,
                project=cfg.tracking.project,
                entity=cfg.tracking.entity,
                group=cfg.tracking.group,
                tags=list(cfg.tracking.tags) or None,
                name=f"{cfg.run.name}-{run_id}",
                config=config,
            )

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
