"""Engine behaviour beyond matching losses: loss scaling, divergence, clipping, checkpoints, stage counts."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch

from hpctrain.config.layout import resolve_layout
from hpctrain.parallel.dims import ParallelDims, ParallelDimsError
from tests.distributed_harness import CrashedRankRetried, DistributedTestError, run_distributed
from tests.parallel.layouts import LLAMA, make_cfg, rank_batches, reference

PP = {"train__micro_batch": 2}


def _engine(world: int, overrides: dict[str, Any]) -> Any:
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    return cfg, build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))


# ---- fp16 loss scaling -------------------------------------------------------------------------------------


def _overflow_run(rank: int, world: int, overrides: dict[str, Any]) -> dict[str, Any]:
    from hpctrain.parallel.engine import _local

    cfg, engine = _engine(world, overrides)
    before = {n: _local(p).detach().clone() for m in engine.stage_models for n, p in m.named_parameters()}
    first = engine.step(rank_batches(0, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
    unchanged = all(torch.equal(_local(p), before[n]) for m in engine.stage_models for n, p in m.named_parameters())
    rest = [engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr) for s in range(1, 8)]
    return {"first": first, "unchanged": unchanged, "rest": rest}


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, {"parallel__tp": 2}),  # each rank holds different gradients: the overflow must be agreed on
        (2, {"parallel__pp": 2, **PP}),
        (2, {"zero__stage": 3}),
    ],
    ids=["tp2", "pp2", "zero3"],
)
def test_fp16_overflow_skips_step_and_halves_scale(world: int, overrides: dict[str, Any]) -> None:
    scaling = {
        "precision__dtype": "fp16",
        "precision__loss_scaling": True,
        "precision__initial_scale": 2.0**40,
        "precision__loss_scale_window": 3,
        "precision__min_scale": 2.0**36,
    }
    results = run_distributed(_overflow_run, world, {**overrides, **scaling}, timeout=120)
    for r in results:
        assert r["first"].skipped and r["first"].loss_scale == 2.0**40
        assert r["unchanged"], "an overflowing step must not change the weights"
        scales = [s.loss_scale for s in r["rest"]]
        assert scales[0] == 2.0**39
        assert min(scales) == 2.0**36, "the scale never drops below precision.min_scale"
        assert [s.skipped for s in r["rest"]] == [s.skipped for s in results[0]["rest"]]
        assert [s.loss_scale for s in r["rest"]] == scales


def test_fp16_scale_grows_after_window() -> None:
    from hpctrain.parallel.precision import LossScaler

    cfg = make_cfg(
        1,
        precision__dtype="fp16",
        precision__loss_scaling=True,
        precision__initial_scale=8.0,
        precision__loss_scale_window=2,
        precision__min_scale=4.0,
    )
    scaler = LossScaler(cfg.precision)
    for overflow, expected in [
        (False, 8.0),
        (False, 16.0),
        (True, 8.0),
        (True, 4.0),
        (True, 4.0),
        (False, 4.0),
        (False, 8.0),
    ]:
        scaler.update(overflow)
        assert scaler.scale == expected


# ---- divergence ----------------------------------------------------------------------------------------------


def _diverge(rank: int, world: int, overrides: dict[str, Any]) -> dict[str, Any]:
    from hpctrain.parallel.engine import TrainingDiverged

    cfg, engine = _engine(world, overrides)
    try:
        for s in range(6):
            engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), 1e30 if s == 0 else cfg.optim.lr)
    except TrainingDiverged as e:
        return {"step": e.step, "last_good": e.last_good_step, "message": str(e)}
    return {"step": None}


@pytest.mark.parametrize(
    "world,overrides", [(2, {}), (2, {"parallel__tp": 2}), (2, {"parallel__pp": 2, **PP})], ids=["dp2", "tp2", "pp2"]
)
def test_nan_loss_raises_on_every_rank(world: int, overrides: dict[str, Any]) -> None:
    results = run_distributed(_diverge, world, {**overrides, "optim__grad_clip": 0.0}, timeout=120)
    for r in results:
        assert r["step"] == 2 and r["last_good"] == 1, r
        assert "diverged at step 2" in r["message"] and "last good step 1" in r["message"]


# ---- clipping ------------------------------------------------------------------------------------------------


def _clipped_norm(rank: int, world: int, overrides: dict[str, Any]) -> tuple[float, float]:
    from hpctrain.parallel.clipping import clip_grads_

    cfg, engine = _engine(world, overrides)
    inputs, targets = engine._to_device(rank_batches(0, cfg, engine.dp_rank, engine.dp_size))
    if engine.schedule is not None:
        engine._pipeline_step(inputs, targets, 1.0)
    else:
        engine._accumulate(inputs, targets)
    engine._sync_tied_embeddings()
    zero = torch.zeros(())
    values = engine._reduce(zero, [])
    clip_grads_([p for part in engine.model_parts for p in part.parameters()], cfg.optim.grad_clip, values[1])
    return engine._stats(values, 0)[1], engine._stats(engine._reduce(zero, []), 0)[1]


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, {"parallel__tp": 2}),  # stock clip_grad_norm_ fails here (plain and DTensor gradients)
        (4, {"parallel__tp": 2, "zero__stage": 3}),  # and here (DTensors on different meshes)
        (4, {"parallel__tp": 2, "parallel__pp": 2, **PP}),
        (8, {"parallel__tp": 2, "parallel__pp": 2, "zero__stage": 2, **PP}),
    ],
    ids=["tp2", "zero3_dp2xtp2", "tp2xpp2", "dp2xtp2xpp2"],
)
def test_clipped_global_norm_equals_reference(world: int, overrides: dict[str, Any]) -> None:
    overrides = {**overrides, "optim__grad_clip": 0.25}
    ref = reference(overrides, 1, world)["grad_norm"][0]
    assert ref > 0.25, "the test needs clipping to be active"
    for before, after in run_distributed(_clipped_norm, world, overrides, timeout=120):
        assert before == pytest.approx(ref, rel=1e-5)
        assert after == pytest.approx(0.25, rel=1e-5)


# ---- checkpoints: layout-independent state ---------------------------------------------------------------


def _train_and_save(rank: int, world: int, overrides: dict[str, Any], path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    cfg, engine = _engine(world, overrides)
    for s in range(2):
        engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
    state = engine.state_dict()
    dcp.save(state, checkpoint_id=path)
    return sorted(state["model"])


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, {"zero__stage": 1}),
        (2, {"zero__stage": 3}),
        (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),
        (2, {"parallel__pp": 2, "parallel__schedule": "interleaved_1f1b", "parallel__virtual_stages": 2, **PP}),
        (
            8,
            {
                "parallel__pp": 2,
                "parallel__tp": 2,
                "zero__stage": 0,
                "parallel__schedule": "zbv",
                "parallel__virtual_stages": 2,
                **PP,
            },
        ),
        (2, {**LLAMA, "parallel__tp": 2, "parallel__sequence_parallel": True}),
        (
            2,
            {**LLAMA, "parallel__pp": 2, "parallel__schedule": "interleaved_1f1b", "parallel__virtual_stages": 2, **PP},
        ),
    ],
    ids=["zero1", "zero3", "tp2_sp", "pp2_interleaved", "3d_zbv", "llama_tp2_sp", "llama_pp2_interleaved"],
)
def test_checkpoint_resumes_in_a_single_process(world: int, overrides: dict[str, Any], tmp_path: Any) -> None:
    """Save after 2 steps in a layout, load into a plain single process (DCP reshards), take step 3: model
    and optimizer state must both have survived for the loss and the weights to match an unbroken run."""
    from hpctrain.checkpoint.reshard import load_state

    ref = reference(overrides, 3, world)
    keys = run_distributed(_train_and_save, world, overrides, str(tmp_path), timeout=180)
    cfg, engine = _engine(1, {k: v for k, v in overrides.items() if not k.startswith(("parallel", "zero"))})
    state = engine.state_dict()
    assert set().union(*keys) == set(state["model"]), "the same parameter names in every layout"
    load_state(state, str(tmp_path), None)  # tp2 pads the vocabulary (64 -> 128 rows), one process does not
    engine.load_state_dict(state)
    stats = engine.step(rank_batches(2, make_cfg(1), 0, 1), cfg.optim.lr)
    assert stats.loss == pytest.approx(ref["loss"][2], rel=1e-5)
    for name, value in engine.model.state_dict().items():  # the reference has the layout's padded rows
        torch.testing.assert_close(value, ref["weights"][name][: value.shape[0]], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_holds_no_hyperparameters_and_a_load_keeps_the_runs_own() -> None:
    """The optimizer's hyperparameters are configuration: a state dict leaves them out (they were 11 pickled
    entries per parameter), a load takes them from the run's optimizer, also over the stale ones an older
    checkpoint holds, and the next step is the same as the unbroken run's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    cfg, trained = _engine(1, {})
    for s in range(2):
        trained.step(rank_batches(s, cfg, 0, 1), cfg.optim.lr)
    state = trained.state_dict()
    assert state["optim"] and not [k for k in state["optim"] if k.startswith("param_groups.")]
    older = get_optimizer_state_dict(
        trained.model_parts[0], trained.optimizers[0], options=StateDictOptions(flatten_optimizer_state_dict=True)
    )

    def copy(v: Any) -> Any:  # what a load from disk gives: tensors of their own
        return v.clone() if isinstance(v, torch.Tensor) else v

    stale = {k: (0.5 if k.endswith(".eps") else copy(v)) for k, v in older.items()}
    assert any(k.endswith(".eps") for k in stale)
    _, resumed = _engine(1, {})
    resumed.load_state_dict({"model": {k: copy(v) for k, v in state["model"].items()}, "optim": stale})
    assert {g["eps"] for g in resumed.optimizers[0].param_groups} == {cfg.optim.eps}
    following = [e.step(rank_batches(2, cfg, 0, 1), cfg.optim.lr).loss for e in (trained, resumed)]
    assert following[0] == following[1]
    for (name, a), (_, b) in zip(trained.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


def _in_place(rank: int, world: int, overrides: dict[str, Any]) -> tuple[bool, bool]:
    from hpctrain.parallel.engine import _loaded_in_place

    cfg, engine = _engine(world, overrides)
    engine.step(rank_batches(0, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr)
    state = engine.state_dict()
    whole = _loaded_in_place(state, engine.model_parts, engine.optimizers)
    name = next(iter(state["optim"]))
    state["optim"][name] = state["optim"][name].clone()  # one tensor of its own: the setters must run
    return whole, _loaded_in_place(state, engine.model_parts, engine.optimizers)


@pytest.mark.parametrize(
    "world,overrides",
    [
        (1, {}),
        (2, {"zero__stage": 3}),
        (2, {**LLAMA, "parallel__tp": 2}),
        (2, {"parallel__pp": 2, "parallel__schedule": "interleaved_1f1b", "parallel__virtual_stages": 2, **PP}),
    ],
    ids=["one_process", "zero3", "llama_tp2", "pp2_interleaved"],
)
def test_a_state_loaded_in_place_is_not_set_again(world: int, overrides: dict[str, Any]) -> None:
    """`state_dict()`'s tensors are the rank's parameters and optimizer states themselves (FSDP2's shards, TP's
    DTensors, every virtual stage's): a checkpoint loaded into them needs no setter, which a resume skips; a
    state holding any tensor of its own goes through torch's setters. The resumes that end bit-identical to
    unbroken runs (`tests/checkpoint`) take the skipping path."""
    flags = run_distributed(_in_place, world, overrides, timeout=120) if world > 1 else [_in_place(0, 1, overrides)]
    assert all(whole and not cloned for whole, cloned in flags), flags


# ---- pipeline stage sizes (the plan's numbers) ----------------------------------------------------------------


def test_stage_param_counts_tiny_model_matches_engine() -> None:
    """The plan's closed-form counts (no torch) are what the engine's ranks hold."""
    from hpctrain.models.params import built_dims, padded_vocab, param_count
    from hpctrain.plan.report import stage_counts

    overrides = {
        "parallel__pp": 2,
        "parallel__tp": 2,
        "parallel__schedule": "interleaved_1f1b",
        "parallel__virtual_stages": 2,
        **PP,
    }
    cfg = make_cfg(4, **overrides)
    layout = resolve_layout(cfg)
    plan = stage_counts(cfg.model, layout)
    counts = plan["params_per_stage"]
    m = cfg.model
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple, 2)  # the embedding as built: 64 -> 128 rows for tp=2
    total = param_count(*built_dims(m), embedding_rows=rows)
    assert len(counts) == 4
    assert sum(counts) == total + rows * m.d_model, "the last stage holds a copy of the tied embedding"
    from tests.parallel.layouts import run_engine

    results = run_distributed(run_engine, 4, overrides, 1, timeout=120)
    per_rank = plan["params_per_gpu_before_zero"]
    # mesh (pp, dp_replicate, dp_shard, tp): ranks 0-1 are pipeline rank 0, ranks 2-3 pipeline rank 1
    assert [r["local_numel"] for r in results] == [per_rank[0], per_rank[0], per_rank[1], per_rank[1]]


def test_stage_param_counts_175b_on_meta() -> None:
    """The closed form for GPT-3 175B, against the model built on the meta device, stage by stage and shard."""
    from hpctrain.parallel.stages import meta_stage_counts
    from hpctrain.plan.report import stage_counts

    cfg = make_cfg(
        4096,
        model__n_layers=96,
        model__d_model=12288,
        model__n_heads=96,
        model__vocab_size=50257,
        model__context=2048,
        parallel__tp=8,
        parallel__pp=8,
        parallel__dp=64,
        cluster__nodes=512,
        cluster__gpus_per_node=8,
        train__global_batch=3072,
        train__micro_batch=4,
        data__vocab_size=50257,
    )
    layout = resolve_layout(cfg)
    started = time.perf_counter()
    plan = stage_counts(cfg.model, layout)
    assert time.perf_counter() - started < 0.1
    counts, per_rank = plan["params_per_stage"], plan["params_per_gpu_before_zero"]
    layer = 12 * 12288**2 + 13 * 12288
    assert counts[1:-1] == [12 * layer] * 6
    rows = 50688  # 50257 padded to a multiple of 64 x tp 8: the embedding as built on the GPUs
    assert counts[0] == 12 * layer + (rows + 2048) * 12288
    assert counts[-1] == 12 * layer + rows * 12288 + 2 * 12288
    assert 174e9 < sum(counts) - rows * 12288 < 176e9
    assert 2.6e9 < per_rank[1] < 2.8e9  # 12 layers of ~1.8e9 split 8 ways (LayerNorms and row biases whole)
    whole, shard = meta_stage_counts(cfg, (cfg.model.n_layers // 8,) * 8, 8)
    assert whole == counts and shard == per_rank  # 1F1B: one stage per pipeline rank


# ---- dims and harness ----------------------------------------------------------------------------------------


def test_parallel_dims_errors_say_what_to_change() -> None:
    """The layout's own rules live in hpctrain.config.layout; ParallelDims checks it against the processes."""
    from hpctrain.config.layout import Layout

    with pytest.raises(ParallelDimsError, match="product is the number of processes"):
        ParallelDims(Layout(dp=2, tp=2, pp=1), world_size=8)
    with pytest.raises(ValueError, match="virtual_stages=2 without pipeline"):
        Layout(dp=2, tp=1, pp=1, virtual_stages=2)
    dims = ParallelDims(Layout(dp=4, tp=2, pp=2, dp_replicate=2), world_size=16)
    assert (dims.dp, dims.n_stages, dims.distributed) == (4, 2, True)


def _dims_coordinates(rank: int, world: int) -> tuple[int, int, int]:
    from hpctrain.config.layout import Layout

    dims = ParallelDims(Layout(dp=2, tp=2, pp=2), world_size=world)
    return dims.pp_rank, dims.dp_rank, dims.tp_rank


def test_mesh_puts_tp_innermost_and_pp_outermost() -> None:
    coords = run_distributed(_dims_coordinates, 8, timeout=60)
    assert coords == [(pp, dp, tp) for pp in range(2) for dp in range(2) for tp in range(2)]


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_harness_reports_the_failing_ranks_traceback() -> None:
    with pytest.raises(DistributedTestError, match="rank one is unhappy"):
        run_distributed(_fails_on_rank_1, 2, timeout=60)


def _aborts_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        print("rank one's last words", file=sys.stderr, flush=True)
        os.abort()  # as a C++ exception thrown on a gloo thread ends a rank: SIGABRT, no Python traceback
    return rank


def test_harness_reports_a_crashed_ranks_stderr_and_stacks() -> None:
    """A rank killed by a signal reports nothing through the queue: its stderr and faulthandler's stacks are
    what tell a CI log why."""
    with pytest.warns(CrashedRankRetried, match="rank one's last words"), pytest.raises(DistributedTestError) as err:
        run_distributed(_aborts_on_rank_1, 2, timeout=60)  # killed twice: retried once, then it fails
    message = str(err.value)
    assert "rank(s) [1] died with exit codes [-6]" in message
    assert "rank one's last words" in message and "Fatal Python error: Aborted" in message
    assert "_aborts_on_rank_1" in message  # the Python stack of the aborting thread


def _sleeps(rank: int, world: int) -> None:
    time.sleep(60)


def test_harness_times_out_and_kills_its_children() -> None:
    started = time.perf_counter()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_sleeps, 2, timeout=3)
    assert time.perf_counter() - started < 30


def _build(rank: int, world: int, overrides: dict[str, Any]) -> None:
    _engine(world, overrides)


def test_zero_bubble_with_sharded_dp_is_refused_with_a_fix() -> None:
    overrides = {"parallel__pp": 2, "zero__stage": 3, "parallel__schedule": "zbv", "parallel__virtual_stages": 2, **PP}
    with pytest.raises(DistributedTestError, match="Use zero.stage=0"):
        run_distributed(_build, 4, overrides, timeout=60)
