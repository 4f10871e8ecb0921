"""The checks of `cluster.container`: refuse on the login node what no node could start (docs/containers.md).

A container that cannot start fails every task of the job after its queue wait, with the runtime's message in
each task's log; here the mistake is named with its key and fix before anything is queued. What only the nodes
can tell (the image exists there, the registry answers) is left to them.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout
from hpctrain.config.schema import Config, parse_blend
from hpctrain.scheduler import cli_options, scheduler_for
from hpctrain.scheduler.cli_options import Word
from hpctrain.scheduler.container import (
    APPTAINER,
    ENV_NAME,
    PYXIS,
    parse_mount,
    runtime,
)

KEY = "cluster.container"
APPTAINER_URI = re.compile(r"(docker|docker-archive|oci|oci-archive|oras|library|shub|http|https)://\S+")
APPTAINER_MOUNT_FLAGS = ("ro", "rw")
# The interpreter srun (pyxis) or apptainer starts: one command name or path, written into the batch script
PYTHON = re.compile(r"[A-Za-z0-9_./][A-Za-z0-9_.+/@-]*")
# `apptainer exec` options whose meaning empties the tasks' environment: SLURM_PROCID and the rest, which submitit
# and the agents read, would be gone (variables named in cluster.container.env would still pass). --compat implies
# --containall (cmd/internal/cli/actions.go), --containall implies --cleanenv (launcher_linux.go).
APPTAINER_CLEAN_ENV = {
    "cleanenv": "",
    "containall": " (--contain, and a PID, IPC and environment of their own)",
    "compat": " (OCI compatibility, which implies --containall)",
}
# Host variables the tasks must find: Slurm's, submitit's (the batch script exports SUBMITIT_EXECUTOR), hpctrain's
TASK_VARIABLES = ("SLURM_", "SUBMITIT_", "HPCTRAIN_")
# srun options that change how many tasks the step starts: hpctrain asks for the ones its layout needs
STEP_SHAPE = ("ntasks", "nodes", "ntasks-per-node")


def _expanded(key: str, value: str, r: CheckReport) -> bool:
    """A '$' or a backtick in a path or an image: the batch script passes the value to srun and the runtime quoted,
    as one word, so no shell expands `$USER` or `$(...)` in it; the runtime would look for a name holding them."""
    found = next((ch for ch in ("$", "`") if ch in value), None)
    if found is None:
        return False
    r.error(
        key,
        f"{value!r} holds {found!r}: the batch script passes it to the runtime as written (quoted, one "
        "word), so no shell would expand it",
        "write the value out; to take a variable from this machine's "
        "environment when submitting, use OmegaConf's resolver, e.g. /scratch/${oc.env:USER}",
    )
    return True


def _image(name: str, image: str, r: CheckReport) -> None:
    """Apptainer takes a file (absolute: the tasks start in another directory) or a URI; pyxis an enroot
    reference, whose registry is separated by '#' (nvcr.io#nvidia/pytorch), or an absolute squashfs file."""
    key = f"{KEY}.image"
    if _expanded(key, image, r):
        return
    if any(ch.isspace() for ch in image):
        r.error(key, f"{image!r} holds a blank: an image is one word on the srun line", "remove the blank")
        return
    if image.startswith("-"):
        r.error(key, f"{image!r} starts with '-': the runtime would read it as an option", "name the image")
        return
    if name == APPTAINER:
        if not image.startswith("/") and not APPTAINER_URI.fullmatch(image):
            r.error(
                key,
                f"{image!r} is a relative path: srun starts apptainer on other nodes, in another working directory",
                f"give the image's absolute path, e.g. {KEY}.image=/shared/images/pytorch.sif",
            )
        return
    path_like = image.startswith((".", "~")) or image.endswith((".sqsh", ".sif", ".squashfs"))
    if path_like and not image.startswith("/"):
        r.error(
            key,
            f"{image!r} is a relative path: pyxis reads a squashfs file at its path on each node",
            f"give the file's absolute path, e.g. {KEY}.image=/shared/images/pytorch.sqsh",
        )
    elif image.endswith(".sif"):
        r.error(
            key,
            f"{image!r} is an Apptainer image: pyxis/enroot imports squashfs files (.sqsh) and registry images",
            f"set {KEY}.runtime=apptainer, or convert it (enroot import) to a .sqsh",
        )
    elif not image.startswith("/") and "#" not in image and "." in image.split("/")[0] and "/" in image:
        registry, _, rest = image.partition("/")
        r.error(
            key,
            f"{image!r}: enroot separates the registry from the image with '#', so pyxis would look for "
            f"an image named {image} on Docker Hub",
            f"use {KEY}.image='{registry}#{rest}'",
        )


def _python(python: str, r: CheckReport) -> None:
    """The interpreter is one command name or path: srun (pyxis) or apptainer starts it, from the batch script."""
    key = f"{KEY}.python"
    if not python.strip():
        r.error(key, "is empty: srun needs the image's interpreter", f"use {key}=python")
    elif not PYTHON.fullmatch(python):
        bad = next((ch for ch in python if not PYTHON.fullmatch(f"a{ch}")), None)
        what = f"holds {'a blank' if bad.isspace() else repr(bad)}" if bad else f"starts with {python[0]!r}"
        r.error(
            key,
            f"{python!r} {what}: it must be the name or path of the image's interpreter, one word that "
            "srun or apptainer starts with submitit's arguments",
            "name the interpreter, e.g. python3 or /opt/conda/bin/python",
        )


def job_paths(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of each absolute path the tasks read or write besides the run directory (which is mounted)."""
    d = cfg.data
    paths = [("data.path", d.path), ("model.init_from", cfg.model.init_from), ("zero.nvme_path", cfg.zero.nvme_path)]
    for key in ("blend", "valid_blend"):
        try:
            paths += [(f"data.{key}", prefix) for _, prefix in parse_blend(getattr(d, key) or "")]
        except ValueError:
            pass  # the data checks report it
    paths += [(f"checkpoint.tiers[{i}].path", tier.path) for i, tier in enumerate(cfg.checkpoint.tiers)]
    return [(key, str(path)) for key, path in paths if path and str(path).startswith("/")]


def run_dir_parts(cfg: Config) -> list[tuple[str, str]]:
    """(key, text) of what makes the run directory `run.root/run.name/run.id` (the root resolved as the launcher
    resolves it: from this working directory); [] for a resume, whose directory exists already."""
    if cfg.run.resume:
        return []
    root = str(Path(str(cfg.run.root)).expanduser().resolve())
    return [("run.root", root), ("run.name", str(cfg.run.name)), ("run.id", str(cfg.run.id or ""))]


def _arg_mounts(name: str, words: list[Word]) -> list[tuple[str, str]]:
    """(source, target) of the binds `cluster.container.args` adds: apptainer's --bind src[:dest[:opts]] (dest
    defaults to src), pyxis' --container-mounts SRC:DST[:FLAGS]."""
    option = "bind" if name == APPTAINER else "container-mounts"
    shown = []
    for _, spec in cli_options.values(words, option):
        parts = spec.split(":")
        shown.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return shown


def _paths_inside(cfg: Config, words: list[Word], r: CheckReport) -> None:
    """The config's paths are the login node's (its file checks read them there) and the tasks use them as written:
    a mount must show each at the same path. A warning: the site's runtime may mount it by default (enroot's
    mount configuration; Apptainer's bind path, $HOME, /tmp, /dev)."""
    shown = _arg_mounts(runtime(cfg.cluster.container), words)
    for spec in cfg.cluster.container.mounts:
        try:
            source, target, _ = parse_mount(str(spec))
        except ValueError:
            continue  # refused above
        shown.append((source, target))
    for key, path in job_paths(cfg):
        if any(source == target and PurePosixPath(path).is_relative_to(target) for source, target in shown):
            continue
        r.warn(
            key,
            f"{path} is used inside the container as written, and no {KEY}.mounts entry shows it at that path",
            f"mount it at its own path, e.g. {KEY}.mounts=[...,{path}:{path}], unless the site's "
            "runtime mounts it by default",
        )


def _as_written(word: Word) -> str:
    """How the option was written, and what it means when that is not its long name: `-ceC (--cleanenv)`."""
    return word.written if word.written.startswith(f"--{word.name}") else f"{word.written} (--{word.name})"


def _syntax(key: str, program: str, words: list[Word], r: CheckReport) -> None:
    """What the runtime's parser itself would refuse or misread: the same for apptainer and srun."""
    after = "the image" if program == "apptainer" else "the next word hpctrain writes on the srun line"
    for w in words:
        if w.kind == "positional":
            r.error(
                key,
                f"{w.written!r} (word {w.index}) is not an option: {program} ends its options there and "
                f"would take it as {'the image' if program == 'apptainer' else 'the command to run'}",
                "remove it, or join an option and its value in one word: --name=value",
            )
        elif w.kind == "missing":
            r.error(
                key,
                f"{w.written} takes a value and none follows: {program} would take {after} as its value",
                f"give it its value, e.g. --{w.name}=VALUE, or remove it",
            )
        elif w.kind == "invalid":
            r.error(
                key,
                f"{w.written}: {w.why}; {program} refuses it on every node",
                "write the option's full name with a value it takes, or remove it",
            )
        elif w.kind == "unknown":
            r.warn(
                key,
                f"{w.written} is not an option hpctrain knows {program} to take{f' ({w.why})' if w.why else ''}"
                f": {program} refuses an unknown option on every node, and its value (if any) cannot be told "
                "from the next word",
                f"check it against `{program} {'exec ' if program == 'apptainer' else ''}"
                "--help` on the nodes; write a value as --name=value",
            )


def _apptainer_args(cfg: Config, words: list[Word], r: CheckReport) -> None:
    """`apptainer exec` options by meaning (cli_options.parse_apptainer): the last occurrence of each counts."""
    key = f"{KEY}.args"
    _syntax(key, "apptainer", words, r)
    for name, implies in APPTAINER_CLEAN_ENV.items():
        w = cli_options.final(words, name)
        if w is not None and w.value == "true":
            r.error(
                key,
                f"{_as_written(w)} starts the tasks without the host's environment{implies}: submitit and "
                "the node agents read Slurm's variables (SLURM_PROCID, SLURM_JOB_ID...) and would not find them",
                f"remove {w.written}; list the variables the image must take from the host in {KEY}.env",
            )
    net = cli_options.final(words, "net")  # (--netns-path may name the host's own namespace: left alone)
    if net is not None and net.value == "true":
        r.error(
            key,
            f"{_as_written(net)} runs the tasks in a network namespace of their own (a bridge behind NAT, "
            "or none): the rendezvous and NCCL listen at each node's own address, which the other nodes and "
            "tasks could not reach",
            f"remove {net.written}: the tasks use the host's network",
        )
    secrets = {str(name) for name in dict(cfg.cluster.env)}
    for w, var in cli_options.values(words, "no-env"):
        if var.startswith(TASK_VARIABLES) or var in secrets:
            r.error(
                key,
                f"{_as_written(w)} keeps {var} from the tasks: submitit, the agents and hpctrain read "
                "SLURM_*, SUBMITIT_* and HPCTRAIN_* there, and cluster.env's credentials reach the tasks through "
                "the environment",
                f"remove {var} from --no-env",
            )
    nv, nvccli = cli_options.final(words, "nv"), cli_options.final(words, "nvccli")
    if (
        cfg.cluster.gpu_type != "cpu"
        and nv is not None
        and nv.value == "false"
        and not (nvccli and nvccli.value == "true")
    ):
        r.error(
            key,
            f"{_as_written(nv)} comes after the --nv hpctrain writes for a GPU job (cluster.gpu_type="
            f"{cfg.cluster.gpu_type}): the tasks would not see the GPUs' driver",
            f"remove {nv.written}",
        )


def _srun_options(cfg: Config, key: str, words: list[Word], r: CheckReport) -> None:
    """srun's options (pyxis' among them) by meaning (cli_options.parse_srun): `cluster.srun_args` and pyxis'
    `cluster.container.args`, which hpctrain writes on the one srun line."""
    c = cfg.cluster.container
    _syntax(key, "srun", words, r)
    export = cli_options.final(words, "export")
    if export is not None and "ALL" not in (export.value or "").split(","):
        r.error(
            key,
            f"{_as_written(export)} starts the tasks with Slurm's variables only (and those it lists): "
            "SUBMITIT_EXECUTOR, which the batch script exports for submitit, the setup lines' variables and the "
            "credentials hpctrain passes through the environment would be missing",
            "remove it, or keep the environment: --export=ALL,NAME=value",
        )
    for name in STEP_SHAPE:
        w = cli_options.final(words, name)
        if w is not None:
            r.error(
                key,
                f"{_as_written(w)} changes the tasks the step starts: hpctrain asks for the tasks its layout "
                "needs (one per node with the agents, one per rank without), and the ranks count on them",
                f"remove {w.written}; set cluster.nodes and cluster.gpus_per_node",
            )
    image = cli_options.final(words, "container-image")
    if image is not None:
        why = (
            "hpctrain writes --container-image from cluster.container.image, and pyxis refuses a second, different one"
            if runtime(c) == PYXIS
            else "the tasks would start in an image hpctrain knows nothing "
            f"of (cluster.container.runtime={runtime(c)}), running this machine's interpreter path"
        )
        r.error(key, f"{image.written}: {why}", f"remove it; set {KEY}.runtime=pyxis and {KEY}.image")
    workdir = cli_options.final(words, "container-workdir")
    if workdir is not None and runtime(c) == PYXIS and c.workdir and workdir.value != str(c.workdir):
        r.error(
            key,
            f"{workdir.written}: hpctrain writes --container-workdir={c.workdir} ({KEY}.workdir), and "
            "pyxis refuses a second, different one",
            f"set {KEY}.workdir only",
        )
    for w, namespace in cli_options.values(words, "container-unshare"):
        if namespace == "net":
            r.error(
                key,
                f"{w.written} runs the tasks in a network namespace of their own: the rendezvous and NCCL "
                "listen at each node's own address, which the other nodes could not reach",
                "remove net from --container-unshare: the tasks use the host's network",
            )


def _run_dir(cfg: Config, r: CheckReport) -> None:
    """The run directory is mounted as `DIR:DIR`, and both runtimes split mounts at ',' and a mount at ':'."""
    for key, text in run_dir_parts(cfg):
        bad = next((ch for ch in ":," if ch in text), None)
        if bad:
            r.error(
                key,
                f"{text!r} holds {bad!r}: the run directory is mounted into the container as DIR:DIR, and "
                "the runtimes split mounts at ',' and each mount at ':'",
                f"choose a {key} without ':' or ','",
            )


def container_checks(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Runtime and image together, absolute paths, mounts the runtime's command line takes, variable names, and the
    runtime options by what they mean to the runtime (hpctrain/scheduler/cli_options.py)."""
    c = cfg.cluster.container
    name = runtime(c)
    backend = scheduler_for(cfg.cluster.executor)
    can = backend.capabilities
    if can.srun_args:
        _srun_options(cfg, "cluster.srun_args", cli_options.parse_srun([str(a) for a in cfg.cluster.srun_args]), r)
    if name == "none":
        if c.image:
            r.error(
                f"{KEY}.image",
                f"{c.image} is set but {KEY}.runtime=none: the tasks would run outside it",
                f"set {KEY}.runtime=pyxis or {KEY}.runtime=apptainer, or remove {KEY}.image",
            )
        return
    if not can.containers:
        r.error(
            f"{KEY}.runtime",
            f"{name} starts the tasks through Slurm's srun, but cluster.executor={backend.name} "
            + ("runs them as processes of this machine" if can.runs_here else "starts them")
            + ", outside any container",
            f"use {KEY}.runtime=none on this machine, or submit to Slurm (cluster=slurm, or your site's cluster)",
        )
    if not c.image:
        example = "nvcr.io#nvidia/pytorch:24.05-py3" if name == PYXIS else "/shared/images/pytorch.sif"
        r.error(f"{KEY}.image", f"{KEY}.runtime={name} needs an image", f"set {KEY}.image, e.g. {example}")
    else:
        _image(name, str(c.image), r)
    for i, spec in enumerate(c.mounts):
        key = f"{KEY}.mounts[{i}]"
        if _expanded(key, str(spec), r):
            continue
        try:
            _, _, flags = parse_mount(str(spec))
        except ValueError as e:
            r.error(key, str(e), "write it as /host/path:/container/path, or /host/path:/container/path:ro")
            continue
        if name == APPTAINER and flags and flags not in APPTAINER_MOUNT_FLAGS:
            r.error(key, f"apptainer takes ro or rw after a bind's paths, got {flags!r}", "use :ro or :rw, or none")
    args = [str(arg) for arg in c.args]
    words = cli_options.parse_apptainer(args) if name == APPTAINER else cli_options.parse_srun(args)
    if name == APPTAINER:
        _apptainer_args(cfg, words, r)
    else:
        _srun_options(cfg, f"{KEY}.args", words, r)
    if (
        c.workdir is not None
        and not _expanded(f"{KEY}.workdir", str(c.workdir), r)
        and not str(c.workdir).startswith("/")
    ):
        r.error(
            f"{KEY}.workdir",
            f"{c.workdir!r} is relative: it names a directory inside the container",
            f"give an absolute path, e.g. {KEY}.workdir=/workspace",
        )
    for i, var in enumerate(c.env):
        if not ENV_NAME.fullmatch(str(var)):
            r.error(
                f"{KEY}.env[{i}]",
                f"{str(var)!r} is not an environment variable name: {KEY}.env lists the "
                "names of host variables to pass in (their values stay out of the config)",
                f"list the name only, e.g. {KEY}.env=[HF_TOKEN], and export the variable before submitting",
            )
    _python(str(c.python), r)
    _run_dir(cfg, r)
    _paths_inside(cfg, words, r)
