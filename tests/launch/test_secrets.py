"""Credentials given as cluster.env values (issue 29): redacted in the plan, config.yaml and plan.json, with a
warning that says how to pass them; out of the job's pickle; and the job still gets the value, through the
environment of the submission."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import run_hpctrain

FAKE = "fake-wandb-key-5b1d0c7e9a"


def test_which_names_look_like_credentials() -> None:
    from hpctrain.launch.secrets import looks_secret

    assert all(map(looks_secret, ("WANDB_API_KEY", "HF_TOKEN", "aws_secret", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                  "passwordfile", "my_api_key")))
    assert not any(map(looks_secret, ("NCCL_DEBUG", "HPCTRAIN_INJECT_FAULT", "KEYBOARD", "TOKENIZERS_PARALLELISM")))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_plan_never_shows_a_credential_and_says_how_to_pass_it(tmp_path: Path, fmt: str) -> None:
    proc = run_hpctrain(f"+cluster.env.WANDB_API_KEY={FAKE}", "+cluster.env.NCCL_DEBUG=INFO", "dry_run=true",
                        f"plan.format={fmt}", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FAKE not in proc.stdout + proc.stderr
    if fmt == "json":
        plan = json.loads(proc.stdout)
        assert plan["environment"]["WANDB_API_KEY"] == "<redacted>" and plan["environment"]["NCCL_DEBUG"] == "INFO"
        warning = next(w for w in plan["warnings"] if w["key"] == "cluster.env.WANDB_API_KEY")
        assert "export WANDB_API_KEY" in warning["fix"] and "--export" in warning["fix"]
    else:
        assert "WANDB_API_KEY=<redacted>" in proc.stdout and "export WANDB_API_KEY=" in proc.stdout


PROBE = '''
import hashlib, os
if os.environ.get("SUBMITIT_EXECUTOR") and os.environ.get("SECRETS_PROBE_DIR"):
    value = os.environ.get("WANDB_API_KEY", "")
    with open(os.path.join(os.environ["SECRETS_PROBE_DIR"], f"{os.getpid()}.sha256"), "w") as f:
        f.write(hashlib.sha256(value.encode()).hexdigest())
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_credential_reaches_the_job_and_no_file_of_the_run(tmp_path: Path) -> None:
    """A real local run: the key is in no file of the run directory (config.yaml, plan.json, the submitit pickle,
    the logs) nor in the output, and the job's processes see it (a usercustomize probe records its hash in every
    process the job starts, outside the run directory). A resume then needs it from the environment."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "usercustomize.py").write_text(PROBE)
    env = {"PYTHONPATH": str(probe), "SECRETS_PROBE_DIR": str(probe)}
    root = tmp_path / "runs"
    proc = run_hpctrain(f"+cluster.env.WANDB_API_KEY={FAKE}", "train.max_steps=2", "run.id=s", f"run.root={root}",
                        cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert FAKE not in proc.stdout + proc.stderr
    assert "warning: cluster.env.WANDB_API_KEY: looks like a credential" in proc.stderr
    run_dir = root / "smoke" / "s"
    leaked = [str(p) for p in run_dir.rglob("*") if p.is_file() and FAKE.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert "WANDB_API_KEY: <redacted>" in (run_dir / "config.yaml").read_text()
    assert list((run_dir / "submitit").glob("*.pkl"))  # the pickle was looked at, and holds no key
    seen = {p.read_text() for p in probe.glob("*.sha256")}
    assert hashlib.sha256(FAKE.encode()).hexdigest() in seen, seen

    # Resumed without the key anywhere: it is not in the saved config, so the plan says where it must come from.
    resumed = run_hpctrain(f"run.resume={run_dir}", "dry_run=true", cwd=tmp_path, env={"WANDB_API_KEY": ""})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "WANDB_API_KEY=<redacted>" in resumed.stdout and "the job will run without it" in resumed.stdout
