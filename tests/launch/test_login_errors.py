"""What the login node reports (issue 29): every problem at once, a refused sbatch as a clear error that leaves
nothing behind, and the README's own example error with a fix that is valid."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from tests.conftest import REPO, run_hpctrain


def test_a_layout_error_does_not_hide_the_other_problems(tmp_path: Path) -> None:
    """`zero.stage=4 optim.lr=-1`: the stage (found while the layout resolves) and the learning rate (a check
    that runs after it), both reported, exit 2, nothing created."""
    proc = run_hpctrain("zero.stage=4", "optim.lr=-1", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "2 config error(s)" in proc.stderr
    assert "  - zero.stage: must be 0, 1, 2 or 3, got 4" in proc.stderr
    assert "  - optim.lr: must be > 0, got -1.0" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_an_unknown_key_does_not_hide_the_other_problems(tmp_path: Path) -> None:
    proc = run_hpctrain(
        "+train.lr=1e-3", "parallel.dp=3", "optim.warmup_steps=-1", f"run.root={tmp_path}", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    for words in (
        "  - train.lr: is not a key",
        "did you mean optim.lr?",
        "  - parallel.dp: dp x tp x pp",
        "  - optim.warmup_steps: must be >= 0",
    ):
        assert words in proc.stderr, (words, proc.stderr[-3000:])
    assert "3 config error(s)" in proc.stderr


def fake_slurm(tmp_path: Path, refuse_if: str = "") -> dict[str, str]:
    """A PATH whose sbatch is a scheduler that refuses a script containing `refuse_if` (every script when empty)
    with Slurm's own words, and accepts the others; srun exists (submitit looks for it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    test = f'grep -q "{refuse_if}" "$1"' if refuse_if else "true"
    scripts = {
        "sbatch": f"#!/bin/sh\nif {test}; then\n"
        "  echo 'sbatch: error: Invalid generic resource (gres) specification' >&2\n  exit 1\nfi\n"
        "echo 'Submitted batch job 4242'\n",
        "srun": "#!/bin/sh\nexit 0\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    import os

    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


SLURM = ["cluster=slurm", "train.global_batch=32"]


@pytest.mark.parametrize(
    "extra, key",
    [([], "cluster.gpus_per_node"), (["+cluster.sbatch_extra.gres=gpu:bogus:8"], "cluster.sbatch_extra.gres")],
)
def test_a_job_the_scheduler_refuses_is_a_clear_error_that_leaves_nothing(
    tmp_path: Path, extra: list[str], key: str
) -> None:
    root = tmp_path / "runs"
    proc = run_hpctrain(*SLURM, *extra, f"run.root={root}", cwd=tmp_path, env=fake_slurm(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith(f"  - {key}:"))
    assert "the scheduler refused the job: sbatch: error: Invalid generic resource (gres) specification" in line
    assert "fix: change " + key in proc.stderr
    assert not root.exists()  # the run directory (and run.root/run.name) this submission created: gone


@pytest.mark.parametrize(
    "said, key",
    [
        ("sbatch: error: Batch job submission failed: Invalid partition name specified", "cluster.partition"),
        ("sbatch: error: invalid partition specified: gpu", "cluster.partition"),
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
            "cluster.account",
        ),
        (
            "sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)",  # noqa: E501 (sbatch's own line)
            "cluster.time_min",
        ),
        ("sbatch: error: Batch job submission failed: Requested node configuration is not available", "cluster.nodes"),
        ("sbatch: error: Invalid generic resource (gres) specification", "cluster.gpus_per_node"),
        (
            "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
            "cluster.executor",
        ),
    ],
)
def test_the_schedulers_refusal_names_the_key_that_sets_what_it_refused(compose_cfg, said: str, key: str) -> None:
    import submitit

    from hpctrain.launch.submit import refused_submission

    problem = refused_submission(
        compose_cfg("cluster=slurm", "cluster.partition=gpu"), submitit.core.utils.FailedJobError(said)
    )
    assert problem.key == key and said in problem.message, problem


def test_a_refused_resume_puts_the_run_directory_back(tmp_path: Path, compose_cfg) -> None:
    from hpctrain.launch.rundir import create_run_dir, resolve_run_dir

    root = tmp_path / "runs"
    cfg = compose_cfg(*SLURM, f"run.root={root}", "run.id=r1")
    run = resolve_run_dir(cfg.run)
    create_run_dir(cfg, run)
    (run.path / "plan.json").write_text("{}")
    before = {str(p): p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    proc = run_hpctrain(
        f"run.root={root}", "run.resume=r1", "train.max_steps=50", cwd=tmp_path, env=fake_slurm(tmp_path)
    )
    assert proc.returncode == 2 and "the scheduler refused the job" in proc.stderr, proc.stderr[-3000:]
    assert {str(p): p.read_bytes() for p in run.path.rglob("*") if p.is_file()} == before


def test_the_readme_example_error_is_what_the_command_prints_and_its_fix_is_valid(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("$ python -m hpctrain parallel.dp=3\n", 1)[1].split("```", 1)[0]
    proc = run_hpctrain("parallel.dp=3", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2
    assert block.strip() in proc.stderr, (block, proc.stderr)
    fix = re.search(r"fix: set parallel\.dp=(\d+) \(or -1 to infer it\), or (.*)", proc.stderr)
    assert fix, proc.stderr
    alternative = fix.group(2).replace(" with ", " ").split()
    assert all(re.fullmatch(r"[a-z_.]+=\d+", o) for o in alternative), alternative  # whole numbers (not 1.5)
    for overrides in ([f"parallel.dp={fix.group(1)}"], ["parallel.dp=3", *alternative]):
        ok = run_hpctrain(*overrides, "dry_run=true", f"run.root={tmp_path}", cwd=tmp_path)
        assert ok.returncode == 0, (overrides, ok.stderr[-2000:])
