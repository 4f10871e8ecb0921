"""`cluster.container` on the srun line (hpctrain/scheduler/container.py): the pure functions, the shell lines they
write, and the submitted script. Neither runtime is installed here: the golden files (test_sbatch_golden.py) pin
the whole scripts, these tests the rules behind them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.checks.runner import check_config
from hpctrain.config.schema import ContainerConfig, ContainerRuntime
from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from hpctrain.launch.executor import build_executor, sbatch_preview
from hpctrain.scheduler import container

RUN = Path("/runs/x/RUNID")
GOLDEN = Path(__file__).parent / "golden"


def _pyxis(**kw) -> ContainerConfig:
    return ContainerConfig(runtime=ContainerRuntime.pyxis, image="nvcr.io#nvidia/pytorch:24.05-py3", **kw)


def _apptainer(**kw) -> ContainerConfig:
    return ContainerConfig(runtime=ContainerRuntime.apptainer, image="/images/pt.sif", **kw)


def test_no_container_changes_nothing() -> None:
    none = ContainerConfig()
    assert container.srun_args(none, RUN) == [] and container.setup_lines(none) == []
    assert container.python_command(none, RUN, gpus=True) is None


def test_the_run_directory_is_mounted_unless_a_mount_shows_it_writable() -> None:
    assert container.mounts(_pyxis(mounts=["/data:/data:ro"]), RUN) == ["/data:/data:ro", f"{RUN}:{RUN}"]
    assert container.mounts(_pyxis(mounts=["/runs:/runs"]), RUN) == ["/runs:/runs"]
    for elsewhere in ("/runs:/mnt/runs", "/runs:/runs:ro", "/run:/run"):  # another path, read-only, a prefix only
        assert container.mounts(_pyxis(mounts=[elsewhere]), RUN)[-1] == f"{RUN}:{RUN}", elsewhere


def test_pyxis_puts_its_flags_on_srun_and_runs_the_images_python() -> None:
    c = _pyxis(mounts=["/data:/data"], workdir="/w", env=["A", "B"], args=["--container-remap-root"])
    assert container.srun_args(c, RUN) == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts=/data:/data,{RUN}:{RUN}",
        "--container-workdir=/w",
        "--container-env=A,B",
        "--container-remap-root",
    ]
    assert container.python_command(c, RUN, gpus=True) == "python"
    assert container.setup_lines(c) == []


def test_apptainer_wraps_the_interpreter() -> None:
    c = _apptainer(mounts=["/data:/data:ro"], workdir="/w", args=["--writable-tmpfs"], python="/opt/venv/bin/python")
    words = shlex.split(container.python_command(c, RUN, gpus=True))
    assert words == [
        "apptainer",
        "exec",
        "--nv",
        "--bind",
        f"/data:/data:ro,{RUN}:{RUN}",
        "--pwd",
        "/w",
        "--writable-tmpfs",
        "/images/pt.sif",
        "/opt/venv/bin/python",
    ]
    assert "--nv" not in shlex.split(container.python_command(c, RUN, gpus=False))  # a CPU job: no driver to bind
    assert container.srun_args(c, RUN) == []


def test_the_interpreter_is_one_shell_word_whatever_it_holds() -> None:
    """pyxis' interpreter went into the srun line as written: `python; touch X; true` ran `touch X` (issue 46). The
    checks refuse it (tests/config/test_script_injection.py); the rendering quotes it anyway."""
    hostile = "python; touch X; true"
    for c in (_pyxis(python=hostile), _apptainer(python=hostile)):
        assert shlex.split(container.python_command(c, RUN, gpus=True))[-1] == hostile
    assert container.python_command(_pyxis(python="/opt/conda/bin/python"), RUN, gpus=True) == "/opt/conda/bin/python"


def test_setup_lines_leave_out_what_is_not_a_variable_name() -> None:
    """A name is written into the line as shell; one the checks refuse does not reach the script even unchecked."""
    lines = container.setup_lines(_apptainer(env=["TOKEN", 'X}"; touch M; "${Y']))
    assert lines == ['[ -z "${TOKEN+set}" ] || export APPTAINERENV_TOKEN="$TOKEN"']


def test_apptainer_passes_only_the_variables_the_host_has() -> None:
    """The setup lines run in bash as the batch script would: a set variable (even to '' or a value with a comma,
    which `--env A=B` would split) reaches APPTAINERENV_*, an unset one stays unset."""
    lines = container.setup_lines(_apptainer(env=["TOKEN", "EMPTY", "UNSET"]))
    script = "\n".join([*lines, "env | grep ^APPTAINERENV_ | sort"])
    env = {"PATH": os.environ["PATH"], "TOKEN": "a,b c", "EMPTY": ""}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["APPTAINERENV_EMPTY=", "APPTAINERENV_TOKEN=a,b c"]


@pytest.mark.parametrize(
    "spec,words",
    [
        ("/a", "is not host_path"),
        ("a:/b", "relative"),
        ("/a:b", "relative"),
        ("/a:/b:ro:x", "is not host_path"),
        ("/a,/b:/c", "comma"),
        (":/b", "not"),
    ],
)
def test_a_mount_must_be_two_absolute_paths(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        container.parse_mount(spec)


def test_a_dry_run_prints_a_bad_mount_and_the_error(compose_cfg, capsys, tmp_path: Path) -> None:
    """The plan renders the script before the errors are printed: a mount the checks refuse must not crash it."""
    cfg = compose_cfg(
        "cluster=dev",
        "cluster.container.runtime=pyxis",
        "cluster.container.image=/i.sqsh",
        "cluster.container.mounts=[data]",
        "dry_run=true",
        f"run.root={tmp_path}",
    )
    assert run(cfg).code == EXIT_CONFIG_ERROR
    out, err = capsys.readouterr()
    assert "--container-mounts=data," in out and "cluster.container.mounts[0]: " in err


@pytest.mark.parametrize(
    "mounts,warned",
    [
        ("[]", True),
        ("[/shared:/shared:ro]", False),
        ("[/shared/datasets:/data]", True),
        ("[/shared/data:/shared/data]", True),
    ],
)
def test_a_data_path_no_mount_shows_at_its_own_path_is_a_warning(compose_cfg, mounts: str, warned: bool) -> None:
    """The 1.3B experiment reads data.path=/shared/datasets/pile/train.bin: the login node's path, used as written."""
    cfg = compose_cfg(
        "+experiment=gpt3_1.3b_1node",
        "cluster.container.runtime=pyxis",
        "cluster.container.image=/i.sqsh",
        f"cluster.container.mounts={mounts}",
        "dry_run=true",
    )
    report = check_config(cfg)
    assert [w.key for w in report.warnings if "no cluster.container.mounts entry" in w.message] == (
        ["data.path"] if warned else []
    )
    assert not report.errors


@pytest.mark.parametrize(
    "runtime,args",
    [
        ("apptainer", "[-B,/shared:/shared]"),
        ("apptainer", "['-B/shared']"),
        ("pyxis", "['--container-mounts=/shared:/shared:ro']"),
    ],
)
def test_a_bind_in_args_shows_a_path_at_its_own_path(compose_cfg, runtime: str, args: str) -> None:
    """`cluster.container.args` read as the runtime reads them: its binds count for the paths' warning too."""
    image = "/i.sif" if runtime == "apptainer" else "/i.sqsh"
    cfg = compose_cfg(
        "+experiment=gpt3_1.3b_1node",
        f"cluster.container.runtime={runtime}",
        f"cluster.container.image={image}",
        f"cluster.container.args={args}",
        "dry_run=true",
    )
    report = check_config(cfg)
    assert not [w for w in report.warnings if "no cluster.container.mounts entry" in w.message]


@pytest.mark.parametrize("name", ["pyxis", "apptainer"])
def test_the_supervisor_runs_on_the_host(name: str) -> None:
    """It calls sbatch and scontrol, which images rarely hold: the batch script's last line, outside srun."""
    text = (GOLDEN / f"{name}.sbatch").read_text()
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "hpctrain.launch.supervise" not in srun and "submitit.core._submit" in srun
    assert text.rstrip().splitlines()[-1].startswith("PYTHON -m hpctrain.launch.supervise")


@pytest.mark.usefixtures("fake_sbatch")
def test_the_submitted_script_is_the_preview(compose_cfg, tmp_path: Path) -> None:
    """SlurmExecutor gets the container's interpreter too (its `python`), not only the preview."""
    cfg = compose_cfg(
        "+experiment=gpt3_1.3b_1node",
        "cluster.container.runtime=apptainer",
        "cluster.container.image=/images/pt.sif",
        "cluster.container.env=[HF_TOKEN]",
        "dry_run=true",
    )
    layout = check_config(cfg).layout
    folder = tmp_path / "run" / "submitit"
    build_executor(cfg, layout, "RUNID", folder).submit(print, "never runs")
    submitted = (folder / "4242_submission.sh").read_text()
    assert submitted == sbatch_preview(cfg, layout, "RUNID", folder)
    assert f"apptainer exec --nv --bind {folder.parent}:{folder.parent} /images/pt.sif python -u -m " in submitted
    assert sys.executable not in submitted.split("# teardown")[0]
