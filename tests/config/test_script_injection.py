"""Hostile values for every config key that reaches the generated batch script, and runtime options judged by what
they mean to the runtime (issue 46: "Shell injection", "Checks that match spellings, not meanings").

Each hostile value is either refused by the checks (exit 2 through `hpctrain.launch.cli.run`, the key named with a
fix, nothing on disk) or rendered into the real batch script (the dry run's `sbatch_preview`, which is the script
SlurmExecutor submits: tests/launch/test_container.py) and run under bash. On PATH, shims stand in for what this
machine lacks: `srun` finds its command the way srun does (hpctrain/scheduler/cli_options.py) and runs it,
`apptainer`, the image's `python` and the supervisor's interpreter record their arguments. The file the payload
would create (MARKER) must not exist, and the value must reach the program as one argument, unchanged. The positive
controls take the quoting out and see the same harness create MARKER.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf, open_dict

from hpctrain.checks.runner import run_checks
from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from hpctrain.launch.executor import sbatch_preview
from hpctrain.scheduler import container

# The last two hold no blank (bash's brace expansion makes `touch MARKER` of {touch,MARKER}): what refuses blanks
# (an image, a partition) lets them through to the script
PAYLOADS = [
    "x; touch MARKER; true",
    "$(touch MARKER)",
    "`touch MARKER`",
    "'; touch MARKER; '",
    "x;{touch,MARKER};true",
    "$({touch,MARKER})",
]
PAYLOAD_IDS = ["semicolon", "dollar-paren", "backtick", "quote", "braces", "dollar-braces"]
PYXIS = ["cluster=dev", "cluster.container.runtime=pyxis", "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'"]
APPTAINER = ["cluster=dev", "cluster.container.runtime=apptainer", "cluster.container.image=/shared/pytorch.sif"]
DEV = ["cluster=dev"]
SRUN_SHIM = """#!{python}
import os, sys
sys.path.insert(0, {repo!r})
from hpctrain.scheduler.cli_options import parse_srun
with open(os.environ["SHIM_LOG"], "a") as log:
    log.write("".join(arg + "\\x1f" for arg in ["srun", *sys.argv[1:]]) + "\\x1e")
words = sys.argv[1:]
first = next(w.index for w in parse_srun(words) if w.kind == "positional")  # srun's command: its first non-option
os.execvp(words[first], words[first:])
"""
RECORDER = """#!/bin/sh
printf '%s\\037' "${0##*/}" "$@" >> "$SHIM_LOG"
printf '\\036' >> "$SHIM_LOG"
"""


def _path_keys(payload: str) -> str:
    """Paths reach the script quoted; one holding '$' or a backtick is refused (nothing would expand it)."""
    return "refuse" if set(payload) & set("$`") else "quote"


def _mounts(payload: str) -> str:
    """A mount is a path too, and the runtimes split mounts at a comma: refused with one."""
    return "refuse" if set(payload) & set("$`,") else "quote"


def _images(payload: str) -> str:
    """An image is one word: refused with a blank, and as a path with '$' or a backtick; quoted otherwise."""
    return "refuse" if set(payload) & set("$` ") else "quote"


def _sbatch_names(payload: str) -> str:
    """partition, account...: a blank is refused (Slurm names have none), the rest is an #SBATCH line's value."""
    return "refuse" if " " in payload else "quote"


# (id, overrides, key set, its value for a payload, expected: "refuse" | "quote" | a function of the payload |
#  None (either: checks outside hpctrain/config/{cluster,container}_checks.py may refuse it), on the srun line)
Case = tuple[str, list[str], str, Callable[[str], Any], Any, bool]
CASES: list[Case] = [
    ("pyxis-python", PYXIS, "cluster.container.python", lambda p: p, "refuse", True),
    ("apptainer-python", APPTAINER, "cluster.container.python", lambda p: f"/opt/{p}/python", "refuse", True),
    ("pyxis-image", PYXIS, "cluster.container.image", lambda p: f"nvcr.io#nvidia/{p}", _images, True),
    ("apptainer-image", APPTAINER, "cluster.container.image", lambda p: f"/images/{p}.sif", _images, True),
    ("pyxis-mounts", PYXIS, "cluster.container.mounts", lambda p: [f"/data/{p}:/data"], _mounts, True),
    ("apptainer-mounts", APPTAINER, "cluster.container.mounts", lambda p: [f"/data/{p}:/data:ro"], _mounts, True),
    ("pyxis-workdir", PYXIS, "cluster.container.workdir", lambda p: f"/work/{p}", _path_keys, True),
    ("apptainer-workdir", APPTAINER, "cluster.container.workdir", lambda p: f"/work/{p}", _path_keys, True),
    ("pyxis-env", PYXIS, "cluster.container.env", lambda p: [p], "refuse", True),
    ("apptainer-env", APPTAINER, "cluster.container.env", lambda p: [p], "refuse", True),
    ("pyxis-args-value", PYXIS, "cluster.container.args", lambda p: [f"--container-name={p}"], "quote", True),
    ("pyxis-args-word", PYXIS, "cluster.container.args", lambda p: [p], "refuse", True),
    ("apptainer-args-value", APPTAINER, "cluster.container.args", lambda p: ["--env", f"A={p}"], "quote", True),
    ("apptainer-args-word", APPTAINER, "cluster.container.args", lambda p: [p], "refuse", True),
    ("srun-args-value", DEV, "cluster.srun_args", lambda p: [f"--comment={p}"], "quote", True),
    ("srun-args-word", DEV, "cluster.srun_args", lambda p: [p], "refuse", True),
    ("partition", DEV, "cluster.partition", lambda p: p, _sbatch_names, False),
    ("account", DEV, "cluster.account", lambda p: p, _sbatch_names, False),
    ("qos", DEV, "cluster.qos", lambda p: p, _sbatch_names, False),
    ("constraint", DEV, "cluster.constraint", lambda p: p, _sbatch_names, False),
    ("exclude", DEV, "cluster.exclude", lambda p: p, _sbatch_names, False),
    ("sbatch-extra", DEV, "cluster.sbatch_extra.comment", lambda p: p, "quote", False),
    ("cluster-env", DEV, "cluster.env.HOSTILE", lambda p: p, "quote", False),
    ("run-name", DEV, "run.name", lambda p: p, None, True),  # the job's name and the log paths
    ("run-id", DEV, "run.id", lambda p: p, None, True),
    ("run-name-pyxis", PYXIS, "run.name", lambda p: p, None, True),  # the run directory's mount too
    ("run-id-apptainer", APPTAINER, "run.id", lambda p: p, None, True),
    ("run-root", DEV, "run.root", lambda p: p, None, True),  # set below to a directory named by the payload
]


@pytest.fixture
def shims(tmp_path: Path) -> Path:
    """srun (runs its command as srun would), and recorders for apptainer, enroot, sbatch, scontrol, the image's
    `python` and the supervisor's interpreter (`host-python`, sys.executable in the rendered script)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    repo = str(Path(__file__).resolve().parents[2])
    (folder / "srun").write_text(SRUN_SHIM.format(python=sys.executable, repo=repo))
    for name in ("apptainer", "enroot", "sbatch", "scontrol", "python", "host-python"):
        (folder / name).write_text(RECORDER)
    for shim in folder.iterdir():
        shim.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def composed(compose_cfg_module) -> Callable[..., Any]:
    """compose_cfg, each base config composed once for the module (a copy each call)."""
    cache: dict[tuple[str, ...], Any] = {}

    def compose(*overrides: str) -> Any:
        if overrides not in cache:
            cache[overrides] = compose_cfg_module(*overrides)
        return copy.deepcopy(cache[overrides])

    return compose


def _compose(compose_cfg, tmp_path: Path, overrides: list[str], key: str, value: Any):
    """The config with the hostile value set after composition (Hydra's override grammar takes few of them)."""
    cfg = compose_cfg(*overrides)
    OmegaConf.update(cfg, "run.root", str(tmp_path / "root"))
    if key == "run.root":
        value = str(tmp_path / "root" / value)
    with open_dict(cfg):  # a new key of cluster.sbatch_extra or cluster.env, as `+key=value` adds one
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def _render(cfg, layout, shims: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """The batch script the submission would write, with the supervisor's interpreter the recording shim."""
    run_id = str(cfg.run.id or "RUNID")
    folder = Path(str(cfg.run.root)).expanduser().resolve() / str(cfg.run.name) / run_id / "submitit"
    with monkeypatch.context() as patch:
        patch.setattr(sys, "executable", str(shims / "host-python"))
        return sbatch_preview(cfg, layout, run_id, folder), folder


def _run_script(text: str, tmp_path: Path, shims: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """The script under bash in tmp_path, the shims first on PATH; each program it started, with its arguments."""
    script, log = tmp_path / "job.sh", tmp_path / "shims.log"
    script.write_text(text)
    env = {
        "PATH": f"{shims}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "SHIM_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "HF_TOKEN": "t",
    }
    proc = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    calls = [record.split("\x1f")[:-1] for record in log.read_text().split("\x1e") if record] if log.exists() else []
    return proc, calls


def _refused(cfg, key: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{key}: " in err and "fix: " in err, err
    root = tmp_path / "root"
    assert not root.exists() or not any(root.iterdir()), "a refused config must leave nothing behind"


@pytest.mark.parametrize("payload", PAYLOADS, ids=PAYLOAD_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_value_is_refused_or_stays_one_word(
    composed, capsys, monkeypatch, tmp_path: Path, shims: Path, case: Case, payload: str
) -> None:
    _, overrides, key, make, expected, on_srun_line = case
    cfg = _compose(composed, tmp_path, overrides, key, make(payload))
    expected = expected(payload) if callable(expected) else expected
    report = run_checks(cfg)
    named = [p for p in report.errors if p.key == key or p.key.startswith(f"{key}[")]
    if expected == "refuse" or (expected is None and named):
        assert named, f"{key}={make(payload)!r} was not refused: {report.errors}"
        _refused(cfg, named[0].key, tmp_path, capsys)
        return
    assert not report.errors, report.errors
    text, folder = _render(cfg, report.layout, shims, monkeypatch)
    proc, calls = _run_script(text, tmp_path, shims)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "MARKER").exists(), f"{key}={make(payload)!r} ran as shell:\n{text}"
    programs = [call[0] for call in calls]
    interpreter = {"pyxis": "python", "apptainer": "apptainer"}.get(
        container.runtime(cfg.cluster.container), "host-python"
    )
    assert programs == ["srun", interpreter, "host-python"], (calls, proc.stderr)
    assert calls[1][-4:] == ["-u", "-m", "submitit.core._submit", str(folder)]  # the task's command, unchanged
    assert calls[2][1:] == ["-m", "hpctrain.launch.supervise", str(folder.parent), "4242", "0"]  # the supervisor
    if on_srun_line:  # reached srun or the runtime as (part of) one argument, as written
        assert any(payload in arg for call in calls[:2] for arg in call), calls


@pytest.mark.parametrize("unquote", ["interpreter", "srun-args"])
def test_the_harness_catches_an_unquoted_value(
    compose_cfg, monkeypatch, tmp_path: Path, shims: Path, unquote: str
) -> None:
    """The positive control: the same render-and-run, with the quoting taken out where it was missing (pyxis'
    interpreter, issue 46) or where submitit does it (the srun options), creates MARKER."""
    import submitit.slurm.slurm as submitit_slurm

    if unquote == "interpreter":
        cfg = _compose(compose_cfg, tmp_path, PYXIS, "cluster.container.python", PAYLOADS[0])
        monkeypatch.setattr(container, "python_command", lambda c, run_dir, gpus: str(c.python))
    else:
        cfg = _compose(compose_cfg, tmp_path, DEV, "cluster.srun_args", [f"--comment={PAYLOADS[0]}"])
        monkeypatch.setattr(submitit_slurm, "_shlex_join", " ".join)
    text, _ = _render(cfg, run_checks(cfg).layout, shims, monkeypatch)
    _run_script(text, tmp_path, shims)
    assert (tmp_path / "MARKER").exists(), text


def test_setup_lines_are_shell_by_design(compose_cfg, tmp_path: Path) -> None:
    """cluster.setup is the site's own shell (module load, source a venv): written as given, and not checked."""
    cfg = compose_cfg(*DEV, f"run.root={tmp_path / 'root'}")
    OmegaConf.update(cfg, "cluster.setup", ["export A=$(hostname); echo `date`"], merge=False)
    report = run_checks(cfg)
    assert not report.errors
    text = sbatch_preview(cfg, report.layout, "RUNID", tmp_path / "root" / "default" / "RUNID" / "submitit")
    assert "\nexport A=$(hostname); echo `date`\n" in text


# Runtime options by meaning: (id, overrides, key, words of the message). Each is refused (exit 2, the key, a fix,
# nothing on disk), however apptainer or srun lets it be spelled.
def _hydra_list(words: tuple[str, ...]) -> str:
    return "[" + ",".join(f"'{word}'" for word in words) + "]"  # Hydra's quoted strings: '=', '#', ',' as written


def _args(*words: str) -> str:
    return f"cluster.container.args={_hydra_list(words)}"


def _srun(*words: str) -> str:
    return f"cluster.srun_args={_hydra_list(words)}"


GPU_APPTAINER = [
    "cluster=slurm",
    "+experiment=gpt3_1.3b_1node",
    "data=synthetic",
    "cluster.container.runtime=apptainer",
    "cluster.container.image=/shared/pytorch.sif",
]
ARGS = "cluster.container.args"
NO_ENV = "without the host's environment"
NETWORK = "network namespace of their own"
MEANINGS = [
    ("apptainer-cleanenv-true", [*APPTAINER, _args("--cleanenv=true")], ARGS, NO_ENV),
    ("apptainer-cleanenv-1", [*APPTAINER, _args("--cleanenv=1")], ARGS, NO_ENV),
    ("apptainer-e", [*APPTAINER, _args("-e")], ARGS, "-e (--cleanenv) starts the tasks " + NO_ENV),
    ("apptainer-e-true", [*APPTAINER, _args("-e=true")], ARGS, NO_ENV),
    ("apptainer-eC", [*APPTAINER, _args("-eC")], ARGS, "-eC (--containall)"),
    ("apptainer-ce", [*APPTAINER, _args("-ce")], ARGS, "-ce (--cleanenv)"),
    ("apptainer-C", [*APPTAINER, _args("-C")], ARGS, "-C (--containall) starts the tasks " + NO_ENV),
    ("apptainer-containall", [*APPTAINER, _args("--containall")], ARGS, NO_ENV),
    ("apptainer-containall-True", [*APPTAINER, _args("--containall=True")], ARGS, NO_ENV),
    ("apptainer-compat", [*APPTAINER, _args("--compat")], ARGS, "implies --containall"),
    ("apptainer-last-wins", [*APPTAINER, _args("--cleanenv=false", "--writable-tmpfs", "-e")], ARGS, NO_ENV),
    ("apptainer-cleanenv-false-word", [*APPTAINER, _args("--cleanenv", "false")], ARGS, "'false' (word 1) is not"),
    ("apptainer-net", [*APPTAINER, _args("--net")], ARGS, NETWORK),
    ("apptainer-net-combined", [*APPTAINER, _args("-cn")], ARGS, "-cn (--net) runs the tasks in a " + NETWORK),
    ("apptainer-no-env", [*APPTAINER, _args("--no-env=SLURM_PROCID")], ARGS, "keeps SLURM_PROCID from the tasks"),
    (
        "apptainer-no-env-list",
        [*APPTAINER, _args("--no-env", "PATH,SUBMITIT_EXECUTOR")],
        ARGS,
        "keeps SUBMITIT_EXECUTOR from the tasks",
    ),
    (
        "apptainer-no-env-credential",
        [*APPTAINER, "+cluster.env.WANDB_API_KEY=abc", _args("--no-env=WANDB_API_KEY")],
        ARGS,
        "keeps WANDB_API_KEY from the tasks",
    ),
    ("apptainer-nv-false", [*GPU_APPTAINER, _args("--nv=false")], ARGS, "would not see the GPUs"),
    ("apptainer-missing-value", [*APPTAINER, _args("--bind")], ARGS, "apptainer would take the image as its value"),
    ("apptainer-missing-short", [*APPTAINER, _args("-cB")], ARGS, "takes a value and none follows"),
    ("apptainer-positional", [*APPTAINER, _args("/shared/other.sif")], ARGS, "would take it as the image"),
    ("apptainer-double-dash", [*APPTAINER, _args("--", "--nv")], ARGS, "is not an option"),
    ("apptainer-bad-bool", [*APPTAINER, _args("--cleanenv=yes")], ARGS, "'yes' is not a boolean"),
    (
        "pyxis-image-twice",
        [*PYXIS, _args("--container-image=nvcr.io#nvidia/other:1")],
        ARGS,
        "pyxis refuses a second, different one",
    ),
    (
        "pyxis-workdir-twice",
        [*PYXIS, "cluster.container.workdir=/w", _args("--container-workdir=/other")],
        ARGS,
        "pyxis refuses a second, different one",
    ),
    ("pyxis-unshare-net", [*PYXIS, _args("--container-unshare=net")], ARGS, NETWORK),
    ("pyxis-unshare-ipc-net", [*PYXIS, _args("--container-unshare=ipc,net")], ARGS, NETWORK),
    ("pyxis-export-none", [*PYXIS, _args("--export=NONE")], ARGS, "Slurm's variables only"),
    ("pyxis-export-two-words", [*PYXIS, _args("--export", "HF_TOKEN")], ARGS, "Slurm's variables only"),
    ("pyxis-export-abbreviated", [*PYXIS, _args("--exp=NONE")], ARGS, "--exp=NONE (--export)"),
    ("pyxis-ntasks", [*PYXIS, _args("-n4")], ARGS, "-n4 (--ntasks) changes the tasks"),
    ("pyxis-e-is-srun-error", [*PYXIS, _args("-e")], ARGS, "srun would take the next word"),
    ("pyxis-flag-with-value", [*PYXIS, _args("--container-remap-root=true")], ARGS, "takes no value"),
    ("pyxis-ambiguous", [*PYXIS, _args("--cont=x")], ARGS, "ambiguous"),
    ("pyxis-positional", [*PYXIS, _args("python3")], ARGS, "would take it as the command to run"),
    ("srun-export-none", [*DEV, _srun("--export=NONE")], "cluster.srun_args", "Slurm's variables only"),
    (
        "srun-image-outside-container",
        [*DEV, _srun("--container-image=/images/pt.sqsh")],
        "cluster.srun_args",
        "an image hpctrain knows nothing of",
    ),
    (
        "srun-image-twice",
        [*PYXIS, _srun("--container-image=/images/pt.sqsh")],
        "cluster.srun_args",
        "pyxis refuses a second",
    ),
    ("srun-nodes", [*DEV, _srun("-N", "1")], "cluster.srun_args", "-N 1 (--nodes) changes the tasks"),
    ("srun-tasks-per-node", [*DEV, _srun("--tasks-per-node=1")], "cluster.srun_args", "(--ntasks-per-node)"),
    ("srun-positional", [*DEV, _srun("hostname")], "cluster.srun_args", "would take it as the command to run"),
    (
        "sbatch-export-none",
        [*DEV, "+cluster.sbatch_extra.export=NONE"],
        "cluster.sbatch_extra.export",
        "its srun step inherits the setting",
    ),
    ("run-dir-colon", [*PYXIS, "run.name=a:b"], "run.name", "the runtimes split mounts"),
    ("run-dir-percent", [*DEV, "run.name=a%jb"], "run.name", "filename pattern"),
]


@pytest.mark.parametrize("overrides,key,words", [m[1:] for m in MEANINGS], ids=[m[0] for m in MEANINGS])
def test_an_option_is_judged_by_its_meaning(
    compose_cfg, capsys, tmp_path: Path, overrides: list[str], key: str, words: str
) -> None:
    cfg = compose_cfg(*overrides, f"run.root={tmp_path / 'root'}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{key}: " in err and words in err and "fix: " in err, err
    root = tmp_path / "root"
    assert not root.exists() or not any(root.iterdir())


ACCEPTED = [
    [*APPTAINER, _args("--cleanenv=false")],
    [*APPTAINER, _args("-e=false")],
    [*APPTAINER, _args("--containall=0")],
    [*APPTAINER, _args("--cleanenv", "--cleanenv=false")],
    [*APPTAINER, _args("-c")],
    [*APPTAINER, _args("--no-home")],
    [*APPTAINER, _args("--writable-tmpfs", "-B", "/a:/a", "--bind=/b:/b,/c:/c")],
    [*APPTAINER, _args("--net=false")],
    [*APPTAINER, _args("--nv=false")],  # a CPU job (cluster=dev): no --nv to undo
    [*GPU_APPTAINER, _args("--nv=false", "--nvccli")],
    [*APPTAINER, _args("--no-env=LD_PRELOAD")],
    [*PYXIS, _args("--container-remap-root", "--no-container-mount-home", "--container-unshare=ipc,uts")],
    [*PYXIS, _args("--export=ALL,FOO=1", "--container-writable", "--container-mounts=/a:/a")],
    [*PYXIS, _args("--container-workdir=/w")],
    [*PYXIS, "cluster.container.workdir=/w", _args("--container-workdir=/w")],
    [*DEV, _srun("--cpu-bind=none", "--mpi=pmix", "-l", "--export", "ALL")],
    [*DEV, "+cluster.sbatch_extra.export='ALL,FOO=1'"],
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[o[-1] for o in ACCEPTED])
def test_options_that_keep_what_hpctrain_needs_pass(compose_cfg, overrides: list[str]) -> None:
    report = run_checks(compose_cfg(*overrides))
    assert not report.errors, report.errors
    assert not [w for w in report.warnings if w.key in (ARGS, "cluster.srun_args")], report.warnings


def test_an_option_hpctrain_does_not_know_is_a_warning(compose_cfg) -> None:
    """Another release (or SPANK plugin) may have it: named, not refused; its next word is taken as its value."""
    report = run_checks(compose_cfg(*APPTAINER, _args("--frobnicate", "/x")))
    assert not report.errors
    assert [w.key for w in report.warnings if "--frobnicate /x is not an option" in w.message] == [ARGS]
