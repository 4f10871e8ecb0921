"""The largest layouts, one rank each, built and stepped for real on fake tensors: a suite above the layout suite.

Each experiment runs as a user runs it (`python -m hpctrain +experiment=X dry_run=simulate plan.format=json`): the
rank the planner names most loaded is built by the task's engine in a fake world of the job's size and steps once.
The planner's model states (parameters + gradients + optimizer state) must be within the simulation's tolerance of
torch's for that rank (hpctrain.simulate.report.STATES_TOLERANCE); parameters and optimizer state are sizes the
layout fixes, and must agree to the byte's rounding. The step's collectives and the groups it holds are pinned.
Activations are reported, not held to the planner (docs/simulate.md says why)."""

from __future__ import annotations

import json
from typing import Callable

import pytest

from hpctrain.launch.plan_view import render_text
from hpctrain.simulate.report import STATES_TOLERANCE
from tests.conftest import REPO, run_hpctrain

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gpu_rules")]

GiB = 2**30
# experiment -> (world, rank simulated, stages it holds, process groups it holds, groups the engine makes beyond
# the mesh, point-to-point sends in the step)
LAYOUTS = {
    "175b": (4096, 0, [0], 7, 1, 12),  # 512 tied-embedding pairs, made in one call; 12 micro-batches sent forward
    "gpt3_13b_16node": (128, 0, [0, 2], 6, 0, 96),  # PP 2: the tied embedding is summed on the pipeline group
    "llama3_8b_4node": (32, 0, [0], 6, 0, 0),
    "llama3_405b": (14336, 0, [0], 6, 0, 16),
}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict, str]]:
    """experiment -> (its JSON plan, the run's stderr): each experiment simulated once for the module's tests."""
    done: dict[str, tuple[dict, str]] = {}

    def simulate(experiment: str) -> tuple[dict, str]:
        if experiment not in done:
            root = tmp_path_factory.mktemp(experiment)
            proc = run_hpctrain(f"+experiment={experiment}", "dry_run=simulate", "plan.format=json",
                                f"run.root={root}", cwd=REPO, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[experiment] = json.loads(proc.stdout), proc.stderr
        return done[experiment]

    return simulate


@pytest.mark.parametrize("experiment", LAYOUTS)
def test_the_planner_holds_against_torch_on_the_most_loaded_rank(experiment: str, simulated) -> None:
    world, rank, stages, groups, calls, sends = LAYOUTS[experiment]
    plan, _ = simulated(experiment)
    sim = plan["simulation"]
    assert (sim["world_size"], sim["rank"], sim["stages"]) == (world, rank, stages)
    assert sim["pp_rank"] == plan["memory_per_gpu_bytes"]["pipeline_stage"]  # the planner's most loaded stage
    states = sim["model_states"]
    assert abs(states["drift"]) <= STATES_TOLERANCE, states
    assert states["within"] and states["tolerance"] == STATES_TOLERANCE
    for column in ("params", "optimizer"):
        row = sim["columns"][column]
        assert row["torch"] == pytest.approx(row["planner"], rel=0.005), (column, row)
    assert sim["peak"] == sum(sim["categories"].values()) == sum(row["torch"] for row in sim["columns"].values())
    # start-up: the mesh's groups and, beyond it, O(1) calls; the step: one collective over every rank
    assert (sim["groups_held"], sim["group_calls"]) == (groups, calls)
    assert sim["world_collectives"] == 1 and sim["collectives"][f"allreduce_ over {world} ranks"] == 1
    assert sum(n for name, n in sim["collectives"].items() if name.startswith("send ")) == sends
    assert set(sim["unseen"]) >= {"kernel speed", "NCCL's own buffers"}
    assert sim["seconds"] < (120 if experiment == "175b" else 600)  # the 175B one: under 2 minutes


def test_the_175b_simulation_prints_its_table(simulated) -> None:
    """What a user reads: the table for the rank, planner against torch, and what the simulation cannot see.
    The text is the JSON plan rendered (`plan.format=text`, the default, prints `render_text` of the same plan),
    so the one 175B simulation serves both tests."""
    plan, stderr = simulated("175b")
    out = render_text(plan)
    assert "simulation: rank 0 of 4096 (pipeline rank 0, stage(s) 0; DP 0, TP 0)" in out
    for row in ("parameters", "gradients", "optimizer state", "buffers", "activations", "total"):
        assert any(line.strip().startswith(row) and line.count("GiB") == 2 for line in out.splitlines()), row
    assert "within the 10% tolerance" in out and "1 over all 4096 ranks" in out
    assert "not seen on fake tensors: kernel speed" in out
    assert "nothing was submitted" not in stderr and "sbatch script" in out  # a dry run: nothing queued
