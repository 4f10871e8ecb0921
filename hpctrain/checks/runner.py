"""The runner of every check before anything is queued: the config's own rules (hpctrain.checks.config), the
planner's (hpctrain.checks.plan), then the files the run reads (hpctrain.checks.files); a resume also against the
newest checkpoint of its run directory."""

from __future__ import annotations

import os
from collections.abc import Callable

from hpctrain.checks import config as config_checks
from hpctrain.checks.config import check_schema
from hpctrain.checks.files import check_resume, file_checks, resumed_run_dir
from hpctrain.checks.plan import PLAN_CHECKS
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout, resolve_layout
from hpctrain.config.problems import ConfigError
from hpctrain.config.schema import Config

CHECKS: list[Callable[[Config, Layout, CheckReport], None]] = [*config_checks.CHECKS, *PLAN_CHECKS, file_checks]


def run_checks(cfg: Config, run_dir: str | os.PathLike[str] | None = None) -> CheckReport:
    """Every check, the errors kept in the report (a dry run shows the plan before them). A layout that
    cannot be resolved at all raises ConfigError.

    The config's checks (hpctrain.checks.config), then the planner's (the bubble, memory per GPU, offload), then
    the files the run will read (hpctrain.checks.files); a resume also against the newest
    checkpoint of its run directory: `run_dir` when the caller resolved it, else the run that run.resume (or
    an existing run.root/run.name/run.id) names."""
    check_schema(cfg)
    layout = resolve_layout(cfg)
    report = CheckReport(layout)
    for check in CHECKS:
        try:
            check(cfg, layout, report)
        except (ArithmeticError, ValueError, TypeError):
            # A check that cannot compute with a value an earlier check refused (an infinite timeout in
            # math.ceil, a NaN in a comparison chain): that value's error is in the report, and is the one to
            # fix. With no error reported yet it is a bug of the check, and raises.
            if not report.errors:
                raise
    if run_dir is None and not any(p.key in ("run.name", "run.id") for p in report.errors):
        run_dir = resumed_run_dir(cfg)
    if run_dir is not None:
        check_resume(cfg, run_dir, report)
    return report


def check_config(cfg: Config, run_dir: str | os.PathLike[str] | None = None) -> CheckReport:
    """Run every check; raise ConfigError with all errors found, return the report (with warnings) otherwise."""
    report = run_checks(cfg, run_dir)
    if report.errors:
        raise ConfigError(report.errors)
    return report
