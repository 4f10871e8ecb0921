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

    assert all(
        map(
            looks_secret,
            (
                "WANDB_API_KEY",
                "HF_TOKEN",
                "aws_secret",
                "AWS_SECRET_ACCESS_KEY",
                "DB_PASSWORD",
                "passwordfile",
                "my_api_key",
            ),
        )
    )
    assert not any(map(looks_secret, ("NCCL_DEBUG", "HPCTRAIN_INJECT_FAULT", "KEYBOARD", "TOKENIZERS_PARALLELISM")))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_plan_never_shows_a_credential_and_says_how_to_pass_it(tmp_path: Path, fmt: str) -> None:
    proc = run_hpctrain(
        f"+cluster.env.WANDB_API_KEY={FAKE}",
        "+cluster.env.NCCL_DEBUG=INFO",
        "dry_run=true",
        f"plan.format={fmt}",
        f"run.root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FAKE not in proc.stdout + proc.stderr
    if fmt == "json":
        plan = json.loads(proc.stdout)
        assert plan["environment"]["WANDB_API_KEY"] == "<redacted>" and plan["environment"]["NCCL_DEBUG"] == "INFO"
        warning = next(w for w in plan["warnings"] if w["key"] == "cluster.env.WANDB_API_KEY")
        assert "export WANDB_API_KEY" in warning["fix"] and "--export" in warning["fix"]
    else:
        assert "WANDB_API_KEY=<redacted>" in proc.stdout and "export WANDB_API_KEY=" in proc.stdout


PROBE = """
import hashlib, os
if os.environ.get("SUBMITIT_EXECUTOR") and os.environ.get("SECRETS_PROBE_DIR"):
    value = os.environ.get("WANDB_API_KEY", "")
    with open(os.path.join(os.environ["SECRETS_PROBE_DIR"], f"{os.getpid()}.sha256"), "w") as f:
        f.write(hashlib.sha256(value.encode()).hexdigest())
"""


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
    proc = run_hpctrain(
        f"+cluster.env.WANDB_API_KEY={FAKE}", "train.max_steps=2", "run.id=s", f"run.root={root}", cwd=tmp_path, env=env
    )
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


# Issue 46: names outside the first pattern, and values that are credentials whatever their name
SECRET_NAMES = [
    "TOKEN",
    "PASSWD",
    "MY_API_KEY",
    "DB_PASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "HF_TOKEN",
    "WANDB_API_KEY",
    "GITHUB_PAT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "SSH_PRIVATE_KEY",
    "SSH_KEY",
    "AUTH",
    "SESSION",
    "COOKIE",
    "NGROK_AUTHTOKEN",
    "DB_PASS",
    "apiKey",
    "AWS_SESSION_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
]
PLAIN_NAMES = [
    "NCCL_DEBUG",
    "HPCTRAIN_INJECT_FAULT",
    "KEYBOARD",
    "TOKENIZERS_PARALLELISM",
    "PATH",
    "PWD",
    "HOME",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_IB_HCA",
    "WANDB_PROJECT",
    "HF_HOME",
    "MASTER_ADDR",
    "NCCL_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTHONPATH",
    "PASSTHROUGH",
    "MONKEY_PATCH",
]
# Fakes in each service's format (none is a real credential)
TOKENS = {
    "hugging-face": "hf_" + "Ab1" * 12,
    "github": "ghp_" + "x9Y" * 12,
    "github-fine-grained": "github_pat_" + "11ABCDEFG0" * 4,
    "openai": "sk-proj-" + "q7W" * 10,
    "aws-key-id": "AKIA" + "IOSFODNN7EXAMPLE",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "slack": "xoxb-" + "1234567890-abcdefghij",
    "url-with-password": "postgres://trainer:s3cr3tpw@db.example.org/runs",
}


def test_the_broader_names_look_like_credentials_and_plain_ones_do_not() -> None:
    from hpctrain.launch.secrets import looks_secret

    assert [n for n in SECRET_NAMES if not looks_secret(n)] == []
    assert [n for n in PLAIN_NAMES if looks_secret(n)] == []


@pytest.mark.parametrize("kind", TOKENS)
def test_a_value_that_is_a_token_is_a_credential_whatever_its_name(kind: str) -> None:
    from hpctrain.launch.secrets import is_secret, redact_text, secret_value

    value = TOKENS[kind]
    assert secret_value(value) and is_secret("MY_SETTING", value)
    assert redact_text(f"+cluster.env.MY_SETTING={value}") == "+cluster.env.MY_SETTING=<redacted>"
    assert redact_text(f"cluster.partition={value}") == "cluster.partition=<redacted>"


@pytest.mark.parametrize(
    "value",
    [
        "INFO",
        "mlx5_0,mlx5_1",
        "/usr/lib/x86_64-linux-gnu",
        "http://proxy:3128",
        "0123456789abcdef0123456789abcdef01234567",
        "sk-short",
        "hf_transfer",
    ],
)
def test_plain_values_are_not_tokens(value: str) -> None:
    from hpctrain.launch.secrets import secret_value

    assert secret_value(value) == "", value


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_plan_says_which_values_were_redacted_and_shows_none(compose_cfg, capsys, tmp_path: Path, fmt: str) -> None:
    from hpctrain.launch.cli import run

    env = {
        "TOKEN": FAKE,
        "GITHUB_PAT": "ghp_" + "x9Y" * 12,
        "MY_SETTING": TOKENS["hugging-face"],
        "DATABASE_URL": TOKENS["url-with-password"],
        "NCCL_DEBUG": "INFO",
    }
    cfg = compose_cfg(
        *(f"+cluster.env.{k}={v}" for k, v in env.items()), "dry_run=true", f"plan.format={fmt}", f"run.root={tmp_path}"
    )
    assert run(cfg).code == 0
    out, err = capsys.readouterr()
    for name, value in env.items():
        if name != "NCCL_DEBUG":
            assert value not in out + err, name
    redacted = [f"cluster.env.{k}" for k in env if k != "NCCL_DEBUG"]
    if fmt == "json":
        plan = json.loads(out)
        assert plan["redacted"] == redacted and plan["environment"]["NCCL_DEBUG"] == "INFO"
        assert {w["key"] for w in plan["warnings"]} >= set(redacted)
        assert "looks like a Hugging Face token" in next(
            w["message"] for w in plan["warnings"] if w["key"] == "cluster.env.MY_SETTING"
        )
    else:
        for key in redacted:
            assert (
                f"  {key}: redacted (passed to the job through the environment of the submission, not written "
                "to the plan, config.yaml or plan.json)" in out
            )
        assert "cluster.env.NCCL_DEBUG: redacted" not in out and "NCCL_DEBUG=INFO" in out
    assert not any(tmp_path.iterdir())


def test_a_value_redacted_for_what_it_is_reaches_the_job_through_the_environment(compose_cfg) -> None:
    """The same path as a named credential: out of the task's config, into the submission's environment."""
    from omegaconf import OmegaConf

    from hpctrain.launch.secrets import REDACTED, redact, without_redacted

    value = TOKENS["github"]
    cfg = compose_cfg(f"+cluster.env.DEPLOY={value}", "+cluster.env.NCCL_DEBUG=INFO")
    secrets = redact(cfg.cluster)
    assert secrets == {"DEPLOY": value} and cfg.cluster.env.DEPLOY == REDACTED
    task = without_redacted(OmegaConf.to_container(cfg, resolve=True))
    assert task["cluster"]["env"] == {"NCCL_DEBUG": "INFO"}
