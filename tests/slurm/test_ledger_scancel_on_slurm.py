"""D4 (issue 48) on the dev cluster: after a plain `scancel` the ledger's parts exceeded the allocation by 2.6%.
Slurm records the job's end at the cancel; its tasks, sent SIGTERM, finish the step in flight and save before
KillWait runs out. The ledger's parts must be the allocation sacct accounts, and what the tasks did after its end
is reported beside (`past_end_node_s`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_hpctrain
from tests.slurm.test_hpctrain_on_slurm import last_step, submit, wait_done, wait_for
from tests.slurm.test_ledger_on_slurm import held_node_s

pytestmark = [pytest.mark.slurm]


@pytest.mark.timeout(300)
def test_after_a_plain_scancel_the_ledger_is_the_allocation_sacct_accounted(slurm_cluster: Any, tmp_path: Path) -> None:
    job, run_dir = submit(slurm_cluster, tmp_path, "cancel")
    wait_for("step 20", lambda: last_step(run_dir) >= 20, 200, every=0.5)
    slurm_cluster.run("scancel", job)
    states = wait_done(slurm_cluster, run_dir)  # sacct says CANCELLED at once: the tasks are still saving
    assert states[job].startswith("CANCELLED"), states

    def stopped() -> list[dict[str, Any]]:
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        return [e for e in events if e["event"] == "attempt_end" and e.get("how") == "stopped"]

    (end,) = wait_for("the save after the cancel", stopped, 60, every=0.5)
    assert end["reason"] == "terminated (SIGTERM)", end

    shown = run_hpctrain(
        str(run_dir), "--json", module="hpctrain.status", cwd=tmp_path, timeout=60, env=slurm_cluster.env()
    )
    assert shown.returncode == 0, shown.stderr
    ledger = json.loads(shown.stdout)
    held = held_node_s(slurm_cluster, [job])
    assert ledger["allocated_node_s"] == held
    assert sum(ledger["parts"].values()) == pytest.approx(held, rel=1e-9), (ledger["parts"], held)
    assert abs(ledger["unattributed_node_s"]) < 1e-6 * held
    # the step in flight and the save ran past the accounted end: at least the save's time, on each node
    assert ledger["past_end_node_s"] >= end["save_s"] * ledger["jobs"][0]["nodes"] * 0.99, ledger
