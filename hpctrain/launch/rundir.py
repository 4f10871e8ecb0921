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

from omegaconf import DictConfig, OmegaConf

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.records.paths import CONFIG, RunPaths


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


def resolve_run_dir(cfg: DictConfig) -> RunDir:
    """Pick the run directory without creating it (a config error must leave nothing behind)."""
    root = Path(cfg.run.root).expanduser().resolve()
    if cfg.run.resume:
        return _find_existing(root, str(cfg.run.resume))
    if cfg.run.id:
        path = root / cfg.run.name / str(cfg.run.id)
        return RunDir(run_id=str(cfg.run.id), path=path, resumed=RunPaths(path).config.exists())
    run_id = new_run_id()
    while (root / cfg.run.name / run_id).exists():  # a fresh id never resumes somebody else's run
        run_id = new_run_id()
    return RunDir(run_id=run_id, path=root / cfg.run.name / run_id, resumed=False)


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
    raise ConfigError([Problem(
        "run.resume", f"no run {resume!r} found (looked for {CONFIG} in {resume} and in {root}/*/{resume})",
        "pass a run directory path or the id of a run under run.root (ls the run root to see them)",
    )])


def create_run_dir(cfg: DictConfig, run: RunDir) -> Path:
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
