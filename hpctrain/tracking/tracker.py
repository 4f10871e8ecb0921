"""Metrics out of the training loop: a JSONL file always, Weights & Biases when configured.

Only one rank tracks. The W&B run id is the hpctrain run id, resumed with resume="allow", so a requeued or
resubmitted job continues the same W&B run instead of starting a new one. The job's context (job id, restart
count, nodes), from its scheduler and under the scheduler's name ("slurm"), goes into the W&B config; events
(resume, stop on a signal) go to `events.jsonl` and to W&B at the step they happened. No credential is ever
written: W&B reads its key from the environment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpctrain.config.schema import TrackingMode
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for


class Tracker:
    def __init__(self, cfg: Any, run_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        self._file = open(RunPaths(run_dir).metrics, "a", buffering=1)
        self._events = open(RunPaths(run_dir).events, "a", buffering=1)
        self._wandb = None
        self._step = 0
        mode = cfg.tracking.mode
        if mode != TrackingMode.disabled:
            import wandb

            scheduler = scheduler_for()  # the one this task runs under
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
                config={**config, scheduler.name: scheduler.job_context()},
            )

    def log(self, metrics: dict[str, Any]) -> None:
        self._step = metrics["step"]
        self._file.write(json.dumps(metrics) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def event(self, name: str, **fields: Any) -> None:
        """Something that happened to the run (resume, stop, ...), at the current step."""
        record = {"event": name, "step": fields.pop("step", self._step), "time": time.time(), **fields}
        self._events.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({f"events/{name}": 1}, step=max(record["step"], self._step), commit=False)

    def close(self) -> None:
        self._file.close()
        self._events.close()
        if self._wandb is not None:
            self._wandb.finish()
