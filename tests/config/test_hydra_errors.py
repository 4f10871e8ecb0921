"""Hydra's own errors go through hpctrain's reporting (issue 46; hpctrain/config/compose_errors.py): an unknown key,
a wrong type, a group option that is not there, an enum value, a site file that does not load, a loop in
HPCTRAIN_CONFIG_PATH. Every one at once, each with its key and the fix, exit 2, nothing written, no traceback;
for one run, a sweep (-m) and a resume alike."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpctrain.config.compose_errors import compose_problems
from hpctrain.config.site import VARIABLE, site_problems
from hpctrain.launch.cli import EXIT_CONFIG_ERROR
from tests.conftest import CONF_DIR, run_hpctrain


def refused(proc, tmp_path: Path, made: set[Path] = frozenset(), errors: int | None = None) -> str:
    """The checks every refusal passes; its stderr."""
    out = proc.stderr + proc.stdout
    assert proc.returncode == EXIT_CONFIG_ERROR, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "nothing was submitted" in proc.stderr, proc.stderr
    if errors is not None:
        assert f"hpctrain: {errors} config error(s)" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n    fix: ") == errors, proc.stderr
    left = {p for p in tmp_path.rglob("*")} - set(made)
    assert not left, f"a refused command line left {sorted(left)}"
    return proc.stderr


def test_every_hydra_error_at_once(tmp_path: Path) -> None:
    """Hydra stops at the first; hpctrain names all five, each with what is wrong and the fix."""
    err = refused(
        run_hpctrain(
            "model.n_layer=3",
            "parallel.tp=two",
            "model=gpt5",
            "plan.simulate_device=gpu",
            "precision.dtype=fp8",
            f"run.root={tmp_path / 'runs'}",
            cwd=tmp_path,
            timeout=120,
        ),
        tmp_path,
        errors=5,
    )
    assert ("  - model.n_layer: is not a key of hpctrain's config schema\n    fix: did you mean model.n_layers?") in err
    assert "  - parallel.tp: takes an integer, got 'two' (str)\n    fix: give an integer, e.g. parallel.tp=1" in err
    assert "  - model: 'gpt5' is not an option of model: there is no model/gpt5.yaml in " in err
    assert "the options: gpt3_1.3b, gpt3_125m," in err and ", tiny\n" in err
    assert "  - plan.simulate_device: 'gpu' is not one of auto, cuda, cpu\n" in err
    assert "did you mean plan.simulate_device=cuda?" in err
    assert "  - precision.dtype: 'fp8' is not one of fp32, bf16, fp16\n    fix: " in err
    assert "precision.fp8=tensorwise" in err
    order = [
        err.index(f"  - {key}: ")
        for key in ("model.n_layer", "parallel.tp", "model", "plan.simulate_device", "precision.dtype")
    ]
    assert order == sorted(order), "in the command line's order"


def test_other_mistakes_of_the_command_line_and_a_resume(tmp_path: Path) -> None:
    """Unreadable overrides, a sweep without -m, a group not in the defaults list, + on a key that is there,
    ~ on one that is not, a map's new entry without +: on a resume too (refused before it looks for the run)."""
    err = refused(
        run_hpctrain(
            "run.resume=20260101-000000-deadbeef",
            "optim.lr=[1",
            "optim.lr=1e-4,3e-4",
            "experiment=smoke",
            "+model.n_layers=3",
            "~model.n_layerz",
            "cluster.env.FOO=1",
            "parallel.compile=maybe",
            "model.rope=3",
            f"run.root={tmp_path / 'runs'}",
            cwd=tmp_path,
            timeout=120,
        ),
        tmp_path,
        errors=8,
    )
    assert "  - optim.lr: 'optim.lr=[1' is not an override Hydra can read" in err
    assert "  - optim.lr: 'optim.lr=1e-4,3e-4' is several values: a sweep, which needs -m" in err
    assert "fix: add -m for one run per value" in err
    assert "  - experiment: " in err and "fix: add it with a +: +experiment=smoke" in err
    assert "  - model.n_layers: already has a value" in err and "fix: drop the +: model.n_layers=3" in err
    assert "  - model.n_layerz: is not in the config" in err and "did you mean model.n_layers?" in err
    assert "  - cluster.env.FOO: " in err and "fix: add it with a +: +cluster.env.FOO=1" in err
    assert "  - parallel.compile: takes true or false, got 'maybe'" in err
    assert "  - model.rope: is a section of the config" in err and "model.rope.theta" in err


def test_a_sweep_is_refused_whole_and_writes_nothing(tmp_path: Path) -> None:
    """-m: a typo beside the sweep, and a bad value inside one (not only the first value is checked); no
    multirun/ or sweeps/ directory, no point run."""
    err = refused(
        run_hpctrain(
            "-m",
            "optim.lr=1e-4,3e-4",
            "model.n_layer=3",
            "parallel.tp=1,two",
            "model=tiny,gpt5",
            f"run.root={tmp_path / 'runs'}",
            cwd=tmp_path,
            timeout=120,
        ),
        tmp_path,
        errors=3,
    )
    assert "  - model.n_layer: " in err and "did you mean model.n_layers?" in err
    assert "  - parallel.tp: takes an integer, got 'two'" in err
    assert "  - model: 'gpt5' is not an option of model" in err
    assert "sweep" not in err.split("nothing was submitted", 1)[0]  # refused before Hydra's sweeper started


SITE_FILES = {
    "cluster/broken.yaml": "name: broken\npartition: [gpu\n",  # not YAML: the list is never closed
    "model/typo.yaml": "defaults:\n  - tiny\n  - _self_\nname: typo\nn_layer: 3\n",  # n_layers
    "parallel/wrong.yaml": "# a site's layout\ntp: two\n",  # not an integer
}


@pytest.fixture
def site(tmp_path: Path) -> Path:
    conf = tmp_path / "site"
    for name, text in SITE_FILES.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    return conf


def test_bad_site_files_are_named_with_their_line(site: Path, tmp_path: Path) -> None:
    made = set(tmp_path.rglob("*"))
    err = refused(
        run_hpctrain(
            "cluster=broken",
            "model=typo",
            "parallel=wrong",
            "parallel.pp=two",
            f"run.root={tmp_path / 'runs'}",
            cwd=tmp_path,
            env={VARIABLE: str(site)},
            timeout=120,
        ),
        tmp_path,
        made,
        errors=4,
    )
    assert f"  - cluster: {site}/cluster/broken.yaml, line 3, column 1: not valid YAML: " in err
    assert f"fix: correct {site}/cluster/broken.yaml at line 3" in err
    assert (
        f"  - model.n_layer: is not a key of hpctrain's config schema (in {site}/model/typo.yaml, line 5)\n"
        "    fix: did you mean model.n_layers?"
    ) in err
    assert f"  - parallel.tp: takes an integer, got 'two' (str) (in {site}/parallel/wrong.yaml, line 2)" in err
    assert "  - parallel.pp: takes an integer, got 'two'" in err


def test_an_unknown_site_option_lists_the_sites_options_too(site: Path, tmp_path: Path) -> None:
    made = set(tmp_path.rglob("*"))
    err = refused(
        run_hpctrain(
            "cluster=brokn", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, env={VARIABLE: str(site)}, timeout=120
        ),
        tmp_path,
        made,
        errors=1,
    )
    assert "  - cluster: 'brokn' is not an option of cluster: there is no cluster/brokn.yaml in " in err
    assert f"{CONF_DIR}, {site}; the options: broken, dev, local, slurm\n" in err
    assert "fix: did you mean cluster=broken?" in err


def test_a_loop_in_hpctrain_config_path_is_named(tmp_path: Path) -> None:
    """A listed directory that is a loop of symbolic links, and a group folder that is one inside a listed
    directory (Hydra would skip it silently): both named, with HPCTRAIN_CONFIG_PATH as the key."""
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    site = tmp_path / "site"
    site.mkdir()
    (site / "cluster").symlink_to(site / "cluster")
    made = set(tmp_path.rglob("*"))
    err = refused(
        run_hpctrain(
            "cluster=mysite",
            f"run.root={tmp_path / 'runs'}",
            cwd=tmp_path,
            env={VARIABLE: f"{loop}:{site}"},
            timeout=120,
        ),
        tmp_path,
        made,
        errors=2,
    )
    assert f"  - {VARIABLE}: {loop} cannot be resolved: a loop of symbolic links" in err
    assert f"  - {VARIABLE}: {site / 'cluster'} cannot be resolved: a loop of symbolic links" in err


def test_an_unreadable_site_directory_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No permission (root reads anything, so the refusal is simulated): the directory, and a group folder in one."""
    site, other = tmp_path / "site", tmp_path / "other"
    (site / "cluster").mkdir(parents=True)
    other.mkdir()
    listdir = os.listdir

    def denied(path: os.PathLike | str = ".") -> list[str]:
        if Path(path) in (other, site / "cluster"):
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", denied)
    problems = site_problems(f"{site}:{other}")
    assert [(p.key, p.message) for p in problems] == [
        (VARIABLE, f"{site / 'cluster'} cannot be read: Permission denied"),
        (VARIABLE, f"{other} cannot be read: Permission denied"),
    ]
    assert all(p.fix for p in problems)


def test_a_good_command_line_has_no_problems_and_sweeps_check_each_value() -> None:
    """In-process: what composes gives [], and every value of a sweep is checked, not only the first."""
    assert compose_problems(["parallel.tp=2", "model=llama_tiny", "+experiment=smoke"], CONF_DIR) == []
    assert compose_problems(["optim.lr=1e-4,3e-4", "model=tiny,llama_tiny"], CONF_DIR, multirun=True) == []
    [problem] = compose_problems(["optim.lr=1e-4,fast,3e-4"], CONF_DIR, multirun=True)
    assert (problem.key, problem.message) == ("optim.lr", "takes a number, got 'fast' (str)")


def test_help_and_info_with_a_bad_override_are_refused_too(tmp_path: Path) -> None:
    """--help and --info compose the command line as well (Hydra printed a traceback for these)."""
    for flags in (["--help"], ["--info", "all"]):
        err = refused(run_hpctrain(*flags, "parallel.tp=two", cwd=tmp_path, timeout=120), tmp_path, errors=1)
        assert "  - parallel.tp: takes an integer, got 'two' (str)" in err
