"""A Hydra callback that ends a multirun with one table: point, overrides, job id, run directory.

Each point of `python -m hpctrain -m ...` is its own run (run id, directory, job); on Slurm each point only
submits, so the sweep returns within seconds and the table says where everything went.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hpctrain.records.paths import SWEEP_TABLE


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.hydra_cfg is None or str(job_return.hydra_cfg.hydra.mode) != "RunMode.MULTIRUN":
            return
        ok = job_return.status == JobStatus.COMPLETED and isinstance(job_return._return_value, dict)
        value = job_return._return_value if ok else {}
        self.rows.append({"point": len(self.rows), "overrides": " ".join(job_return.overrides or []),
                          "job_id": value.get("job_id", "-"), "run_dir": value.get("run_dir", "failed")})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.rows:
            return
        width = max(len(r["overrides"]) for r in self.rows)
        print(f"\nsweep: {len(self.rows)} points")
        print(f"{'point':>5}  {'overrides':<{width}}  {'job id':>8}  run directory")
        for r in self.rows:
            print(f"{r['point']:>5}  {r['overrides']:<{width}}  {r['job_id']:>8}  {r['run_dir']}")
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / SWEEP_TABLE).write_text(json.dumps(self.rows, indent=1))
