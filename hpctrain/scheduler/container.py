"""Containers: what pyxis/enroot and Apptainer need on the job's srun line, from `cluster.container`.

A job makes one srun step (the line submitit writes into the batch script), and every process of the job but the
supervisor starts inside it: the node agents, the workers they fork, the hot spares and the pre-flight. So one
srun line carries the container to all of them:

- pyxis is a Slurm plugin: its options go on srun itself (`--container-image=...`), and the command is the image's
  interpreter (`python -u -m submitit.core._submit FOLDER`);
- Apptainer is a command: srun starts `apptainer exec [options] IMAGE python -u -m submitit.core._submit FOLDER`.

The supervisor (the batch script's last line) runs on the batch host, outside the container: it calls sbatch and
scontrol, which images rarely hold. The run directory is always mounted at its own path: the tasks write it.
Pure functions of the config, so the dry run, the golden files and the submission render the same lines.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.config.schema import ContainerConfig

PYXIS, APPTAINER = "pyxis", "apptainer"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def runtime(container: ContainerConfig) -> str:
    """The runtime's name ("none", "pyxis", "apptainer"), from the config's enum or a plain string."""
    return str(getattr(container.runtime, "value", container.runtime))


def parse_mount(spec: str) -> tuple[str, str, str]:
    """`host:container[:flags]` -> (host, container, flags); ValueError saying what is wrong. Both paths must be
    absolute: the tasks start on other nodes, in another working directory (and pyxis refuses a relative one)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts[:2]):
        raise ValueError(f"{spec!r} is not host_path:container_path[:flags]")
    source, target = parts[0], parts[1]
    flags = parts[2] if len(parts) == 3 else ""
    for what, path in (("host", source), ("container", target)):
        if not path.startswith("/"):
            raise ValueError(
                f"the {what} path {path!r} of {spec!r} is relative: the tasks start on other nodes, "
                "in another working directory"
            )
    if "," in spec:
        raise ValueError(f"{spec!r} holds a comma, which separates mounts on the runtime's command line")
    return source, target, flags


def _shows(spec: str, path: Path) -> bool:
    """Whether a mount already shows `path` at its own path, writable. One that does not parse shows nothing: the
    checks refuse it, and the dry run still prints the script with it as written."""
    try:
        source, target, flags = parse_mount(spec)
    except ValueError:
        return False
    inside = PurePosixPath(path).is_relative_to(source)
    return source == target and inside and "ro" not in flags.replace("+", ",").split(",")


def mounts(container: ContainerConfig, run_dir: Path) -> list[str]:
    """The configured mounts, then the run directory at its own path unless one of them shows it already."""
    listed = list(container.mounts)
    if any(_shows(spec, run_dir) for spec in listed):
        return listed
    return [*listed, f"{run_dir}:{run_dir}"]


def srun_args(container: ContainerConfig, run_dir: Path) -> list[str]:
    """pyxis' srun options (its --container-* flags, then `container.args`); [] for the other runtimes."""
    if runtime(container) != PYXIS:
        return []
    args = [f"--container-image={container.image}", f"--container-mounts={','.join(mounts(container, run_dir))}"]
    if container.workdir:
        args.append(f"--container-workdir={container.workdir}")
    if container.env:
        args.append(f"--container-env={','.join(container.env)}")
    return [*args, *container.args]


def python_command(container: ContainerConfig, run_dir: Path, gpus: bool) -> str | None:
    """The interpreter srun starts (submitit's `python`, written into the batch script as shell: every value in it
    is quoted, one word each); None without a container: this process' own interpreter, as without containers.
    Apptainer's `--nv` gives a GPU job the host's driver."""
    name = runtime(container)
    if name == PYXIS:  # one word whatever it holds: the checks refuse what is not an interpreter's name or path
        return shlex.quote(str(container.python))
    if name != APPTAINER:
        return None
    words = ["apptainer", "exec", *(["--nv"] if gpus else []), "--bind", ",".join(mounts(container, run_dir))]
    if container.workdir:
        words += ["--pwd", container.workdir]
    words += [*container.args, str(container.image), container.python]
    return shlex.join(words)


def setup_lines(container: ContainerConfig) -> list[str]:
    """Batch script lines before srun. Apptainer passes the host's variables in, but the image's own values win:
    `APPTAINERENV_NAME` overrides them (and, unlike `--env NAME=VALUE`, takes a value with a comma). A variable
    unset on the host stays unset. pyxis takes the names on srun instead (`--container-env`)."""
    if runtime(container) != APPTAINER:
        return []
    # A name is written into the line as shell: one that is not a variable's name (the checks refuse it) is left out
    return [
        f'[ -z "${{{name}+set}}" ] || export APPTAINERENV_{name}="${name}"'
        for name in map(str, container.env)
        if ENV_NAME.fullmatch(name)
    ]
