"""What `python -m hpctrain` does with a composed config: check, plan, and (unless a dry run) launch.

Everything that can be wrong with the config is found here, before a run directory is created or a job
submitted, and reported with the key and the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain.checks.report import CheckReport
from hpctrain.checks.runner import run_checks
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Config, as_node, simulating
from hpctrain.launch.data import prepare_data
from hpctrain.launch.plan_view import build_plan, render
from hpctrain.launch.resume import finished, resume_config
from hpctrain.launch.rundir import RunDir, owner_problems, resolve_run_dir, tier_problems
from hpctrain.launch.secrets import redact

EXIT_CONFIG_ERROR = 2


@dataclass(frozen=True)
class Outcome:
    """What one invocation did: the exit code, and for a launched run its id, directory and job id; on failure
    what went wrong (a sweep's table shows it)."""

    code: int
    run_id: str = ""
    run_dir: str = ""
    job_id: str = ""
    error: str = ""


@dataclass
class Prepared:
    """A checked config, ready to plan: the config (for a resume, the run's own with the allowed changes), the
    checks' report, the run directory, and the credentials taken out of cluster.env (hpctrain.launch.secrets)."""

    cfg: Config
    report: CheckReport
    run_dir: RunDir
    secrets: dict[str, str] = field(default_factory=dict)


def run(cfg: Config, overrides: list[str] | None = None) -> Outcome:
    """A dry run prints the plan, then any errors (exit 2); otherwise errors stop it before anything is created.

    `overrides`: the command line's (Hydra's task overrides by default); a resume takes only the keys they name
    from `cfg`, the rest from the run's saved config. An in-process caller without Hydra passes none: then all
    of `cfg` is the new config (and a resume compares all of it with the run's)."""
    if overrides is None:
        overrides = task_overrides()
    try:
        prepared = prepare(cfg, overrides)
    except ConfigError as err:
        print(f"hpctrain: {err}", file=sys.stderr)
        return Outcome(EXIT_CONFIG_ERROR, error=str(err))
    cfg, report, run_dir = prepared.cfg, prepared.report, prepared.run_dir
    done = finished(cfg, run_dir.path) if run_dir.resumed and not report.errors else None
    if done and not cfg.dry_run:  # a finished run: a job would load its last step and train nothing
        print(f"hpctrain: {done}", flush=True)
        return Outcome(0, run_dir.run_id, str(run_dir.path))
    if done:
        print(
            "note: " + done.replace("nothing was submitted", "without dry_run nothing would be submitted"),
            file=sys.stderr,
        )
    cfg.run.id = run_dir.run_id
    _join_sweep(cfg)
    plan = build_plan(cfg, report, run_dir)
    if simulating(cfg) and not report.errors:  # one rank of the job, built and stepped on fake tensors
        from hpctrain.simulate.rank import SimulationError
        from hpctrain.simulate.report import add_simulation

        try:
            add_simulation(plan, cfg, report.layout, report.estimates)
        except SimulationError as err:
            print(f"hpctrain: dry_run=simulate: {err}", file=sys.stderr)
            return Outcome(EXIT_CONFIG_ERROR, error=str(err))
    if cfg.plan.png:
        _chart(plan, Path(cfg.plan.png))
    if cfg.dry_run:
        print(render(plan, cfg.plan.format.value), flush=True)
        if report.errors:
            print(f"hpctrain: {ConfigError(report.errors)}", file=sys.stderr)
            return Outcome(EXIT_CONFIG_ERROR, run_dir.run_id, str(run_dir.path), error=str(ConfigError(report.errors)))
        return Outcome(0, run_dir.run_id, str(run_dir.path))
    for w in report.warnings:
        print(f"warning: {w.key}: {w.message} (fix: {w.fix})", file=sys.stderr)
    from hpctrain.launch.submit import launch

    try:
        prepare_data(cfg.data)
        code, job_id, failure = launch(cfg, report.layout, run_dir, plan, prepared.secrets)
    except ConfigError as err:  # bad input data, or the scheduler refused the job (its directory is gone then)
        print(f"hpctrain: {err}", file=sys.stderr)
        kept = str(run_dir.path) if run_dir.path.exists() else ""
        return Outcome(EXIT_CONFIG_ERROR, run_dir.run_id if kept else "", kept, error=str(err))
    error = "" if code == 0 else failure or f"the job failed (exit {code}); its logs are in {run_dir.submitit_folder}"
    return Outcome(code, run_dir.run_id, str(run_dir.path), job_id, error=error)


def prepare(
    cfg: Config, overrides: list[str] | None, compose: Callable[[list[str]], DictConfig] | None = None
) -> Prepared:
    """Everything before the plan, with no side effect: the resume's config, DeepSpeed's settings, parallel=auto,
    every check (all problems at once) and the run directory it will use. Raises ConfigError when the run must
    not go on (a dry run goes on to its plan when the layout resolves)."""
    resume = None
    run_dir = None
    if cfg.run.resume:
        run_dir = resolve_run_dir(cfg.run)  # by today's run.root; the run's own config says the rest
        resume = resume_config(as_node(cfg), overrides, run_dir.path, compose or _hydra_compose())
        cfg = resume.cfg
    if "deepspeed" in as_node(cfg):
        apply_deepspeed(cfg, _explicit_keys(overrides))
    if cfg.parallel.auto:
        apply_auto(cfg)
    refused = resume.problems(cfg) if resume else []
    if run_dir is not None:  # a resume: its tiers and checkpoints must be its own (issue 46), said first
        refused += tier_problems(cfg.checkpoint, run_dir) or owner_problems(cfg, run_dir)
    try:
        report = check_all(cfg, run_dir.path if run_dir else None)
    except ConfigError as err:
        raise ConfigError(refused + [p for p in err.problems if p.key not in {r.key for r in refused}]) from None
    if refused:  # the resume's refusals first; the checkpoint's check of the same key says the same
        report.errors[:] = refused + [p for p in report.errors if p.key not in {r.key for r in refused}]
    if report.errors and not cfg.dry_run:
        raise ConfigError(report.errors)
    if run_dir is None:
        run_dir = resolve_run_dir(cfg.run)
        escaping = tier_problems(cfg.checkpoint, run_dir)  # a new run (or run.id of one): none may lead out of it
        if escaping:
            report.errors[:0] = escaping
            if not cfg.dry_run:
                raise ConfigError(report.errors)
    secrets = redact(cfg.cluster, report)
    if resume is not None:
        run_dir = replace(run_dir, config_changed=resume.config_changed(cfg))
    return Prepared(cfg, report, run_dir, secrets)


def check_all(cfg: Config, run_dir: Path | None = None) -> CheckReport:
    """Every check, all problems at once. The checks need the resolved layout: when the schema or the layout
    fails first, the checks that do not need it still run (on a neutral layout of one rank, which adds none of
    the layout's own problems), so that `zero.stage=4 optim.lr=-1` reports both; then ConfigError with all."""
    try:
        return run_checks(cfg, run_dir) if run_dir is not None else run_checks(cfg)
    except ConfigError as err:
        first = list(err.problems)
    from hpctrain.checks.config import check_schema
    from hpctrain.checks.runner import CHECKS
    from hpctrain.config.layout import Layout, resolve_layout

    problems: list[Problem] = []
    for step in (check_schema, resolve_layout):
        try:
            step(cfg)
        except ConfigError as err:
            problems += err.problems
    report = CheckReport(Layout(dp=1, tp=1, pp=1, dtype="fp32"))
    report.errors = list(problems)  # seen by the checks that stop at earlier errors (the memory estimate)
    for check in CHECKS:
        try:
            check(cfg, report.layout, report)
        except Exception:  # a check that needs what failed above: its problem is already reported
            continue
    seen: set[tuple[str, str]] = set()
    unique = []
    for p in first + problems + report.errors:
        if (p.key, p.message) not in seen:
            seen.add((p.key, p.message))
            unique.append(p)
    raise ConfigError(unique)


def task_overrides() -> list[str] | None:
    """The command line's overrides (Hydra's task overrides); None outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return list(HydraConfig.get().overrides.task)


def _hydra_compose() -> Callable[[list[str]], DictConfig] | None:
    """Hydra's compose of the primary config with other overrides, when a Hydra app is running."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return None
    from hydra import compose

    return lambda overrides: compose(config_name="config", overrides=overrides)


def apply_deepspeed(cfg: Config, explicit: set[str]) -> None:
    """`+deepspeed=PATH`: the DeepSpeed config's settings (hpctrain.config.deepspeed) onto the composed config,
    except where the command line set a key itself (or chose its group: `zero=stage3` keeps every zero.* key);
    what has no equivalent is listed, never dropped. The `deepspeed` key itself goes: the tasks never see it."""
    from hpctrain.config.deepspeed import load, translate

    node = as_node(cfg)
    path = str(node.deepspeed)
    with open_dict(node):  # Hydra added the key to a struct config: only open, it can go again
        del node["deepspeed"]
    translation = translate(load(path), cfg)
    kept = []
    for key, value in translation.overrides.items():
        if any(key == k or key.startswith(k + ".") for k in explicit):
            kept.append(key)
            continue
        OmegaConf.update(node, key, value, merge=False)
    print(
        f"deepspeed: {path}\n"
        + "\n".join(f"  {line}" for line in translation.report().splitlines())
        + "".join(
            f"\n  (the command line's {key}={OmegaConf.select(node, key)} kept over the file's "
            f"{translation.overrides[key]})"
            for key in kept
        ),
        file=sys.stderr,
    )


def _explicit_keys(overrides: list[str] | None) -> set[str]:
    """The keys (and config groups) the command line set itself."""
    return {
        o.split("=", 1)[0].lstrip("+~")
        for o in overrides or []
        if "=" in o and o.split("=", 1)[0].lstrip("+~") not in ("deepspeed", "experiment")
    }


def apply_auto(cfg: Config) -> None:
    """`parallel=auto`: set the layout keys to the planner's fastest layout that fits (hpctrain.plan.auto)."""
    from hpctrain.checks.config import model_shape_checks
    from hpctrain.config.layout import Layout
    from hpctrain.plan.auto import auto_candidates, layout_overrides

    shape = CheckReport(Layout(dp=1, tp=1, pp=1, dtype="fp32"))  # a neutral layout: the model's checks need none
    model_shape_checks(cfg, shape)  # a model the search cannot even describe: its keys, not a traceback
    if shape.errors:
        raise ConfigError(shape.errors)
    c = cfg.cluster
    candidates = auto_candidates(cfg)  # each obeys the layout rules the checks report (hpctrain.config.rules)
    if not candidates:
        raise ConfigError(
            [
                Problem(
                    "parallel.auto",
                    f"no layout of {cfg.model.name} on {c.nodes} x {c.gpus_per_node} {c.gpu_type} with "
                    f"global batch {cfg.train.global_batch} fits in memory",
                    "add nodes, change train.global_batch, or use offload (zero=stage3_offload) with an explicit "
                    "layout",
                )
            ]
        )
    for key, value in layout_overrides(candidates[0].layout).items():
        OmegaConf.update(as_node(cfg), key, value)
    print(f"parallel=auto chose: {candidates[0].why}", file=sys.stderr)


def _join_sweep(cfg: Config) -> None:
    """In a Hydra multirun, the points share a W&B group (the sweep) and carry their overrides as tags."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    hc = HydraConfig.get()
    if not cfg.tracking.group:
        cfg.tracking.group = f"sweep-{Path(hc.sweep.dir).name}"
    swept = _swept_keys(sys.argv[1:])
    cfg.tracking.tags = list(cfg.tracking.tags) + [o for o in hc.overrides.task if o.split("=", 1)[0] in swept]


def _swept_keys(argv: list[str]) -> set[str]:
    """Keys the command line sweeps over (`optim.lr=1e-4,3e-4`), as Hydra's own parser reads them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    return {o.get_key_element() for o in OverridesParser.create().parse_overrides(args) if o.is_sweep_override()}


def _chart(plan: dict[str, Any], path: Path) -> None:
    from hpctrain.launch.plan_chart import have_matplotlib, write_chart

    if "memory_per_gpu_bytes" not in plan:
        return
    if have_matplotlib():
        write_chart(plan, path)
    else:
        print("plan.png: matplotlib is not installed (pip install 'hpctrain[plot]'); no chart written", file=sys.stderr)


def exit_on_failure(outcome: Outcome) -> dict[str, Any]:
    """Exit non-zero on failure; return what happened (a Hydra multirun's sweep table reads it). A point of a
    multirun returns its failure instead, so the sweep goes on and its table shows the error; the sweep then
    exits with the code (hpctrain.launch.sweep)."""
    result = {
        "run_id": outcome.run_id,
        "run_dir": outcome.run_dir,
        "job_id": outcome.job_id,
        "code": outcome.code,
        "error": outcome.error,
    }
    if outcome.code and not _in_multirun():
        sys.exit(outcome.code)
    return result


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
