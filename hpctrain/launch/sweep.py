"""A Hydra callback for multiruns: every point checked before any is submitted, and one table at the end.

Each point of `python -m hpctrain -m ...` is its own run (run id, directory, job); on Slurm each point only
submits, so the sweep returns within seconds and the table says where everything went.

Hydra calls the task function once per point, so a bad point would be found only after the points before it
ran (on Slurm: were submitted). `on_multirun_start` therefore composes and checks every point first (what
`python -m hpctrain` checks for one run, nothing written); if one fails, nothing is submitted, the errors are
printed by point, the table and `sweep.json` hold them, and the sweep exits 2. A point that fails later (its
job, its submission) does not stop the others: its row holds its error, and the sweep exits with its code.

Two points that would share one run directory (a fixed `run.id`, or a fixed `run.resume`) are refused before
anything is written: the second would resume the first's run, train nothing and overwrite its config.yaml.
A sweep whose every point is a dry run writes nothing: Hydra's sweep directory (which its sweeper and launcher
create before the first point) goes to a scratch directory, removed at the end.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import as_config
from hpctrain.launch.secrets import redact_assignments, redact_text
from hpctrain.records.paths import SWEEP_TABLE

EXIT_CONFIG_ERROR = 2


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.code = 0
        self.sweep_dir: Path | None = None
        self.scratch: Path | None = None  # a dry-run sweep's Hydra directory, outside run.root, removed at the end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        launcher_log = logging.getLogger("hydra._internal.core_plugins.basic_launcher")  # "#0 : overrides"
        if not any(isinstance(f, _Redact) for f in launcher_log.filters):
            launcher_log.addFilter(_Redact())
        points = sweep_points(config)
        configs = [_composed_quietly(point) for point in points]
        errors = [check_point(point) for point in points]
        shared = shared_run_dirs(points, configs)
        if shared is not None:  # refused before Hydra creates the sweep directory: nothing is written
            for i, (point, error) in enumerate(zip(points, errors)):
                if error:
                    print(f"hpctrain: sweep point {i} ({' '.join(map(redact_text, point))}): {error}", file=sys.stderr)
            print(f"hpctrain: {ConfigError([shared])}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        if not any(errors):
            if configs and all(c is not None and c.dry_run for c in configs):
                self._scratch_sweep_dir(config)
            return
        failed = sum(1 for e in errors if e)
        for i, (point, error) in enumerate(zip(points, errors)):
            if error:
                print(f"hpctrain: sweep point {i} ({' '.join(map(redact_text, point))}): {error}", file=sys.stderr)
        print(
            f"hpctrain: {failed} of {len(points)} sweep points failed the checks; no point was submitted",
            file=sys.stderr,
        )
        self.rows = [
            {
                "point": i,
                "overrides": " ".join(map(redact_text, point)),
                "job_id": "-",
                "run_dir": "failed the checks" if error else "not submitted (another point failed the checks)",
                "error": error or "",
            }
            for i, (point, error) in enumerate(zip(points, errors))
        ]
        self._write(print_table=True)
        sys.exit(EXIT_CONFIG_ERROR)

    def _scratch_sweep_dir(self, config: DictConfig) -> None:
        """Every point is a dry run: Hydra's sweep directory (its sweeper writes multirun.yaml there, its launcher
        and each point create it) goes to a scratch directory, removed when the sweep ends (or the process does),
        so that the dry run leaves nothing in run.root. Its name stays the sweep's time (the W&B group's name)."""
        self.scratch = Path(tempfile.mkdtemp(prefix="hpctrain-dry-sweep-"))
        atexit.register(shutil.rmtree, self.scratch, True)
        where = self.scratch / Path(str(config.hydra.sweep.dir)).name
        quoted = "'" + str(where).replace("\\", "\\\\").replace("'", "\\'") + "'"
        with read_write(config), open_dict(config):
            config.hydra.sweep.dir = str(where)
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={quoted}")  # each point's config is composed anew
        self.sweep_dir = None  # no sweep.json either

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
        self.rows.append(
            {
                "point": len(self.rows),
                "overrides": " ".join(map(redact_text, job_return.overrides or [])),
                "job_id": value.get("job_id") or "-",
                "run_dir": value.get("run_dir") or "failed",
                "error": error,
            }
        )
        self._write(print_table=False)  # a sweep cut short still leaves what it did

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        if not self.rows:
            return
        if self.scratch is None:
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


def _composed_quietly(overrides: list[str]) -> DictConfig | None:
    """A point's config as `python -m hpctrain` composes it; None when it does not compose (check_point says why)."""
    from hydra import compose

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return compose(config_name="config", overrides=list(overrides))
    except Exception:  # noqa: BLE001  (whatever fails to compose: check_point says what)
        return None


def _target(cfg: DictConfig) -> tuple[str, str, Path] | None:
    """The run directory a point would use when the command fixes it: (key, value, path); None for a fresh id."""
    root = Path(str(cfg.run.root)).expanduser()
    if cfg.run.resume:
        from hpctrain.launch.rundir import find_run

        ref = str(cfg.run.resume)
        found = find_run(root.resolve(), ref)
        return "run.resume", ref, found if found is not None else Path(ref).expanduser()
    if cfg.run.id:
        return "run.id", str(cfg.run.id), (root / str(cfg.run.name) / str(cfg.run.id)).resolve()
    return None


def shared_run_dirs(points: list[list[str]], configs: list[DictConfig | None]) -> Problem | None:
    """Points that would run in one run directory (run.id or run.resume the same for them): each point of a
    sweep is its own run, and the second one in a directory would resume the first's, train nothing (or go on
    from where it ended) and overwrite its config.yaml. None when every point has its own."""
    seen: dict[Path, int] = {}
    for i, cfg in enumerate(configs):
        target = _target(cfg) if cfg is not None else None
        if target is None:
            continue
        key, value, path = target
        if path not in seen:
            seen[path] = i
            continue
        first = seen[path]
        both = ", ".join(f"{n} ({' '.join(map(redact_text, points[n])) or 'no overrides'})" for n in (first, i))
        if key == "run.resume":
            return Problem(
                key,
                f"{key}={value} is the same for sweep points {both}: every point would resume the "
                f"one run {path}, one after the other (the later ones overwriting its config.yaml)",
                "resume one run per command (without -m), or sweep over it: run.resume=a,b, one run "
                "per point (Hydra sweeps every combination of the swept keys)",
            )
        return Problem(
            key,
            f"{key}={value} is the same for sweep points {both}: they would share one run "
            f"directory ({path}): the second would resume the first's run, train nothing and overwrite "
            "its config.yaml",
            "leave run.id out in a sweep (each point gets its own), or sweep over "
            "it: run.id=a,b, one id per point (Hydra sweeps every combination of the swept keys)",
        )
    return None


def check_point(overrides: list[str]) -> str:
    """One point composed and checked as `python -m hpctrain` would (nothing written, nothing printed); its
    errors, or "" when it passes. A dry-run point is not checked here: it submits nothing, and shows its plan."""
    from hydra import compose

    from hpctrain.launch.cli import prepare

    def composed(extra: list[str]) -> DictConfig:
        return compose(config_name="config", overrides=extra)

    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            cfg = composed(list(overrides))
            if cfg.dry_run:
                return ""
            prepare(as_config(cfg), list(overrides), composed)
    except ConfigError as err:
        return str(err)
    except Exception as exc:  # composition: a value of this point the schema refuses
        return f"{type(exc).__name__}: {exc}"
    return ""


class _Redact(logging.Filter):
    """Credential values out of the lines Hydra logs for each point."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact_assignments(record.getMessage())
        record.args = ()
        return True


def _scrub(path: Path) -> None:
    """Credential values (hpctrain.launch.secrets) out of a file Hydra wrote."""
    try:
        text = path.read_text()
    except OSError:
        return
    scrubbed = redact_assignments(text)
    if scrubbed != text:
        path.write_text(scrubbed)
