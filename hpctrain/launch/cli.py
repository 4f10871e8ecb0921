"""What `python -m hpctrain` does with a composed config: check, plan, and (unless a dry run) launch.

Everything that can be wrong with the config is found here, before a run directory is created or a job
submitted, and reported with the key and the fix.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from hpctrain.config.checks import run_checks
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.launch.data import prepare_data
from hpctrain.launch.plan_view import build_plan, render
from hpctrain.launch.rundir import resolve_run_dir

EXIT_CONFIG_ERROR = 2


@dataclass(frozen=True)
class Outcome:
    """What one invocation did: the exit code, and for a launched run its id, directory and job id."""

    code: int
    run_id: str = ""
    run_dir: str = ""
    job_id: str = ""


def run(cfg: DictConfig) -> Outcome:
    """A dry run prints the plan, then any errors (exit 2); otherwise errors stop it before anything is created."""
    try:
        if "deepspeed" in cfg:
            apply_deepspeed(cfg, _explicit_keys())
        if cfg.parallel.auto:
            apply_auto(cfg)
        report = run_checks(cfg)
        if report.errors and not cfg.dry_run:
            raise ConfigError(report.errors)
        run_dir = resolve_run_dir(cfg)
    except ConfigError as err:
        print(f"hpctrain: {err}", file=sys.stderr)
        return Outcome(EXIT_CONFIG_ERROR)
    cfg.run.id = run_dir.run_id
    _join_sweep(cfg)
    plan = build_plan(cfg, report, run_dir)
    if cfg.plan.png:
        _chart(plan, Path(cfg.plan.png))
    if cfg.dry_run:
        print(render(plan, cfg.plan.format.value), flush=True)
        if report.errors:
            print(f"hpctrain: {ConfigError(report.errors)}", file=sys.stderr)
            return Outcome(EXIT_CONFIG_ERROR, run_dir.run_id, str(run_dir.path))
        return Outcome(0, run_dir.run_id, str(run_dir.path))
    for w in report.warnings:
        print(f"warning: {w.key}: {w.message} (fix: {w.fix})", file=sys.stderr)
    from hpctrain.launch.submit import launch

    try:
        prepare_data(cfg.data)
    except ConfigError as err:
        print(f"hpctrain: {err}", file=sys.stderr)
        return Outcome(EXIT_CONFIG_ERROR, run_dir.run_id, str(run_dir.path))

    code, job_id = launch(cfg, report.layout, run_dir, plan)
    return Outcome(code, run_dir.run_id, str(run_dir.path), job_id)


def apply_deepspeed(cfg: DictConfig, explicit: set[str]) -> None:
    """`+deepspeed=PATH`: the DeepSpeed config's settings (hpctrain.config.deepspeed) onto the composed config,
    except where the command line set a key itself (or chose its group: `zero=stage3` keeps every zero.* key);
    what has no equivalent is listed, never dropped. The `deepspeed` key itself goes: the tasks never see it."""
    from hpctrain.config.deepspeed import load, translate

    path = str(cfg.deepspeed)
    with open_dict(cfg):  # Hydra added the key to a struct config: only open, it can go again
        del cfg["deepspeed"]
    translation = translate(load(path), cfg)
    kept = []
    for key, value in translation.overrides.items():
        if any(key == k or key.startswith(k + ".") for k in explicit):
            kept.append(key)
            continue
        OmegaConf.update(cfg, key, value, merge=False)
    print(f"deepspeed: {path}\n" + "\n".join(f"  {line}" for line in translation.report().splitlines())
          + "".join(f"\n  (the command line's {key}={OmegaConf.select(cfg, key)} kept over the file's "
                    f"{translation.overrides[key]})" for key in kept), file=sys.stderr)


def _explicit_keys() -> set[str]:
    """The keys (and config groups) the command line set itself."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task
            if "=" in o and o.split("=", 1)[0].lstrip("+~") not in ("deepspeed", "experiment")}


def apply_auto(cfg: DictConfig) -> None:
    """`parallel=auto`: set the layout keys to the planner's fastest layout that fits (hpctrain.plan.auto)."""
    from hpctrain.plan.auto import layout_overrides
    from hpctrain.plan.estimate import cluster_hardware, model_shape
    from hpctrain.plan.search import search_layouts

    c = cfg.cluster
    candidates = search_layouts(model_shape(cfg.model, cfg.train.seq_len), c.nodes * c.gpus_per_node,
                                cluster_hardware(c), cfg.train.global_batch, dtype=cfg.precision.dtype.value,
                                reduce_dtype=cfg.precision.reduce_dtype.value)
    if not candidates:
        raise ConfigError([Problem(
            "parallel.auto", f"no layout of {cfg.model.name} on {c.nodes} x {c.gpus_per_node} {c.gpu_type} with "
            f"global batch {cfg.train.global_batch} fits in memory",
            "add nodes, change train.global_batch, or use offload (zero=stage3_offload) with an explicit layout",
        )])
    for key, value in layout_overrides(candidates[0].layout).items():
        OmegaConf.update(cfg, key, value)
    print(f"parallel=auto chose: {candidates[0].why}", file=sys.stderr)


def _join_sweep(cfg: DictConfig) -> None:
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
    """Exit non-zero on failure; on success return what happened (a Hydra multirun's sweep table reads it)."""
    if outcome.code:
        sys.exit(outcome.code)
    return {"run_id": outcome.run_id, "run_dir": outcome.run_dir, "job_id": outcome.job_id}
