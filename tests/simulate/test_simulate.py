"""The simulator against real runs and against itself, on tiny models (quick).

A simulated rank must measure what the same rank measures on real tensors in a real gloo world: the fake tensors,
the fake process group and the stand-in pipeline peers (hpctrain.simulate.peers) must not change what torch
allocates. Then: the two-micro-batch slice equals the whole step, a wrong stand-in is refused, the collectives are
counted on the group they run on, and the command line refuses what it cannot simulate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpctrain.config.layout import resolve_layout
from hpctrain.simulate import simulate
from hpctrain.simulate.memory import category_peaks, peak_by_category, step_tracker
from hpctrain.simulate.peers import BoundaryMismatch, pipeline_peers
from tests.conftest import REPO, run_hpctrain
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import make_cfg, rank_batches
from tests.parallel.test_moe_layouts import MOE

pytestmark = pytest.mark.usefixtures("gpu_rules")

# id -> (processes, overrides, exact): a pipeline with ZeRO-3 and recomputation (the last stage's rank needs the
# stand-in for stage 0), FSDP2 with TP and SP, interleaved stages with TP and the tied embedding (torch's MemTracker,
# no FSDP), one process (no process group in the real run). `exact`: every category equal; with TP, DTensor's
# functional collectives run traced under fake tensors (waited at once, FSDP2 re-allocating its all-gather outputs
# with torch.empty instead of resizing them), which moves temporaries and may move the peak's moment: each model state's
# and collective buffer's own peak stays exact and the peak within PEAK_TOLERANCE (docs/simulate.md).
PEAK_TOLERANCE = 0.10
LAYOUTS = {
    "zero3_dp2xpp2": (
        4,
        {"parallel__pp": 2, "zero__stage": 3, "train__micro_batch": 2, "parallel__recompute": "full"},
        True,
    ),
    "single_accum4": (1, {"train__micro_batch": 2}, True),
    "zero3_dp2xtp2_sp": (
        4,
        {"parallel__tp": 2, "zero__stage": 3, "parallel__sequence_parallel": True, "train__micro_batch": 2},
        False,
    ),
    "tp2xpp2_interleaved": (
        4,
        {
            "parallel__pp": 2,
            "parallel__tp": 2,
            "parallel__schedule": "interleaved_1f1b",
            "parallel__virtual_stages": 2,
            "train__micro_batch": 1,
        },
        False,
    ),
    # MoE with EP 2 under ZeRO-3: fake tensors route evenly (hpctrain.models.common.moe.balanced), the real router does
    # not, so the routed rows' temporaries differ; the model states cannot
    "moe_ep2_zero3": (2, {**MOE, "parallel__ep": 2, "zero__stage": 3, "train__micro_batch": 2}, False),
}
STATES = (
    "Sharded Param",
    "Unsharded Param",
    "Sharded Grad",
    "Unsharded Grad",
    "OptState",
    "Parameter",
    "Gradient",
    "Optstate",
    "Buffer",
    "All Gather",
    "Reduce Scatter",
)


def _measured_step(rank: int, world: int, overrides: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """One rank of a real gloo run: a first step (start-up, optimizer state), then the second step measured: torch's
    peak snapshot by category, and each category's own peak."""
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    engine.step(rank_batches(0, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
    tracker = step_tracker(engine.model_parts, engine.optimizers)
    batches = rank_batches(1, cfg, engine.dp_rank, engine.dp_size)
    with tracker:
        engine.step(batches, cfg.optim.lr)
    return peak_by_category(tracker), category_peaks(tracker)


@pytest.mark.slow  # real gloo runs and simulations, each in processes of their own
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_simulated_rank_measures_what_the_real_rank_measures(name: str) -> None:
    world, overrides, exact = LAYOUTS[name]
    real = (
        run_distributed(_measured_step, world, overrides, timeout=300)
        if world > 1
        else [_measured_step(0, 1, overrides)]
    )
    cfg = make_cfg(world, **overrides)
    layout = resolve_layout(cfg)
    for rank in sorted({0, world - 1}):  # the first and the last pipeline stage where there is a pipeline
        sim, (mine, own_peaks) = simulate(cfg, layout, rank), real[rank]
        if exact:
            assert sim.categories == mine, (rank, sim.categories, mine)
        else:  # the peak moment may move between two near-equal candidates: each state's own peak is exact
            assert {k: v for k, v in sim.category_peaks.items() if k in STATES} == {
                k: v for k, v in own_peaks.items() if k in STATES
            }, (rank, sim.category_peaks, own_peaks)
            assert sim.peak == pytest.approx(sum(mine.values()), rel=PEAK_TOLERANCE), (rank, sim.categories, mine)
        # the step's one control all-reduce; over every rank besides it, only FSDP2's and expert parallelism's
        # own, where their mesh is the world
        counts = _counts(sim)
        assert counts.get(("allreduce_", world), 0) == (1 if world > 1 else 0)
        assert {op for op, size in counts if size == world and op != "allreduce_"} <= {
            "_allgather_base_",
            "_reduce_scatter_base_",
            "alltoall_base_",
            "all_to_all_single",
        }, counts
    assert not dist.is_initialized()  # the fake world lived in a process of its own


@pytest.mark.slow  # simulations, each in a process of its own
def test_the_three_microbatch_slice_is_the_whole_steps_peak() -> None:
    """Without a pipeline, micro-batches between the first (gathers) and the last (reshards) repeat each other's
    allocations: 8 micro-batches peak as 3 do."""
    overrides = {"zero__stage": 2, "train__micro_batch": 1, "train__global_batch": 16}  # FSDP2 over DP 2, no TP
    cfg = make_cfg(2, **overrides)
    layout = resolve_layout(cfg)
    assert layout.grad_accum == 8
    sliced, whole = simulate(cfg, layout, 0), simulate(cfg, layout, 0, microbatches=8)
    assert (sliced.microbatches, sliced.step_microbatches, whole.microbatches) == (3, 8, 8)
    assert sliced.categories == whole.categories


def _counts(sim: Any) -> dict[tuple[str, int], int]:
    """(op, group size) -> count, from the simulation's "op over N ranks" summary."""
    out = {}
    for name, n in sim.collectives.items():
        op, _, size = name.partition(" over ")
        out[(op, int(size.split()[0]))] = n
    return out


def _with_a_wrong_stand_in(config: dict[str, Any]) -> str:
    """simulate_here with stand-in peers that say stage 0 sends a tensor of the wrong width; the error's text."""
    from torch.distributed.pipelining.stage import extract_tensor_meta

    import hpctrain.simulate.rank as rank_module
    from hpctrain.train.loop import load_config

    cfg = load_config(config)
    wrong = (extract_tensor_meta(torch.zeros(2, 16, 65, requires_grad=True)),)
    real_peers = rank_module.pipeline_peers
    rank_module.pipeline_peers = lambda boundary: real_peers(wrong)
    try:
        rank_module.simulate_here(cfg, resolve_layout(cfg), 0)
    except BoundaryMismatch as err:
        return str(err)
    return "no error"


@pytest.mark.slow  # real gloo runs and simulations, each in processes of their own
def test_a_stand_in_that_differs_from_what_a_stage_sends_is_refused() -> None:
    """A rank with stage 0 checks its sends against the stand-in (a later stage's input would be wrong)."""
    import multiprocessing

    from omegaconf import OmegaConf

    config = OmegaConf.to_container(make_cfg(2, parallel__pp=2, train__micro_batch=2))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        message = pool.apply(_with_a_wrong_stand_in, (config,))
    assert message.startswith("stage 0 sends") and "65" in message, message
    with pipeline_peers(None):  # the context restores torch's own methods
        pass
    from torch.distributed.pipelining import stage as torch_stage

    assert torch_stage.PipelineStage._recv_meta.__qualname__ == "PipelineStage._recv_meta"


def _count_in_a_fake_world() -> tuple[dict[str, int], int]:
    """Three collectives on a fake world of 64 ranks, counted (in a process of its own: a fake world's groups
    must not outlive it in the test process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpctrain.simulate.collectives import CollectiveCounter

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    try:
        pair = dist.new_group([4, 5], use_local_synchronization=True)
        counter = CollectiveCounter()
        t = torch.zeros(4)
        with counter:
            dist.all_reduce(t)
            dist.all_reduce(t, group=pair)
            dist.all_gather_into_tensor(torch.zeros(8), t, group=pair)
        return counter.summary(), counter.on_world()
    finally:
        dist.destroy_process_group()


def test_collectives_are_counted_on_their_groups() -> None:
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        summary, on_world = pool.apply(_count_in_a_fake_world)
    assert summary == {"allreduce_ over 64 ranks": 1, "allreduce_ over 2 ranks": 1, "_allgather_base_ over 2 ranks": 1}
    assert on_world == 1


def test_a_simulation_that_fails_says_why_with_its_traceback() -> None:
    """A failure in the simulation's process comes back as text: torch's exceptions can hold objects the pool
    cannot pickle, which left the user a pickling error instead of the cause. DDP (refused by the checks, called
    here directly) fails: its reducer needs real memory."""
    from hpctrain.simulate.rank import SimulationError

    cfg = make_cfg(2, zero__stage=0)
    with pytest.raises(SimulationError) as failed:
        simulate(cfg, resolve_layout(cfg), 0)
    assert "data is not allocated" in str(failed.value) and "Traceback (most recent call last)" in str(failed.value)


@pytest.mark.slow  # a simulation from the command line, in a process of its own
def test_a_moe_model_is_simulated_from_the_command_line(tmp_path: Path) -> None:
    """The tiny MoE family with EP 2 under ZeRO-3, as a user asks for it: the planner's model states hold."""
    proc = run_hpctrain(
        "model=moe_tiny",
        "zero=stage3",
        "cluster.gpus_per_node=2",
        "parallel.ep=2",
        "dry_run=simulate",
        "plan.format=json",
        f"run.root={tmp_path}",
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = json.loads(proc.stdout)["simulation"]
    assert sim["world_size"] == 2 and sim["model_states"]["within"], sim["model_states"]
    assert sim["collectives"]["all_to_all_single over 2 ranks"] > 0


@pytest.mark.parametrize(
    "overrides,key,message",
    [
        (["+experiment=175b", "dry_run=maybe"], "dry_run", "must be true, false or simulate"),
        (
            ["+experiment=175b", "dry_run=simulate", "plan.simulate_rank=4096"],
            "plan.simulate_rank",
            "is not a rank of this 4096-rank job",
        ),
        (
            ["+experiment=175b", "dry_run=simulate", "zero=stage3_nvme", "zero.nvme_path=/tmp"],
            "dry_run",
            "simulate cannot run Adam's moments on NVMe",
        ),
        (
            ["+experiment=gpt3_1.3b_1node", "dry_run=simulate", "zero=stage0"],
            "dry_run",
            "simulate builds FSDP2 layouts",
        ),
    ],
)
def test_what_cannot_be_simulated_is_refused_naming_the_key(
    overrides: list[str], key: str, message: str, tmp_path: Path
) -> None:
    proc = run_hpctrain(*overrides, f"run.root={tmp_path}", cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert key in proc.stderr and message in proc.stderr, proc.stderr[-2000:]
    assert "simulation" not in proc.stdout
