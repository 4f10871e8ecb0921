"""FP8 through torchao (hpctrain/parallel/float8.py, docs/fp8.md), on CPU in torchao's emulation mode.

What converts (the blocks' Linears, not the embeddings or the head), torchao's float8 TP styles where they apply,
and numerics: a few training steps of the tiny GPT and Llama in FP8 against the same run in bf16.

Tolerance: each step's loss within 2e-3 relative of bf16's (FP8_RTOL). FP8 e4m3 keeps 3 mantissa bits (a relative
rounding step of 2^-4 per element), but with per-tensor (or per-row) scaling the errors of a GEMM's K products
are independent and partly cancel, and the loss averages over every token: measured here the FP8 losses stay
within 1.1e-4..3.4e-4 of bf16's over these steps (GPT, Llama, single process, FSDP2, TP), so 2e-3 leaves 6x room
for other CPUs' summation order while a broken scale (an unscaled cast saturates at 448 or flushes small values
to zero) moves the loss by far more. The losses must also differ from bf16's: the FP8 path really ran.

Not run here: TP with sequence parallelism under the tensorwise recipe. torchao's float8 TP styles all-gather
the activations already cast to FP8 (a float8_e4m3fn tensor), and gloo has no float8 dtype ("RuntimeError:
Invalid scalar type" in the all-gather); NCCL does. Its plan (which styles go where) is checked without a
process group, and TP+SP runs with the rowwise recipe, whose TP keeps torch's own styles.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from hpctrain.config.layout import resolve_layout
from hpctrain.models import create_model
from hpctrain.parallel.float8 import (
    apply_float8,
    converts,
    float8_config,
    float8_linears,
    float8_tp_plan,
    fp8_recipe,
    fsdp_float8_all_gather,
)
from hpctrain.parallel.tensor_parallel import block_plan
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import LLAMA, make_cfg, run_engine

FP8_RTOL = 2e-3
STEPS = 3
# 2 layers, 2 micro-batches of 2 per step on one rank (1 of 2 per DP rank with dp 2); Llama's MLP at 192 so that
# its TP shard (96) is a multiple of 16 too
SMALL = {"model__n_layers": 2, "train__global_batch": 4, "train__micro_batch": 2, "precision__dtype": "bf16"}
SMALL_LLAMA = {**SMALL, **LLAMA, "model__ffn_hidden": 192}
ARCHS = {"gpt": SMALL, "llama": SMALL_LLAMA}


def _meta_model(overrides: dict[str, Any], fp8: str, fsdp: bool = False) -> nn.Module:
    cfg = make_cfg(1, **{**overrides, "precision__fp8": fp8})
    with torch.device("meta"):
        model = create_model(cfg.model, 1)
    return apply_float8(model, cfg.precision, resolve_layout(cfg), torch.device("cpu"), fsdp)


@pytest.mark.parametrize("overrides", [SMALL, SMALL_LLAMA], ids=["gpt", "llama"])
def test_the_blocks_linears_convert_and_nothing_else(overrides: dict[str, Any]) -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_model(overrides, "tensorwise")
    linears = {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    in_blocks = {name for name in linears if name.startswith("layers.")}
    assert len(in_blocks) >= 2 * 4  # QKV, output projection and the MLP's (2 or 3) in each of 2 blocks
    assert all(linears[name] is Float8Linear for name in in_blocks)
    assert all(t is nn.Linear for name, t in linears.items() if name not in in_blocks)  # Llama's head stays
    assert not any(isinstance(m, Float8Linear) for m in (model.tok_emb,))
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in _meta_model(overrides, "none").named_parameters()}
    assert float8_linears(_meta_model(overrides, "none")) == []


def test_filter_skips_widths_fp8_gemms_cannot_take_and_the_head() -> None:
    with torch.device("meta"):
        assert converts(nn.Linear(64, 192), "layers.0.mlp.fc")
        assert not converts(nn.Linear(64, 200), "layers.0.mlp.fc")  # 200 is not a multiple of 16
        assert not converts(nn.Linear(64, 256), "output")
        assert not converts(nn.Embedding(256, 64), "layers.0.x")


def test_recipes_and_the_fsdp_float8_all_gather() -> None:
    from torchao.float8 import ScalingGranularity

    lay = resolve_layout(make_cfg(2, zero__stage=3))
    assert fsdp_float8_all_gather("tensorwise", lay, fsdp=True)
    assert not fsdp_float8_all_gather("rowwise", lay, fsdp=True)  # torchao: tensorwise weight scaling only
    assert not fsdp_float8_all_gather("tensorwise", resolve_layout(make_cfg(2)), fsdp=True)  # replicate: no gather
    rowwise = float8_config("rowwise", emulate=True, all_gather=False)
    assert rowwise.emulate and rowwise.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    assert float8_config("tensorwise", emulate=False, all_gather=True).enable_fsdp_float8_all_gather
    assert fp8_recipe(make_cfg(1).precision) is None
    with pytest.raises(ValueError, match="precision.fp8='delayed'"):
        fp8_recipe(make_cfg(1, precision__fp8="delayed").precision)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensorwise_blocks_take_torchaos_float8_tp_styles(sequence_parallel: bool) -> None:
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    block = _meta_model(SMALL, "tensorwise").layers["0"]
    plain = block_plan(sequence_parallel, "gpt")
    plan = float8_tp_plan(block, plain)
    assert set(plan) == set(plain)
    for name, style in plain.items():
        if isinstance(style, ColwiseParallel):
            assert type(plan[name]) is Float8ColwiseParallel and plan[name].use_local_output == style.use_local_output
        elif isinstance(style, RowwiseParallel):
            assert type(plan[name]) is Float8RowwiseParallel
            assert plan[name].output_layouts == style.output_layouts  # Shard(1) under SP: a reduce-scatter
        elif type(style) is PrepareModuleInput:  # SP: the input is cast to FP8 before the all-gather
            assert type(plan[name]) is PrepareFloat8ModuleInput
            assert plan[name].desired_input_layouts == style.desired_input_layouts
        else:
            assert plan[name] is style
    rowwise = float8_tp_plan(_meta_model(SMALL, "rowwise").layers["0"], plain)
    assert rowwise is plain  # rowwise scaling: torch's own styles (torchtitan does the same)


@functools.cache
def _bf16(arch: str) -> list[float]:
    """The bf16 reference losses of one process (computed once per arch for the whole module)."""
    return run_engine(0, 1, {**ARCHS[arch], "precision__fp8": "none"}, STEPS)["loss"]


def _losses(results: list[dict[str, Any]]) -> list[float]:
    return results[0]["loss"]


def _close(fp8: list[float], bf16: list[float]) -> None:
    assert len(fp8) == len(bf16) == STEPS
    for step, (a, b) in enumerate(zip(fp8, bf16)):
        assert abs(a - b) <= FP8_RTOL * abs(b), f"step {step}: FP8 loss {a} vs bf16 {b}"
    assert fp8 != bf16, "FP8 losses equal bf16's bit for bit: the FP8 path did not run"


@pytest.mark.parametrize("arch,recipe", [("gpt", "tensorwise"), ("gpt", "rowwise"), ("llama", "tensorwise")])
def test_fp8_losses_follow_bf16_in_one_process(arch: str, recipe: str) -> None:
    _close(run_engine(0, 1, {**ARCHS[arch], "precision__fp8": recipe}, STEPS)["loss"], _bf16(arch))


def _fsdp_fp8(rank: int, world: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3 with FP8 weights all-gathered: the sharded weights are torchao's float8 weight wrapper, and after
    the last step the hook has left each weight's scale, computed over the whole (all ranks') weight."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from hpctrain.parallel.engine import build_engine
    from tests.parallel.layouts import rank_batches

    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    losses = [
        engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr).loss for s in range(STEPS)
    ]
    linears = float8_linears(engine.model_parts[0])
    wrapped = [isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor) for m in linears]
    scales = []
    for m in linears:
        full = m.weight.full_tensor()
        expected = torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double().clamp(min=1e-12)
        scales.append((float(m.weight._local_tensor._precomputed_scale), float(expected)))
    model_state = engine.state_dict()["model"]  # what a checkpoint saves: the same names as without FP8
    return {
        "loss": losses,
        "wrapped": wrapped,
        "scales": scales,
        "state_keys": sorted(model_state),
        "names": sorted(n for n, _ in engine.model_parts[0].named_parameters()),
    }


@pytest.mark.parametrize(
    "zero", [{"zero__stage": 3}, {"zero__stage": 1, "train__micro_batch": 1}], ids=["zero3", "zero1_buffer"]
)
def test_fsdp2_float8_all_gather_follows_bf16(zero: dict[str, Any]) -> None:
    """ZeRO-3, and ZeRO-1 over 2 micro-batches a rank, whose fp32 gradient buffer is filled through hooks on
    torchao's float8 weight wrappers (hpctrain/parallel/grad_buffer.py)."""
    results = run_distributed(_fsdp_fp8, 2, {**SMALL, **zero, "precision__fp8": "tensorwise"}, timeout=240)
    for r in results:
        assert r["wrapped"] and all(r["wrapped"]), "FSDP2 shards are not torchao's float8 weight wrapper"
        for got, expected in r["scales"]:
            assert got == pytest.approx(expected, rel=1e-5), "the post-step hook's scale is not the whole weight's"
        assert r["state_keys"] == r["names"]
    assert results[0]["loss"] == results[1]["loss"]
    _close(results[0]["loss"], _bf16("gpt"))


def test_tensor_parallel_fp8_follows_bf16() -> None:
    """TP 2 on the Llama with the tensorwise recipe: torchao's float8 TP styles (no sequence parallelism, see
    the module docstring)."""
    tp = {**SMALL_LLAMA, "parallel__tp": 2, "precision__fp8": "tensorwise"}
    _close(_losses(run_distributed(run_engine, 2, tp, STEPS, timeout=240)), _bf16("llama"))


@pytest.mark.slow
def test_sequence_parallel_fp8_follows_bf16() -> None:
    """TP 2 + SP on the Llama with the rowwise recipe (torch's own TP styles around rowwise Float8Linears)."""
    sp = {**SMALL_LLAMA, "parallel__tp": 2, "parallel__sequence_parallel": True, "precision__fp8": "rowwise"}
    _close(_losses(run_distributed(run_engine, 2, sp, STEPS, timeout=240)), _bf16("llama"))
