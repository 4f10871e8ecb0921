"""Issue 46: a sweep whose points would share one run directory is refused before anything is written, and a
sweep of dry runs writes nothing at all (not even Hydra's sweep directory)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hpctrain.launch.sweep import shared_run_dirs
from tests.conftest import run_hpctrain


def _sweep(tmp_path: Path, *args: str):
    """`python -m hpctrain -m ARGS` with its run root and its temporary directory (where a dry-run sweep's scratch
    goes) in tmp_path."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    proc = run_hpctrain(
        "-m", *args, f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300, env={"TMPDIR": str(scratch)}
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists(), sorted((tmp_path / "runs").rglob("*"))
    assert not (tmp_path / "multirun").exists()
    assert not any((tmp_path / "tmp").iterdir()), sorted((tmp_path / "tmp").iterdir())


def test_a_fixed_run_id_is_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = _sweep(tmp_path, "optim.lr=1e-4,3e-4", "run.id=x", "train.max_steps=2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "  - run.id: run.id=x is the same for sweep points 0 (optim.lr=0.0001" in proc.stderr, proc.stderr
    assert "they would share one run directory" in proc.stderr and "train nothing" in proc.stderr
    assert "fix: leave run.id out in a sweep (each point gets its own), or sweep over it: run.id=a,b" in proc.stderr
    assert "sweep: " not in proc.stdout  # no table: no point ran
    _nothing_written(tmp_path)


def test_a_fixed_run_id_is_refused_in_a_dry_run_sweep_too(tmp_path: Path) -> None:
    """The dry run is where the real sweep's refusal is found first."""
    proc = _sweep(tmp_path, "optim.lr=1e-4,3e-4", "run.id=x", "dry_run=true")
    assert proc.returncode == 2 and "  - run.id: run.id=x is the same for sweep points" in proc.stderr, proc.stderr
    _nothing_written(tmp_path)


def test_a_fixed_resume_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "smoke" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("run: {id: r1}\n")  # a run to resume (found by its config.yaml)
    proc = _sweep(tmp_path, "optim.lr=1e-4,3e-4", "run.resume=r1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "  - run.resume: run.resume=r1 is the same for sweep points 0" in proc.stderr, proc.stderr
    assert f"would resume the one run {run}" in proc.stderr and "fix: resume one run per command" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["smoke"]  # no sweeps/ beside it
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_a_dry_run_sweep_writes_nothing_and_a_swept_run_id_is_fine(tmp_path: Path) -> None:
    proc = _sweep(tmp_path, "run.id=a,b", "dry_run=true")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sweep: 2 points" in proc.stdout
    for run_id in ("a", "b"):
        assert str(tmp_path / "runs" / "smoke" / run_id) in proc.stdout
    _nothing_written(tmp_path)


def test_shared_run_dirs_in_process(compose_cfg) -> None:
    """Only points whose run directory is the same one collide: another run.name, another run.root, a fresh id
    (run.id unset) or distinct ids do not."""

    def check(*points: list[str]):
        return shared_run_dirs([list(p) for p in points], [compose_cfg(*p) for p in points])

    assert check(["run.id=a"], ["run.id=b"]) is None
    assert check(["optim.lr=1e-4"], ["optim.lr=3e-4"]) is None
    assert check(["run.id=x", "run.name=one"], ["run.id=x", "run.name=two"]) is None
    shared = check(["run.id=x", "optim.lr=1e-4"], ["run.id=y"], ["run.id=x", "optim.lr=3e-4"])
    assert (
        shared is not None and shared.key == "run.id" and "sweep points 0 (run.id=x optim.lr=1e-4), 2" in shared.message
    ), shared
    assert OmegaConf.is_config(compose_cfg())  # the fixture composes as the sweep does
