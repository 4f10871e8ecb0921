"""Credentials in `cluster.env`: kept out of every file and printout, handed to the job through the environment.

A value whose name looks like a credential (a word KEY, TOKEN, SECRET, PASS, PASSWD, PAT, AUTH, SESSION, COOKIE,
CREDENTIALS..., or PASSWORD or SECRET anywhere, any case: `looks_secret`), such as `+cluster.env.WANDB_API_KEY=...`
or `+cluster.env.GITHUB_PAT=...`, or whose value looks like one whatever the name (`hf_...`, `ghp_...`, `sk-...`, a
JWT, an AWS `AKIA...` id, a URL with a password: `secret_value`), would otherwise be printed in the plan and
written to `config.yaml`, `plan.json` and the job's pickle. Instead:

- the config the plan, `config.yaml` and `plan.json` see holds `<redacted>` (`redact`), and the plan says so, one
  line per variable (`cluster.env.TOKEN: redacted (...)`);
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

from hpctrain.checks.report import CheckReport
from hpctrain.config.schema import ClusterConfig

REDACTED = "<redacted>"
# A name holds a credential when one of its words (split at _, -, . and camelCase) is one of WORDS or ends in one of
# SUFFIXES, or anywhere it spells one of INSIDE: HF_TOKEN, MY_API_KEY, GITHUB_PAT, SSH_KEY, AUTH, SESSION, COOKIE,
# NGROK_AUTHTOKEN, passwordfile, AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS. Whole words keep
# TOKENIZERS_PARALLELISM, KEYBOARD, PATH and PWD (the shell's directory) out.
WORDS = {
    "KEY",
    "KEYS",
    "TOKEN",
    "TOKENS",
    "SECRET",
    "SECRETS",
    "PASS",
    "PASSWD",
    "PASSWORD",
    "PASSPHRASE",
    "PAT",
    "AUTH",
    "AUTHORIZATION",
    "SESSION",
    "COOKIE",
    "COOKIES",
    "CREDENTIAL",
    "CREDENTIALS",
    "CREDS",
    "SIGNATURE",
}
SUFFIXES = ("TOKEN", "APIKEY", "ACCESSKEY", "SECRETKEY", "PRIVATEKEY")
INSIDE = ("PASSWORD", "PASSWD", "SECRET", "CREDENTIAL")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# A value that is a credential whatever its name: Hugging Face (hf_), GitHub (ghp_, gho_, ghu_, ghs_, ghr_,
# github_pat_), OpenAI and Anthropic (sk-), Stripe (sk_live_), Slack (xoxb-...), GitLab (glpat-), Google API keys
# (AIza), AWS access key ids (AKIA, ASIA), JSON Web Tokens (three base64url parts, the first a JSON object), a
# PEM private key, and a URL with a password in it (scheme://user:password@host).
VALUE_PATTERNS = {
    "a Hugging Face token": r"\bhf_[A-Za-z0-9]{20,}",
    "a GitHub token": r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})",
    "an API secret key (sk-...)": r"\bsk-[A-Za-z0-9_-]{20,}",
    "a Stripe secret key": r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}",
    "a Slack token": r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
    "a GitLab token": r"\bglpat-[A-Za-z0-9_-]{20,}",
    "a Google API key": r"\bAIza[A-Za-z0-9_-]{35}",
    "an AWS access key id": r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",
    "a JSON Web Token": r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
    "a private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "a URL with a password": r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:[^/\s@]+@",
}
_VALUE = {what: re.compile(pattern) for what, pattern in VALUE_PATTERNS.items()}


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    name = str(name)
    words = [w.upper() for w in _WORD.findall(name)]
    upper = name.upper()
    return any(w in WORDS or w.endswith(SUFFIXES) for w in words) or any(part in upper for part in INSIDE)


def secret_value(value: object) -> str:
    """What a value is when it looks like a credential whatever its variable's name ("a Hugging Face token"),
    else ""."""
    text = str(value)
    return next((what for what, pattern in _VALUE.items() if pattern.search(text)), "")


def is_secret(name: str, value: object = None) -> bool:
    """A credential by its name, or by its value."""
    return looks_secret(name) or (value is not None and str(value) != REDACTED and bool(secret_value(value)))


def redacted_keys(cluster: ClusterConfig) -> list[str]:
    """The cluster.env keys whose value the plan, config.yaml and plan.json hold as <redacted>."""
    return [f"cluster.env.{k}" for k, v in cluster.env.items() if str(v) == REDACTED]


def redact(cluster: ClusterConfig, report: CheckReport | None = None) -> dict[str, str]:
    """Replace the credential values of `cluster.env` by `<redacted>`, warn about each in `report`, and return
    them by variable name (the values to export for the job)."""
    env = cluster.env
    secrets: dict[str, str] = {}
    for name in [str(k) for k in env.keys()]:
        value = str(env[name])
        by_value = "" if looks_secret(name) or value == REDACTED else secret_value(value)
        if not (by_value or looks_secret(name) or value == REDACTED):
            continue
        key = f"cluster.env.{name}"
        how = (
            f"export {name}=... in the shell you submit from, and leave it out of the command line: sbatch passes "
            "that environment on to the job (--export=ALL, Slurm's default; submitit's local executor does the "
            "same)" + (", and W&B reads WANDB_API_KEY from it" if name.upper() == "WANDB_API_KEY" else "")
        )
        if value == REDACTED:  # a resumed run: its saved config never held the value (by its name or its value)
            if not os.environ.get(name) and report is not None:
                report.warn(
                    key,
                    f"looks like a credential, so the run's saved config holds no value for it, and "
                    f"{name} is not set in this environment: the job will run without it",
                    how,
                )
            continue
        secrets[name] = value
        env[name] = REDACTED
        if report is not None:
            why = f"its value looks like {by_value}" if by_value else "looks like a credential"
            report.warn(
                key,
                f"{why}: its value is kept out of the plan, config.yaml and plan.json "
                f"(written as {REDACTED}) and reaches the job only through the environment of this "
                "submission; a value on the command line stays in the shell's history and in ps",
                how,
            )
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
    """An override or a line that may carry a credential (`+cluster.env.WANDB_API_KEY=abc`, or any key=value
    whose value looks like a token), its value hidden."""
    key, sep, value = text.partition("=")
    name = key.rsplit(".", 1)[-1]
    env = key.lstrip("+~").startswith("cluster.env.") and looks_secret(name)
    return f"{key}{sep}{REDACTED}" if sep and (env or secret_value(value)) else text


_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*)(['\"]?\s*[:=]\s*['\"]?)(?!<redacted>)([^,\s'\"\]}]+)")


def redact_assignments(text: str) -> str:
    """Free text that may carry credentials (the lines Hydra logs for a sweep's points, its multirun.yaml): each
    `NAME=value` or `NAME: value` whose name `looks_secret`, and every value that looks like a credential
    (`secret_value`), hidden."""

    def hide(m: re.Match[str]) -> str:
        name, sep, value = m.groups()
        secret = looks_secret(name.rsplit(".", 1)[-1]) or bool(secret_value(value))
        return f"{name}{sep}{REDACTED}" if secret else m.group(0)

    text = _ASSIGNMENT.sub(hide, text)
    for pattern in _VALUE.values():
        text = pattern.sub(REDACTED, text)
    return text
