"""The login node never imports torch: the dry run, the checks and a Slurm submission run without it.

On a login node with the Python environment on a shared file system, importing torch alone can take many
seconds; only the tasks need it. Each case runs the real command line in a fresh interpreter and reports which
torch modules it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, runpy, sys
sys.argv = ["hpctrain", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code or 0
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("PROBE " + json.dumps({"code": code, "torch": torch[:5]}), file=sys.stderr)
"""


def login(*args: str, path: str | None = None) -> tuple[int, list[str], str, str]:
    """(exit code, torch modules imported, stdout, stderr) of `python -m hpctrain ARGS` in a fresh interpreter."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    if path:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    line = next(x for x in reversed(proc.stderr.splitlines()) if x.startswith("PROBE "))
    probe = json.loads(line[len("PROBE ") :])
    return probe["code"], probe["torch"], proc.stdout, proc.stderr


def test_175b_dry_run_imports_no_torch(tmp_path: Path) -> None:
    code, torch, out, err = login("+experiment=175b", "dry_run=true", f"run.root={tmp_path}")
    assert code == 0, err
    assert torch == []
    assert "parameters per pipeline rank" in out and "per-GPU memory" in out and "#SBATCH" in out


def test_checks_of_a_bad_config_import_no_torch(tmp_path: Path) -> None:
    code, torch, _, err = login("parallel.dp=3", f"run.root={tmp_path}")
    assert code == 2 and "parallel.dp" in err
    assert torch == []


def test_a_dry_run_that_does_not_fit_imports_no_torch_and_exits_2(tmp_path: Path) -> None:
    code, torch, out, err = login(
        "+experiment=175b", "parallel.recompute=none", "zero=stage0", "dry_run=true", f"run.root={tmp_path}"
    )
    assert code == 2 and "DOES NOT FIT" in out and "exceeds" in err
    assert torch == []


def test_slurm_submission_imports_no_torch(tmp_path: Path) -> None:
    """Submitted through submitit to an `sbatch` that only answers with a job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    sbatch.chmod(0o755)
    code, torch, out, err = login(
        "+experiment=175b", "data=synthetic", "tracking=disabled", f"run.root={tmp_path / 'runs'}", path=str(bin_dir)
    )
    assert code == 0, err
    assert "submitted job 4242" in out
    assert torch == []
