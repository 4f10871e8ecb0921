"""Metrics out of the training loop: a JSONL file always, Weights & Biases when configured.

Only one rank tracks. The W&B run id is the hpctrain run id, resumed with resume="allow", so a requeued or
resubmitted job continues the same W&B run instead of starting a new one. The job's context (job id, restart
count, nodes), from its scheduler and under the scheduler's name ("slurm"), goes into the W&B config; events
(resume, stop on a signal) go to `events.jsonl` and to W&B at the step they happened. No credential is ever
written: W&B reads its key from the environment.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hpctrain.config.schema import Config, TrackingMode
from hpctrain.goodput.measure import RowCache, measure
from hpctrain.records.paths import RunPaths
from hpctrain.scheduler import scheduler_for

log = logging.getLogger(__name__)
ACCOUNTING_TIMEOUT_S = 5  # the ledger at a stop must not eat the time left before the kill


class Tracker:
    def __init__(self, cfg: Config, run_dir: Path, run_id: str, config: dict[str, Any], ledger: bool = True) -> None:
        """`ledger`: this tracker makes the run's goodput ledger (not a replica group's folder, which has no
        config or jobs of its own)."""
        self._makes_ledger = ledger
        self._file = open(RunPaths(run_dir).metrics, "a", buffering=1)
        self._events = open(RunPaths(run_dir).events, "a", buffering=1)
        self._wandb = None
        self._step = 0
        self._closed = False
        self._rows = RowCache()  # the ledger's rows, parsed once per attempt
        self._pending: Future[Any] | None = None  # a ledger being made on its thread (`ledger(background=True)`)
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

    def ledger(self, run_dir: Path, background: bool = False) -> None:
        """The run's goodput ledger so far (hpctrain/goodput/ledger.py): one log line, the "ledger" event, and
        W&B summary metrics (`ledger/*`), so goodput stands beside the loss across requeues. A ledger that
        cannot be made (a record being rewritten, the accounting down) is logged and skipped: it must never
        stop training or a stop's requeue.

        background: made on a thread and published by `poll` at a later step (an attempt's start: parsing a
        long run's rows takes seconds, and rank 0 must not hold every rank up for them); else made now (an
        attempt's end), after any ledger still being made (they share the row cache)."""
        if not self._makes_ledger:
            return
        self._settle()
        if not background:
            self._publish(self._measured(run_dir))
            return
        future: Future[Any] = Future()
        threading.Thread(
            target=lambda: future.set_result(self._measured(run_dir)), name="hpctrain-ledger", daemon=True
        ).start()
        self._pending = future

    def poll(self) -> None:
        """Publish a background ledger once it is made (cheap otherwise: the loop calls it every step)."""
        if self._pending is not None and self._pending.done():
            self._settle()

    def _settle(self) -> None:
        if self._pending is not None:
            ledger, self._pending = self._pending.result(), None
            self._publish(ledger)

    def _measured(self, run_dir: Path) -> Any:
        try:
            return measure(run_dir, accounting_timeout_s=ACCOUNTING_TIMEOUT_S, cache=self._rows)
        except Exception as exc:  # noqa: BLE001 -- a report, not a reason to fail the attempt
            log.warning("no goodput ledger this time: %s: %s", type(exc).__name__, exc)
            return None

    def _publish(self, ledger: Any) -> None:
        if ledger is None:
            return
        log.info("%s", ledger.line())
        summary = ledger.summary()
        self.event("ledger", **summary)
        if self._wandb is not None:
            self._wandb.summary.update({f"ledger/{k}": v for k, v in summary.items()})

    def close(self) -> None:
        if self._closed:  # a stop closes it before its requeue; the loop's own end comes after
            return
        self._closed = True
        self._settle()
        self._file.close()
        self._events.close()
        if self._wandb is not None:
            self._wandb.finish()
