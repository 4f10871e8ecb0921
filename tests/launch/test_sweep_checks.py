"""A sweep checks every point before it submits any (issue 29), and a failed point leaves its error in the table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_hpctrain
from tests.launch.test_login_errors import SLURM, fake_slurm


def _table(root: Path) -> list[dict]:
    tables = list((root / "sweeps").glob("*/sweep.json"))
    assert len(tables) == 1, tables
    return json.loads(tables[0].read_text())


def test_one_bad_point_stops_the_sweep_before_any_point_runs(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    proc = run_hpctrain("-m", "parallel.dp=2,3", "train.max_steps=2", f"run.root={root}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "1 of 2 sweep points failed the checks; no point was submitted" in proc.stderr
    assert "sweep point 1 (parallel.dp=3 train.max_steps=2" in proc.stderr and "  - parallel.dp:" in proc.stderr
    assert not (root / "smoke").exists()  # point 0 neither ran nor made a run directory
    table = _table(root)
    assert [r["point"] for r in table] == [0, 1]
    assert table[0]["run_dir"].startswith("not submitted") and not table[0]["error"]
    assert table[1]["run_dir"] == "failed the checks" and "parallel.dp: dp x tp x pp" in table[1]["error"]
    assert "sweep: 2 points" in proc.stdout and "error:" in proc.stdout


def test_a_point_that_fails_later_does_not_stop_the_others_and_its_error_is_in_the_table(tmp_path: Path) -> None:
    """Both points pass the checks; the scheduler refuses the second one's job: the first is submitted, the
    table holds both with the second's error, and the sweep exits 2."""
    root = tmp_path / "runs"
    proc = run_hpctrain(
        "-m",
        *SLURM,
        "+cluster.sbatch_extra.gres=gpu:8,gpu:bogus:8",
        f"run.root={root}",
        cwd=tmp_path,
        env=fake_slurm(tmp_path, refuse_if="bogus"),
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = _table(root)
    assert [r["job_id"] for r in table] == ["4242", "-"]
    assert Path(table[0]["run_dir"]).is_dir() and not table[0]["error"]
    assert "the scheduler refused the job" in table[1]["error"] and table[1]["run_dir"] == "failed"
    assert len(list((root / "smoke").iterdir())) == 1  # the refused point's directory is gone
