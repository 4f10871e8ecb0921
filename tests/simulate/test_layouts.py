"""The largest layouts, one rank each, built and stepped for real on fake tensors: a suite above the layout suite.

Each experiment runs as a user runs it (`python -m hpctrain +experiment=X dry_run=simulate plan.format=json`): the
rank the planner names most loaded is built by the task's engine in a fake world of the job's size and steps once.
The planner's model states (parameters + gradients + optimizer state) must be within the simulation's tolerance of
torch's for that rank (hpctrain.simulate.report.STATES_TOLERANCE); parameters and optimizer state are sizes the
layout fixes, and must agree to the byte's rounding. The step's collectives and the groups it holds are pinned.
Activations are reported, not held to the planner (docs/simulate.md says why)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from hpctrain.launch.plan_view import render_text
from hpctrain.simulate.report import STATES_TOLERANCE
from tests.conftest import REPO, run_hpctrain

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("gpu_rules")]

GiB = 2**30
# experiment -> (world, rank simulated, stages it holds, process groups it holds, groups the engine makes beyond
# the mesh, point-to-point sends in the step)
LAYOUTS = {
    "175b": (4096, 0, [0], 5, 1, 12),  # 512 tied-embedding pairs, made in one call; 12 micro-batches sent forward
    "gpt3_13b_16node": (128, 0, [0, 2], 4, 0, 96),  # PP 2: the tied embedding is summed on the pipeline group
    "llama3_8b_4node": (32, 0, [0], 3, 0, 0),
    # Meta's interleaved pipeline, 4 chunks a rank, 1 + 62 x 2 + 1 layers: 16 micro-batches sent forward from each
    # of the rank's 4 chunks, and their gradients back from chunks 16, 32 and 48
    "llama3_405b": (16384, 0, [0, 16, 32, 48], 4, 0, 16 * 4 + 16 * 3),
    "qwen3_235b_a22b": (256, 0, [0], 3, 0, 0),  # MoE, EP 8: its FSDP over all 256 ranks, its experts over 32
}
# experiment -> the step's expert-parallel all-to-alls: (of the split sizes, of the rows); 94 MoE layers x 3
# micro-batches x 2 forwards (full recomputation): one exchange of counts each, the rows there and back each
# forward and the two gradients' exchanges in backward
ALL_TO_ALLS = {"qwen3_235b_a22b": (94 * 3 * 2, 94 * 3 * 6)}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict, str]]:
    """experiment -> (its JSON plan, the run's stderr): each experiment simulated once for the module's tests."""
    done: dict[str, tuple[dict, str]] = {}

    def simulate(experiment: str) -> tuple[dict, str]:
        if experiment not in done:
            root = tmp_path_factory.mktemp(experiment)
            proc = run_hpctrain(
                f"+experiment={experiment}",
                "dry_run=simulate",
                "plan.format=json",
                f"run.root={root}",
                cwd=REPO,
                timeout=900,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[experiment] = json.loads(proc.stdout), proc.stderr
        return done[experiment]

    return simulate


@pytest.mark.timeout(900)
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
    # a column at its own worst in the step holds at least what it held at the peak; the total is the peak
    assert sim["peak"] == sum(sim["categories"].values()) == sim["total"]["torch"]
    assert all(sim["columns"][key]["torch"] >= held for key, held in sim["snapshot_columns"].items())
    # start-up: the mesh's groups and, beyond it, O(1) calls; the step: one control collective over every rank
    # (FSDP's own are over every rank too where the data-parallel mesh is the world)
    assert (sim["groups_held"], sim["group_calls"]) == (groups, calls)
    assert sim["collectives"][f"allreduce_ over {world} ranks"] == 1
    fsdp_on_world = sum(
        sim["collectives"].get(f"{op} over {world} ranks", 0) for op in ("_allgather_base_", "_reduce_scatter_base_")
    )
    assert sim["world_collectives"] == 1 + fsdp_on_world
    if experiment in ALL_TO_ALLS:
        counts, rows = ALL_TO_ALLS[experiment]
        assert (
            sim["collectives"]["alltoall_base_ over 8 ranks"],
            sim["collectives"]["all_to_all_single over 8 ranks"],
        ) == (counts, rows)
    assert sum(n for name, n in sim["collectives"].items() if name.startswith("send ")) == sends
    assert set(sim["unseen"]) >= {"kernel speed", "NCCL's own buffers"}
    # on fake CUDA (g++ builds it here): the attention kernel an H100 runs, so a GPU's activations
    assert (sim["device"], sim["why_cpu"], set(sim["attention"])) == ("cuda (fake)", "", {"flash"})
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
    assert "one training step on fake tensors on fake CUDA (the GPU's attention kernels: flash x" in out
    assert "nothing was submitted" not in stderr and "batch script (slurm" in out  # a dry run: nothing queued
