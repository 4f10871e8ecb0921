"""What `python -m hpctrain` does with a composed config: check, plan, and (unless a dry run) launch.

Everything that can be wrong with the config is found here, before a run directory is created or a job
submitted, and reported with the key and the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hpctrain.config.checks import check_config
from hpctrain.config.problems import ConfigError
from hpctrain.launch.rundir import resolve_run_dir
from hpctrain.plan.report import build_plan, render

EXIT_CONFIG_ERROR = 2


def run(cfg: DictConfig) -> int:
    try:
        if cfg.parallel.auto:
            from hpctrain.plan.auto import apply_best

            best = apply_best(cfg)
            print(f"parallel=auto chose: {best.why}", file=sys.stderr)
        report = check_config(cfg)
        run_dir = resolve_run_dir(cfg)
    except ConfigError as err:
        print(f"hpctrain: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    cfg.run.id = run_dir.run_id
    plan = build_plan(cfg, report, run_dir)
    if cfg.plan.png:
        _chart(plan, Path(cfg.plan.png))
    if cfg.dry_run:
        print(render(plan, cfg.plan.format.value))
        return 0
    for w in report.warnings:
        print(f"warning: {w.key}: {w.message} (fix: {w.fix})", file=sys.stderr)
    from hpctrain.launch.submit import launch

    return launch(cfg, report.layout, run_dir, plan)


def _chart(plan: dict[str, Any], path: Path) -> None:
    from hpctrain.plan.chart import have_matplotlib, write_chart

    if "memory_per_gpu_bytes" not in plan:
        return
    if have_matplotlib():
        write_chart(plan, path)
    else:
        print("plan.png: matplotlib is not installed (pip install 'hpctrain[plot]'); no chart written", file=sys.stderr)


def exit_on_failure(code: int) -> Any:
    """Exit non-zero on failure; return on success so a Hydra multirun goes on to the next point."""
    if code:
        sys.exit(code)
