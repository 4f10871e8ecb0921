"""The embedded default end to end: `python -m hpctrain` on this machine through submitit's local executor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_hpctrain


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_dir(stdout: str) -> Path:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("run directory: "), last
    return Path(last.removeprefix("run directory: "))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_command_trains_the_tiny_gpt(tmp_path: Path) -> None:
    proc = run_hpctrain(f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = _run_dir(proc.stdout)
    assert run_dir.parent.parent == tmp_path
    assert "step 400/400" in proc.stdout and "tok/s" in proc.stdout and "ETA" in proc.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["id"] == run_dir.name and config["model"]["name"] == "tiny"
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 401))  # every step logged
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= set(metrics[0])
    assert abs(metrics[0]["loss"] - math.log(256)) < 0.5  # starts near uniform over bytes
    last = [m["loss"] for m in metrics[-20:]]
    assert sum(last) / len(last) < 2.5, last
    logs = list((run_dir / "submitit").glob("*_log.out"))
    assert len(logs) == 1  # one task, the node's elastic agent, and its 2 workers
    assert all(f"task rank {r}/2 local {r}" in logs[0].read_text() for r in (0, 1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_continues_in_the_same_directory(tmp_path: Path) -> None:
    common = [f"run.root={tmp_path}", "optim.warmup_steps=2", "checkpoint.tiers.0.interval_steps=4"]
    first = run_hpctrain(*common, "run.id=resumable", "train.max_steps=6", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = _run_dir(first.stdout)
    second = run_hpctrain(*common, "run.resume=resumable", "train.max_steps=10", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _run_dir(second.stdout) == run_dir
    assert "resuming at step 6" in second.stdout
    steps = [m["step"] for m in _metrics(run_dir)]
    assert steps == list(range(1, 11))
    assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_attempt_of_a_live_run_takes_it_over(tmp_path: Path) -> None:
    """Started by hand while the first attempt still trains: the new attempt takes the lease, the old one
    stops at its next step (exit 0) and writes nothing more; the metrics hold one block per attempt."""
    import subprocess
    import sys
    import time

    common = [
        f"run.root={tmp_path}",
        "optim.warmup_steps=2",
        "checkpoint.tiers.0.interval_steps=10",
        "run.id=twice",
        "train.max_steps=150",
        "train.log_every=1000",
    ]
    env = {**__import__("os").environ, "WANDB_MODE": "offline"}
    # The first attempt straggles at step 30 for longer than the second needs to start and take the lease: on a
    # fast machine it would otherwise finish all 150 steps first (seen once in CI).
    stall = "+cluster.env.HPCTRAIN_INJECT_FAULT='stall:step=30:rank=0:seconds=60:once'"
    first = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", *common, stall],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "smoke" / "twice"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists() or len(_metrics(run_dir)) < 25:
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.5)
    second = run_hpctrain(*common[:-2], "run.resume=twice", "train.max_steps=150", cwd=tmp_path)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, err[-2000:] + second.stderr[-2000:]
    assert "a newer attempt of this run took the lease" in out + err
    steps = [m["step"] for m in _metrics(run_dir)]
    # Where the new attempt began, from its own record (the steps alone cannot tell when the old attempt's last
    # step is the very checkpoint the new one resumes from: then no step repeats).
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    attempts = [e["from_step"] for e in events if e["event"] == "attempt"]
    assert len(attempts) == 2 and attempts[0] == 0, attempts
    resumed = attempts[1]
    assert resumed in (10, 20)  # a checkpoint of the first attempt (it trained 25 steps or more, and stalled at 30)
    restart = len(steps) - (150 - resumed)  # the new attempt wrote steps resumed + 1 .. 150
    assert steps[:restart] == list(range(1, restart + 1)) and restart >= resumed
    assert steps[restart:] == list(range(resumed + 1, 151))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_full_data_path_from_a_corpus(tmp_path: Path) -> None:
    """`+experiment=stdlib_bpe`: the login node prepares a Megatron-format dataset (a BPE trained on the
    standard library's sources), the job trains on it with a validation loss; a second run finds the dataset."""
    env = {"HPCTRAIN_CACHE": str(tmp_path / "cache")}
    common = ["+experiment=stdlib_bpe", f"run.root={tmp_path}", "train.max_steps=40", "train.eval_every=20"]
    first = run_hpctrain(*common, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    prefix = tmp_path / "cache" / "stdlib_bpe4096" / "stdlib"
    assert f"data: preparing {prefix} from stdlib" in first.stdout
    assert all(Path(f"{prefix}{ext}").is_file() for ext in (".bin", ".idx", ".tokenizer.json"))
    assert "| val loss" in first.stdout and "data wait" in first.stdout
    metrics = _metrics(_run_dir(first.stdout))
    evaluated = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [20, 40]
    assert evaluated[1]["val_loss"] < evaluated[0]["val_loss"] < math.log(4096) + 0.5
    assert all("data_wait_s" in m for m in metrics)
    second = run_hpctrain(*common, "train.max_steps=2", "train.eval_every=1", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "data: preparing" not in second.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_nvme_offload_trains_and_resumes_as_cpu_offload_does(tmp_path: Path) -> None:
    """The real command with zero=stage3_nvme: every loss bitwise that of zero=stage3_offload, through a resume on
    another NVMe path (the checkpoint holds the moments), and nothing left on the NVMe afterwards."""
    common = [f"run.root={tmp_path}", "+experiment=smoke", "train.log_every=1", "checkpoint.tiers.0.interval_steps=4"]
    cpu = run_hpctrain(*common, "zero=stage3_offload", "run.id=cpu", "train.max_steps=8", cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    first = run_hpctrain(
        *common,
        "zero=stage3_nvme",
        f"zero.nvme_path={tmp_path}/nvme1",
        "run.id=nvme",
        "train.max_steps=4",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_hpctrain(
        *common,
        "zero=stage3_nvme",
        f"zero.nvme_path={tmp_path}/nvme2",
        "run.resume=nvme",
        "train.max_steps=8",
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at step 4" in second.stdout
    nvme_dir = _run_dir(second.stdout)
    log = "".join(p.read_text() for p in (nvme_dir / "submitit").glob("*_log.*"))
    assert "optimizer moments:" in log
    assert [m["loss"] for m in _metrics(nvme_dir)] == [m["loss"] for m in _metrics(_run_dir(cpu.stdout))]
    assert not [*(tmp_path / "nvme1").iterdir(), *(tmp_path / "nvme2").iterdir()]
