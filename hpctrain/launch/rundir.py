"""One run, one id, one directory.

The directory is chosen once on the login node and travels with the job, so a requeued or resubmitted
job lands in the same place (unlike a fresh Hydra timestamp directory per restart). `run.resume` points
at an existing run by id or path.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import CheckpointConfig, Config, RunConfig
from hpctrain.records.paths import (
    CONFIG,
    RunPaths,
    escape,
    escaping_entries,
    tier_directory,
)

STEP_PREFIX = "step_"  # a checkpoint directory in a tier (hpctrain.checkpoint.storage.PREFIX)


@dataclass(frozen=True)
class RunDir:
    run_id: str
    path: Path
    resumed: bool
    # A resume whose config differs from the saved one (beyond run.resume itself): config.yaml is replaced and
    # the older one kept as config.<time>.yaml. False: config.yaml is left as it is.
    config_changed: bool = True

    @property
    def files(self) -> RunPaths:
        return RunPaths(self.path)

    @property
    def submitit_folder(self) -> Path:
        return self.files.submitit


def new_run_id() -> str:
    """Sortable by start time, unique without coordination.

    A sweep draws all its ids in the same second, so the random part carries 32 bits: 16 bits gave two
    of 50 ids in one second the same name about once in 50 draws (the birthday bound).
    """
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)


def resolve_run_dir(run_cfg: RunConfig) -> RunDir:
    """Pick the run directory of the config's `run` section without creating it (a config error must leave
    nothing behind)."""
    root = Path(run_cfg.root).expanduser().resolve()
    if run_cfg.resume:
        return _find_existing(root, str(run_cfg.resume))
    if run_cfg.id:
        path = root / run_cfg.name / str(run_cfg.id)
        return RunDir(run_id=str(run_cfg.id), path=path, resumed=RunPaths(path).config.exists())
    run_id = new_run_id()
    while (root / run_cfg.name / run_id).exists():  # a fresh id never resumes somebody else's run
        run_id = new_run_id()
    return RunDir(run_id=run_id, path=root / run_cfg.name / run_id, resumed=False)


def find_run(root: Path, ref: str) -> Path | None:
    """A run directory by path, or by id under `root` (`<root>/<name>/<id>`); None when there is none."""
    as_path = Path(ref).expanduser()
    candidates = [as_path] if as_path.is_absolute() or "/" in ref or as_path.is_dir() else []
    candidates += sorted(root.glob(f"*/{ref}"))
    return next((path.resolve() for path in candidates if RunPaths(path).config.exists()), None)


def _find_existing(root: Path, resume: str) -> RunDir:
    path = find_run(root, resume)
    if path is not None:
        return RunDir(run_id=path.name, path=path, resumed=True)
    raise ConfigError(
        [
            Problem(
                "run.resume",
                f"no run {resume!r} found (looked for {CONFIG} in {resume} and in {root}/*/{resume})",
                "pass a run directory path or the id of a run under run.root (ls the run root to see them)",
            )
        ]
    )


def create_run_dir(cfg: Config, run: RunDir) -> Path:
    """Create the directory and write the resolved config the tasks will read (a resume that changed nothing in
    it leaves config.yaml as it is; one that changed it keeps the older one as config.<time>.yaml)."""
    run.path.mkdir(parents=True, exist_ok=True)
    run.submitit_folder.mkdir(exist_ok=True)
    config_path = run.files.config
    if run.resumed and config_path.exists():
        if not run.config_changed:
            return config_path
        config_path.rename(run.files.archived_config(time.strftime("%Y%m%d-%H%M%S")))
    OmegaConf.save(cfg, config_path, resolve=True)
    return config_path


def tier_problems(checkpoint: CheckpointConfig, run: RunDir) -> list[Problem]:
    """Each checkpoint tier's directory must resolve inside the run's own (a relative tier in the run directory, an
    absolute one in `<path>/<run id>`), and no checkpoint in it may be a link out of it (issue 46): through a link
    to another run's `checkpoints/` a resume loaded that run's checkpoint, saved into its directory and let
    retention delete its steps. Refused here, naming the key, before anything is written or submitted; the job's
    checkpoint manager refuses the same (hpctrain.checkpoint.manager). A relative path that leaves the run
    directory by its own `..` is the config check's (hpctrain.checks.config)."""
    if not checkpoint.enabled:
        return []
    problems = []
    for i, tier in enumerate(checkpoint.tiers):
        directory, home = tier_directory(str(tier.path), run.path, run.run_id)
        why = escape(directory, home)
        found = [why] if why else [w for _, w in escaping_entries(directory, STEP_PREFIX)]
        found = [w for w in found if "symbolic link" in w]
        if not found:
            continue
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        where = (
            f"{home}, this run's own directory of tier {tier.name}"
            if Path(str(tier.path)).expanduser().is_absolute()
            else f"the run directory {home}"
        )
        problems.append(
            Problem(
                f"checkpoint.tiers[{i}].path",
                f"{found[0]}{more}: a run loads, saves and deletes checkpoints only inside {where}; through this link "
                "it would resume another run's checkpoint, save into that run's directory and let retention delete its "
                "steps",
                "remove the link (the run then makes its own directory) or put the run's own checkpoints back in its "
                "place; a run never shares checkpoints with another: to start from another run's weights, export them "
                "(tools/checkpoint.py export RUN --format hf OUT) and start a new run with model.init_from=OUT",
            )
        )
    return problems


def owner_problems(cfg: Config, run: RunDir) -> list[Problem]:
    """The newest checkpoint a resume would load must be the run's own: its manifest's run id is the run's (a
    manifest from before manifests named their run is taken as the run's). Another id means the checkpoint came
    from another run (a copy), or the run directory was renamed; the job's checkpoint manager would refuse it,
    so it is said here, before a job is submitted."""
    from hpctrain.checks.files import newest_checkpoint

    newest = newest_checkpoint(cfg, run.path)
    owner = newest[1].get("run_id") if newest is not None else None
    if newest is None or owner is None or str(owner) == run.run_id:
        return []
    path, manifest = newest
    return [
        Problem(
            "run.resume",
            f"the newest checkpoint of run {run.run_id} ({path}, step {manifest['step']}) belongs to run "
            f"{owner} (its manifest): a run resumes only its own checkpoints, so the job would refuse it",
            f"if this directory was run {owner}'s and was renamed, give it its name back "
            f"({run.path.parent / str(owner)}); if the checkpoint was copied in from run {owner}, remove it from this "
            f"run (or resume run {owner} itself); to start from its weights, export them (tools/checkpoint.py export "
            "RUN --format hf OUT) and start a new run with model.init_from=OUT",
        )
    ]
