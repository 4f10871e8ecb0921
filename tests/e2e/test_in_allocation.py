"""Recovery inside the allocation, end to end on the local executor: one elastic agent per node restarts the
workers when a rank is SIGKILLed (a raise: tests/slurm), in the same job, from the newest RAM-tier
checkpoint, and the run ends bit-identical to an uninterrupted one; a failure that repeats stops the run
instead of looping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.inspect import export_model, find
from hpctrain.tracking.wandb_file import run_info
from tests.conftest import run_hpctrain

STEPS = 30


def _common(tmp_path: Path, run_id: str) -> list[str]:
    return [
        f"run.root={tmp_path}",
        f"run.id={run_id}",
        f"train.max_steps={STEPS}",
        "optim.warmup_steps=2",
        "train.log_every=1000",
        "checkpoint.when_busy=wait",
        f"checkpoint.tiers=[{{name: ram, path: {tmp_path}/shm/{run_id}, interval_steps: 10, keep_last: 1}},"
        "{name: shared, path: checkpoints, interval_steps: 1000, keep_last: 1}]",
    ]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(export_model(find(run_dir, tier="shared"), run_dir / "export" / "model.pt")[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_hpctrain(*_common(tmp, "ref"), cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "smoke" / "ref"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill:step=15:rank=0:once"])  # a raise: tests/slurm
def test_a_failed_rank_is_restarted_in_the_allocation_and_ends_bit_identical(
    reference: Path, tmp_path: Path, fault: str
) -> None:
    kind = fault.split(":")[0]
    proc = run_hpctrain(
        *_common(tmp_path, kind),
        f"+cluster.env.HPCTRAIN_INJECT_FAULT='{fault}'",
        "tracking=wandb",
        "tracking.mode=offline",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "smoke" / kind
    jobs = (run_dir / "jobs.jsonl").read_text().splitlines()
    assert len(jobs) == 1  # the same job: no resubmission
    job = json.loads(jobs[0])["job_id"]
    logs = (run_dir / "submitit" / f"{job}_0_log.out").read_text()
    assert "restart 1" in logs and "resuming at step 10 (160 samples consumed) from ram tier" in logs
    assert list((run_dir / "failures" / job).glob("rank*.json"))  # the first attempt's records
    assert not list((run_dir / "failures" / f"{job}.1").glob("rank*.json"))  # the restart did not fail
    steps = [m["step"] for m in _metrics(run_dir)]
    assert steps == list(range(1, 15)) + list(range(11, STEPS + 1))  # steps 11-14 redone, from step 10's save
    ref = {m["step"]: m["loss"] for m in _metrics(reference)}
    assert all(m["loss"] == ref[m["step"]] for m in _metrics(run_dir))
    expected, got = _final_weights(reference), _final_weights(run_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert_ledger(run_dir, job, tmp_path)


def assert_ledger(run_dir: Path, job: str, cwd: Path) -> None:
    """`python -m hpctrain.status` on the run: one local job (no queue: no accounting), one restart inside it
    that redid steps 11-14, the parts tiling the job's time; and the ledger each attempt wrote as it went."""
    shown = run_hpctrain(str(run_dir), module="hpctrain.status", cwd=cwd, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "restart in the allocation" in shown.stdout and "the run is complete" in shown.stdout
    as_json = run_hpctrain(
        "--json", run_dir.name, "--root", str(run_dir.parents[1]), module="hpctrain.status", cwd=cwd, timeout=60
    )
    ledger = json.loads(as_json.stdout)
    assert [j["job_id"] for j in ledger["jobs"]] == [job] and ledger["jobs"][0]["ended"] == "finished the run"
    assert ledger["queue_s"] is None and ledger["accounting"] is False
    assert abs(ledger["unattributed_node_s"]) < 1e-6 * ledger["allocated_node_s"]
    (incident,) = ledger["incidents"]
    assert incident["kind"] == "restart in the allocation" and incident["lost_steps"] == 4
    assert (incident["last_step"], incident["resumed_from"], incident["tier"]) == (14, 10, "ram")
    assert ledger["steps_done"] == STEPS and ledger["steps_redone"] == 4 and ledger["parts"]["lost"] > 0
    assert 0 < ledger["goodput"] < 1 and ledger["parts"]["recovery"] > 0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    written = [e for e in events if e["event"] == "ledger"]
    assert len(written) == 3 and written[1]["incidents"] == 1  # at each attempt's first step, and at the end
    assert abs(written[-1]["goodput"] - ledger["goodput"]) < 0.01
    summaries = [run_info(p)["summary"] for p in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]
    assert summaries[-1]["ledger/goodput"] == written[-1]["goodput"]
    assert summaries[-1]["ledger/incidents"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_same_failure_twice_stops_the_run_inside_the_allocation(tmp_path: Path) -> None:
    proc = run_hpctrain(
        *_common(tmp_path, "broken"),
        "train.max_steps=6",
        "launcher.max_restarts=5",
        "+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=4:rank=1'",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1
    run_dir = tmp_path / "smoke" / "broken"
    report = json.loads((run_dir / "FAILED.json").read_text())
    assert "deterministic failure" in report["why"] and report["signature"]["step"] == 4
    assert report["signature"]["type"] == "InjectedFault" and report["restarts"] == 1
    job = report["job_id"]
    failed = sorted(p.parent.name for p in (run_dir / "failures").glob("*/rank1.json"))
    assert failed == [job, f"{job}.1"]  # two attempts failed; the third stopped before training
    assert "run stopped: deterministic failure" in proc.stderr
