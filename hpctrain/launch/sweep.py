"""A Hydra callback for multiruns: every point checked before any is submitted, and one table at the end.

Each point of `python -m hpctrain -m ...` is its own run (run id, directory, job); on Slurm each point only
submits, so the sweep returns within seconds and the table says where everything went.

Hydra calls the task function once per point, so a bad point would be found only after the points before it
ran (on Slurm: were submitted). `on_multirun_start` therefore composes and checks every point first (what
`python -m hpctrain` checks for one run, nothing written); if one fails, nothing is submitted, the errors are
printed by point, the table and `sweep.json` hold them, and the sweep exits 2. A point that fails later (its
job, its submission) does not stop the others: its row holds its error, and the sweep exits with its code.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hpctrain.launch.secrets import REDACTED, redact_text
from hpctrain.records.paths import SWEEP_TABLE

EXIT_CONFIG_ERROR = 2


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.code = 0
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        launcher_log = logging.getLogger("hydra._internal.core_plugins.basic_launcher")  # "#0 : overrides"
        if not any(isinstance(f, _Redact) for f in launcher_log.filters):
            launcher_log.addFilter(_Redact())
        points = sweep_points(config)
        errors = [check_point(point) for point in points]
        if not any(errors):
            return
        failed = sum(1 for e in errors if e)
        for i, (point, error) in enumerate(zip(points, errors)):
            if error:
                print(f"hpctrain: sweep point {i} ({' '.join(map(redact_text, point))}): {error}", file=sys.stderr)
        print(f"hpctrain: {failed} of {len(points)} sweep points failed the checks; no point was submitted",
              file=sys.stderr)
        self.rows = [{"point": i, "overrides": " ".join(map(redact_text, point)), "job_id": "-",
                      "run_dir": "failed the checks" if error else "not submitted (another point failed the checks)",
                      "error": error or ""} for i, (point, error) in enumerate(zip(points, errors))]
        self._write(print_table=True)
        sys.exit(EXIT_CONFIG_ERROR)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.sweep_dir is not None:
            _scrub(self.sweep_dir / "multirun.yaml")  # Hydra's record of the sweep, written before the first point

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.hydra_cfg is None or str(job_return.hydra_cfg.hydra.mode) != "RunMode.MULTIRUN":
            return
        value = job_return._return_value
        if job_return.status == JobStatus.COMPLETED and isinstance(value, dict):
            code, error = int(value.get("code") or 0), str(value.get("error") or "")
        else:
            value, code, error = {}, 1, f"{type(value).__name__}: {value}"
        self.code = self.code or code
        self.rows.append({"point": len(self.rows), "overrides": " ".join(map(redact_text, job_return.overrides or [])),
                          "job_id": value.get("job_id") or "-",
                          "run_dir": value.get("run_dir") or "failed", "error": error})
        self._write(print_table=False)  # a sweep cut short still leaves what it did

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.rows:
            return
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self._write(print_table=True)
        if self.code:
            failed = sum(1 for r in self.rows if r["error"])
            print(f"hpctrain: {failed} of {len(self.rows)} sweep points failed (see the table)", file=sys.stderr)
            sys.exit(self.code)

    def _write(self, print_table: bool) -> None:
        if print_table:
            width = max(len(r["overrides"]) for r in self.rows)
            print(f"\nsweep: {len(self.rows)} points")
            print(f"{'point':>5}  {'overrides':<{width}}  {'job id':>8}  run directory")
            for r in self.rows:
                print(f"{r['point']:>5}  {r['overrides']:<{width}}  {r['job_id']:>8}  {r['run_dir']}")
                if r["error"]:
                    print(f"{'':>5}  error: " + r["error"].replace("\n", "\n" + " " * 14))
            sys.stdout.flush()
        if self.sweep_dir is not None:
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            (self.sweep_dir / SWEEP_TABLE).write_text(json.dumps(self.rows, indent=1))


def sweep_points(config: DictConfig) -> list[list[str]]:
    """Every point's overrides, as Hydra's basic sweeper expands the command line (and hydra.sweeper.params)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def check_point(overrides: list[str]) -> str:
    """One point composed and checked as `python -m hpctrain` would (nothing written, nothing printed); its
    errors, or "" when it passes. A dry-run point is not checked here: it submits nothing, and shows its plan."""
    from hydra import compose

    from hpctrain.config.problems import ConfigError
    from hpctrain.launch.cli import prepare

    def composed(extra: list[str]) -> DictConfig:
        return compose(config_name="config", overrides=extra)

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            cfg = composed(list(overrides))
            if cfg.dry_run:
                return ""
            prepare(cfg, list(overrides), composed)
    except ConfigError as err:
        return str(err)
    except Exception as exc:  # composition: a value of this point the schema refuses
        return f"{type(exc).__name__}: {exc}"
    return ""


_SECRET_VALUE = re.compile(r"((?:_KEY|_TOKEN|_SECRET|PASSWORD[A-Z0-9_]*)['\"]?\s*[:=]\s*)(?!<redacted>)([^,\s'\"\]]+)",
                           re.IGNORECASE)


class _Redact(logging.Filter):
    """Credential values out of the lines Hydra logs for each point."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = _SECRET_VALUE.sub(lambda m: m.group(1) + REDACTED, record.getMessage())
        record.args = ()
        return True


def _scrub(path: Path) -> None:
    """Credential values (hpctrain.launch.secrets) out of a file Hydra wrote."""
    try:
        text = path.read_text()
    except OSError:
        return
    scrubbed = _SECRET_VALUE.sub(lambda m: m.group(1) + REDACTED, text)
    if scrubbed != text:
        path.write_text(scrubbed)
