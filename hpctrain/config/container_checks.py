"""The checks of `cluster.container`: refuse on the login node what no node could start (docs/containers.md).

A container that cannot start fails every task of the job after its queue wait, with the runtime's message in
each task's log; here the mistake is named with its key and fix before anything is queued. What only the nodes
can tell (the image exists there, the registry answers) is left to them.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from hpctrain.config.layout import Layout
from hpctrain.config.problems import CheckReport
from hpctrain.config.schema import Config, Executor, parse_blend
from hpctrain.scheduler.container import APPTAINER, PYXIS, parse_mount, runtime

KEY = "cluster.container"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
APPTAINER_URI = re.compile(r"(docker|docker-archive|oci|oci-archive|oras|library|shub|http|https)://\S+")
APPTAINER_MOUNT_FLAGS = ("ro", "rw")
# apptainer exec options that empty the tasks' environment: SLURM_PROCID and the rest, which submitit and the
# agents read, would be gone (variables named in cluster.container.env would still pass)
APPTAINER_CLEAN_ENV = ("--cleanenv", "-e", "--containall", "-C")


def _image(name: str, image: str, r: CheckReport) -> None:
    """Apptainer takes a file (absolute: the tasks start in another directory) or a URI; pyxis an enroot
    reference, whose registry is separated by '#' (nvcr.io#nvidia/pytorch), or an absolute squashfs file."""
    key = f"{KEY}.image"
    if any(ch.isspace() for ch in image):
        r.error(key, f"{image!r} holds a blank: an image is one word on the srun line", "remove the blank")
        return
    if name == APPTAINER:
        if not image.startswith("/") and not APPTAINER_URI.fullmatch(image):
            r.error(key, f"{image!r} is a relative path: srun starts apptainer on other nodes, in another working "
                    "directory", f"give the image's absolute path, e.g. {KEY}.image=/shared/images/pytorch.sif")
        return
    path_like = image.startswith((".", "~")) or image.endswith((".sqsh", ".sif", ".squashfs"))
    if path_like and not image.startswith("/"):
        r.error(key, f"{image!r} is a relative path: pyxis reads a squashfs file at its path on each node",
                f"give the file's absolute path, e.g. {KEY}.image=/shared/images/pytorch.sqsh")
    elif image.endswith(".sif"):
        r.error(key, f"{image!r} is an Apptainer image: pyxis/enroot imports squashfs files (.sqsh) and registry "
                "images", f"set {KEY}.runtime=apptainer, or convert it (enroot import) to a .sqsh")
    elif not image.startswith("/") and "#" not in image and "." in image.split("/")[0] and "/" in image:
        registry, _, rest = image.partition("/")
        r.error(key, f"{image!r}: enroot separates the registry from the image with '#', so pyxis would look for "
                f"an image named {image} on Docker Hub", f"use {KEY}.image='{registry}#{rest}'")


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


def _paths_inside(cfg: Config, r: CheckReport) -> None:
    """The config's paths are the login node's (its file checks read them there) and the tasks use them as written:
    a mount must show each at the same path. A warning: the site's runtime may mount it by default (enroot's
    mount configuration; Apptainer's bind path, $HOME, /tmp, /dev)."""
    shown = []
    for spec in cfg.cluster.container.mounts:
        try:
            source, target, _ = parse_mount(str(spec))
        except ValueError:
            continue  # refused above
        shown.append((source, target))
    for key, path in job_paths(cfg):
        if any(source == target and PurePosixPath(path).is_relative_to(target) for source, target in shown):
            continue
        r.warn(key, f"{path} is used inside the container as written, and no {KEY}.mounts entry shows it at that "
               "path", f"mount it at its own path, e.g. {KEY}.mounts=[...,{path}:{path}], unless the site's "
               "runtime mounts it by default")


def container_checks(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Runtime and image together, absolute paths, mounts the runtime's command line takes, variable names."""
    c = cfg.cluster.container
    name = runtime(c)
    if name == "none":
        if c.image:
            r.error(f"{KEY}.image", f"{c.image} is set but {KEY}.runtime=none: the tasks would run outside it",
                    f"set {KEY}.runtime=pyxis or {KEY}.runtime=apptainer, or remove {KEY}.image")
        return
    if cfg.cluster.executor == Executor.local:
        r.error(f"{KEY}.runtime", f"{name} starts the tasks through Slurm's srun, but cluster.executor=local runs "
                "them as processes of this machine, outside any container", f"use {KEY}.runtime=none on this "
                "machine, or submit to Slurm (cluster=slurm, or your site's cluster)")
    if not c.image:
        example = "nvcr.io#nvidia/pytorch:24.05-py3" if name == PYXIS else "/shared/images/pytorch.sif"
        r.error(f"{KEY}.image", f"{KEY}.runtime={name} needs an image", f"set {KEY}.image, e.g. {example}")
    else:
        _image(name, str(c.image), r)
    for i, spec in enumerate(c.mounts):
        key = f"{KEY}.mounts[{i}]"
        try:
            _, _, flags = parse_mount(str(spec))
        except ValueError as e:
            r.error(key, str(e), "write it as /host/path:/container/path, or /host/path:/container/path:ro")
            continue
        if name == APPTAINER and flags and flags not in APPTAINER_MOUNT_FLAGS:
            r.error(key, f"apptainer takes ro or rw after a bind's paths, got {flags!r}", "use :ro or :rw, or none")
    cleaning = [arg for arg in c.args if name == APPTAINER and str(arg) in APPTAINER_CLEAN_ENV]
    if cleaning:
        r.error(f"{KEY}.args", f"{cleaning[0]} starts the tasks without the host's environment: submitit and the "
                "node agents read Slurm's variables (SLURM_PROCID, SLURM_JOB_ID...) and would not find them",
                f"remove {cleaning[0]}; list the variables the image must take from the host in {KEY}.env")
    if c.workdir is not None and not str(c.workdir).startswith("/"):
        r.error(f"{KEY}.workdir", f"{c.workdir!r} is relative: it names a directory inside the container",
                f"give an absolute path, e.g. {KEY}.workdir=/workspace")
    for i, var in enumerate(c.env):
        if not ENV_NAME.fullmatch(str(var)):
            r.error(f"{KEY}.env[{i}]", f"{str(var)!r} is not an environment variable name: {KEY}.env lists the "
                    "names of host variables to pass in (their values stay out of the config)",
                    f"list the name only, e.g. {KEY}.env=[HF_TOKEN], and export the variable before submitting")
    if not str(c.python).strip():
        r.error(f"{KEY}.python", "is empty: srun needs the image's interpreter", f"use {KEY}.python=python")
    _paths_inside(cfg, r)
