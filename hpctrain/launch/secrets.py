"""Credentials in `cluster.env`: kept out of every file and printout, handed to the job through the environment.

A value whose key looks like a credential (`*_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*`, any case), such as
`+cluster.env.WANDB_API_KEY=...`, would otherwise be printed in the plan and written to `config.yaml`,
`plan.json` and the job's pickle. Instead:

- the config the plan, `config.yaml` and `plan.json` see holds `<redacted>` (`redact`);
- the config the tasks get (the pickle) holds no entry for it, so `task_environment` does not set it
  (`without_redacted`);
- the value is exported into the environment of this process just before the submission (`export`): sbatch
  passes the submitting environment on to the job (`--export=ALL`, Slurm's default), and so does submitit's
  local executor, so the tasks find it where W&B and the other libraries read it.

A resumed run's saved config holds `<redacted>`: the job then takes the value from the environment the resume
is submitted from (a warning says so when it is not set there).
"""

from __future__ import annotations

import os
import re
from typing import Any

from hpctrain.config.problems import CheckReport

REDACTED = "<redacted>"
_CREDENTIAL = re.compile(r"(_KEY|_TOKEN|_SECRET)$|PASSWORD", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    return bool(_CREDENTIAL.search(str(name)))


def redact(cfg: Any, report: CheckReport | None = None) -> dict[str, str]:
    """Replace the credential values of `cfg.cluster.env` by `<redacted>`, warn about each in `report`, and
    return them by variable name (the values to export for the job)."""
    env = cfg.cluster.env
    secrets: dict[str, str] = {}
    for name in [str(k) for k in env.keys()]:
        if not looks_secret(name):
            continue
        value = str(env[name])
        key = f"cluster.env.{name}"
        how = (f"export {name}=... in the shell you submit from, and leave it out of the command line: sbatch passes "
               "that environment on to the job (--export=ALL, Slurm's default; submitit's local executor does the "
               "same)" + (", and W&B reads WANDB_API_KEY from it" if name.upper() == "WANDB_API_KEY" else ""))
        if value == REDACTED:  # a resumed run: its saved config never held the value
            if not os.environ.get(name) and report is not None:
                report.warn(key, f"looks like a credential, so the run's saved config holds no value for it, and "
                            f"{name} is not set in this environment: the job will run without it", how)
            continue
        secrets[name] = value
        env[name] = REDACTED
        if report is not None:
            report.warn(key, f"looks like a credential: its value is kept out of the plan, config.yaml and plan.json "
                        f"(written as {REDACTED}) and reaches the job only through the environment of this "
                        "submission; a value on the command line stays in the shell's history and in ps", how)
    return secrets


def without_redacted(config: dict[str, Any]) -> dict[str, Any]:
    """The task's config (a plain container): `cluster.env` without the redacted entries, so the tasks take those
    variables from the environment they inherit instead of setting them to `<redacted>`."""
    env = config.get("cluster", {}).get("env") or {}
    config["cluster"]["env"] = {k: v for k, v in env.items() if v != REDACTED}
    return config


def export(secrets: dict[str, str]) -> None:
    """Put the credentials into this process's environment, which the submission (sbatch, or the local
    executor's processes) passes on to the job."""
    os.environ.update(secrets)


def redact_text(text: str) -> str:
    """An override or a line that may carry a credential (`+cluster.env.WANDB_API_KEY=abc`), its value hidden."""
    key, sep, _ = text.partition("=")
    name = key.rsplit(".", 1)[-1]
    return f"{key}{sep}{REDACTED}" if sep and key.lstrip("+~").startswith("cluster.env.") and looks_secret(name) \
        else text
