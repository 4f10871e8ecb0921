"""tools/gpu_check.py: the --cpu run passes every check and prints the table; a failing, dying or hanging check
is a FAIL row, never a missing table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"
CHECKS = ["a", "b1", "b2", "c", "d", "e"]


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _rows(stdout: str) -> dict[str, str]:
    """The table's rows by check key (the lines between the header and the closing line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["check", "what", "result"])
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("all ") or line.split()[1:2] == ["of"]:
            break
        rows[line.split()[0]] = line
    return rows


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_cpu_run_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(TOOL), "--cpu", "--json", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hpctrain GPU check (cpu mode)" in proc.stdout
    rows = _rows(proc.stdout)
    assert list(rows) == CHECKS, proc.stdout
    assert all(" PASS " in line for line in rows.values()), proc.stdout
    assert f"all {len(CHECKS)} checks passed" in proc.stdout

    report = json.loads(out.read_text())
    assert report["passed"] is True and report["mode"] == "cpu"
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == CHECKS and all(c["result"] == "PASS" and c["error"] is None for c in checks.values())
    assert checks["a"]["numbers"]["checkpoint_steps"][-1] == checks["a"]["numbers"]["steps"]
    for b in ("b1", "b2"):
        n = checks[b]["numbers"]
        assert n["mfu_median"] > 0 and n["peak_mem_gib_measured"] > 0 and n["peak_mem_gib_planned"] > 0
    assert checks["c"]["numbers"]["optimizer_tensors"] > 0 and checks["c"]["numbers"]["weights_changed_by_training"] > 0
    d = checks["d"]["numbers"]
    assert len(d["losses"]) == 3 and "cpu" in d["grad_devices"] and max(d["clipped_norms"]) <= 1.001 * d["max_norm"]
    assert d["nvme_bitwise_equal"] is True
    assert checks["e"]["numbers"]["difference"] <= 1e-3
    assert report["workdir"] is None  # all passed: the temporary directory is gone
    print(f"gpu_check --cpu: {seconds:.1f} s")


def test_a_failing_dying_or_hanging_check_is_a_fail_row(tmp_path: Path, monkeypatch, capsys) -> None:
    tool = _tool()
    for var in ("CUDA_VISIBLE_DEVICES", "SUBMITIT_EXECUTOR", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)  # main() sets or removes these: restored after the test

    def passes(ctx):
        return tool.Outcome(True, "fine", {"x": 1})

    def raises(ctx):
        raise ValueError("bad value\nsecond line")

    def misses_goal(ctx):
        return tool.Outcome(False, "MFU 12.0% (goal 45%)", {"mfu": 0.12})

    def dies(ctx):
        os._exit(3)  # what hpctrain's hang watchdog does

    def hangs(ctx):
        time.sleep(120)

    monkeypatch.setattr(tool, "CHECKS", [
        tool.Check("p", "passes", passes, 30, 30), tool.Check("r", "raises", raises, 30, 30),
        tool.Check("m", "misses its goal", misses_goal, 30, 30), tool.Check("x", "exits 3", dies, 30, 30),
        tool.Check("h", "hangs", hangs, 2, 2)])
    out = tmp_path / "r.json"
    started = time.monotonic()
    code = tool.main(["--cpu", "--json", str(out), "--workdir", str(tmp_path)])
    assert time.monotonic() - started < 30
    stdout = capsys.readouterr().out
    assert code == 1
    rows = _rows(stdout)
    assert list(rows) == ["p", "r", "m", "x", "h"], stdout
    assert " PASS " in rows["p"] and all(" FAIL " in rows[k] for k in "rmxh"), stdout
    assert "ValueError: bad value" in rows["r"] and "second line" not in rows["r"]
    assert "MFU 12.0%" in rows["m"]
    assert "hang watchdog" in rows["x"]
    assert "timed out" in rows["h"]
    assert "4 of 5 checks FAILED (r, m, x, h)" in stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False and [c["result"] for c in report["checks"]] == ["PASS"] + ["FAIL"] * 4
    assert report["workdir"] and Path(report["workdir"]).is_dir()  # kept for the logs
    assert "ValueError" in (Path(report["workdir"]) / "r.log").read_text()


def test_budget_spent_skips_the_remaining_checks(tmp_path: Path, monkeypatch, capsys) -> None:
    tool = _tool()
    for var in ("CUDA_VISIBLE_DEVICES", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tool, "CHECKS", [tool.Check("p", "passes", lambda ctx: tool.Outcome(True, "ok"), 30, 30)])
    assert tool.main(["--cpu", "--budget", "1", "--workdir", str(tmp_path)]) == 1
    assert "skipped: the time budget" in capsys.readouterr().out
