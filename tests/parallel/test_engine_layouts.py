"""Numerical acceptance: every layout reproduces a plain single-process run of the same global batch.

Each case trains a tiny GPT or Llama (4 layers, d 64, fp32) for 5 steps on forked gloo ranks and compares, step by
step, the loss and the (pre-clipping) global gradient norm with `reference()` (plain PyTorch, whole global
batch at once, stock clip_grad_norm_), then the final weights, and the validation loss (forward only, evaluated
mid-run and at the end). Clipping is active (max norm 1.0, the first steps' norms are ~2.3), so the clipped update
is checked too.

Bounds: fp32 losses and norms within 1e-5 relative (measured ~1e-7, summation order only). The weights are
compared after 5 AdamW steps with optim.eps = 1e-4 (tests/parallel/layouts.py): with the usual 1e-8 Adam's
first update is lr * sign(g), and gradient entries of ~1e-9 that round differently flip sign, a 2 lr change
that says nothing about the layout; with eps 1e-4 the update is a smooth function of the gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_distributed
from tests.parallel.layouts import LLAMA, QWEN3, make_cfg, model_classes, reference, run_engine

pytestmark = pytest.mark.usefixtures("gpu_rules")  # each rank fails where a GPU run would (tests/gpu_rules.py)

STEPS = 5
PP = {"train__micro_batch": 2}  # grad_accum >= pp: 2 microbatches of 2 per DP rank

# id -> (processes, config overrides, expected dp)
LAYOUTS = {
    "single": (1, {}, 1),
    "accum4_single": (1, {"train__micro_batch": 2}, 1),
    "dp2": (2, {}, 2),
    "dp2_accum4": (2, {"train__global_batch": 16, "train__micro_batch": 2}, 2),
    # ZeRO with 2 micro-batches: ZeRO-1 reduce-scatters once, ZeRO-2/3 in each (zero.accumulate_unsharded: once)
    "zero1_dp2": (2, {"zero__stage": 1, "train__micro_batch": 2}, 2),
    "zero2_dp2": (2, {"zero__stage": 2, "train__micro_batch": 2}, 2),
    "zero3_dp2": (2, {"zero__stage": 3, "train__micro_batch": 2}, 2),
    "zero3_dp2_accumulate_unsharded": (
        2,
        {"zero__stage": 3, "zero__accumulate_unsharded": True, "train__micro_batch": 2},
        2,
    ),
    "hsdp_2x2": (4, {"zero__stage": 3, "parallel__dp_replicate": 2, "train__micro_batch": 2}, 4),
    "zero3_offload": (2, {"zero__stage": 3, "zero__offload_optimizer": True, "zero__offload_params": True}, 2),
    "zero2_offload": (2, {"zero__stage": 2, "zero__offload_optimizer": True}, 2),
    "tp2": (2, {"parallel__tp": 2}, 1),
    "tp2_sp": (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}, 1),
    "pp2_gpipe": (2, {"parallel__pp": 2, "parallel__schedule": "gpipe", **PP}, 1),
    "pp2_1f1b": (2, {"parallel__pp": 2, "parallel__schedule": "1f1b", **PP}, 1),
    # uneven stages: 3 + 5 layers; interleaved, 1 + 3 + 3 + 1 (the first and last chunk lighter)
    "pp2_uneven": (2, {"model__n_layers": 8, "parallel__pp": 2, "parallel__first_stage_layers": 3, **PP}, 1),
    "pp2_interleaved_uneven": (
        2,
        {
            "model__n_layers": 8,
            "parallel__pp": 2,
            "parallel__schedule": "interleaved_1f1b",
            "parallel__virtual_stages": 2,
            "parallel__first_stage_layers": 1,
            "parallel__last_stage_layers": 1,
            **PP,
        },
        1,
    ),
    "pp2_interleaved": (
        2,
        {"parallel__pp": 2, "parallel__schedule": "interleaved_1f1b", "parallel__virtual_stages": 2, **PP},
        1,
    ),
    "pp2_looped_bfs": (
        2,
        {"parallel__pp": 2, "parallel__schedule": "looped_bfs", "parallel__virtual_stages": 2, **PP},
        1,
    ),
    "pp2_zero_bubble": (
        2,
        {"parallel__pp": 2, "parallel__schedule": "interleaved_zero_bubble", "parallel__virtual_stages": 2, **PP},
        1,
    ),
    "pp2_zbv": (2, {"parallel__pp": 2, "parallel__schedule": "zbv", "parallel__virtual_stages": 2, **PP}, 1),
    "pp2_dualpipev": (
        2,
        {"parallel__pp": 2, "parallel__schedule": "dualpipev", "parallel__virtual_stages": 2, **PP},
        1,
    ),
    "pp4_1f1b": (4, {"parallel__pp": 4, **PP}, 1),  # tied embedding summed between pipeline ranks 0 and 3
    "dp2xtp2": (4, {"parallel__tp": 2}, 2),
    "zero1_dp2xtp2": (4, {"parallel__tp": 2, "zero__stage": 1}, 2),
    "zero3_dp2xtp2_sp": (4, {"parallel__tp": 2, "zero__stage": 3, "parallel__sequence_parallel": True}, 2),
    "dp2xpp2": (4, {"parallel__pp": 2, **PP}, 2),
    "zero3_dp2xpp2_interleaved": (
        4,
        {
            "parallel__pp": 2,
            "zero__stage": 3,
            "parallel__schedule": "interleaved_1f1b",
            "parallel__virtual_stages": 2,
            **PP,
        },
        2,
    ),
    "dp2xpp2_zbv": (4, {"parallel__pp": 2, "parallel__schedule": "zbv", "parallel__virtual_stages": 2, **PP}, 2),
    "tp2xpp2": (4, {"parallel__pp": 2, "parallel__tp": 2, **PP}, 1),
    "tp2xpp2_sp_zbv": (
        4,
        {
            "parallel__pp": 2,
            "parallel__tp": 2,
            "parallel__sequence_parallel": True,
            "parallel__schedule": "zbv",
            "parallel__virtual_stages": 2,
            **PP,
        },
        1,
    ),
    "dp2xtp2xpp2": (8, {"parallel__pp": 2, "parallel__tp": 2, **PP}, 2),
    "zero3_dp2xtp2xpp2_sp": (
        8,
        {"parallel__pp": 2, "parallel__tp": 2, "zero__stage": 3, "parallel__sequence_parallel": True, **PP},
        2,
    ),
    "recompute_full_dp2": (2, {"parallel__recompute": "full"}, 2),
    "recompute_selective_zero3": (2, {"parallel__recompute": "selective", "zero__stage": 3}, 2),
    "recompute_selective_tp2_sp": (
        2,
        {"parallel__recompute": "selective", "parallel__tp": 2, "parallel__sequence_parallel": True},
        1,
    ),
    "recompute_full_tp2xpp2": (4, {"parallel__recompute": "full", "parallel__tp": 2, "parallel__pp": 2, **PP}, 1),
    # context parallelism: each sequence in 2 x cp chunks, keys and values gathered over the CP group
    "cp2": (2, {"parallel__cp": 2}, 1),
    "cp4": (4, {"parallel__cp": 4}, 1),
    "dp2xcp2": (4, {"parallel__cp": 2}, 2),  # DDP over the 4 ranks of DP x CP
    "zero3_dp2xcp2": (4, {"parallel__cp": 2, "zero__stage": 3, "train__micro_batch": 2}, 2),  # FSDP over dp_shard x cp
    "cp2xtp2_sp": (4, {"parallel__cp": 2, "parallel__tp": 2, "parallel__sequence_parallel": True}, 1),
    "cp2xpp2": (4, {"parallel__cp": 2, "parallel__pp": 2, **PP}, 1),
    "recompute_selective_cp2": (2, {"parallel__cp": 2, "parallel__recompute": "selective"}, 1),
    "recompute_full_zero2_cp2": (2, {"parallel__cp": 2, "parallel__recompute": "full", "zero__stage": 2}, 1),
}
# The Llama family through the same layouts: grouped-query attention split over TP (one key/value head per rank),
# the untied head split by vocabulary like the embedding, and held by the last pipeline stage alone.
LLAMA_LAYOUTS = [
    "single",
    "dp2",
    "zero1_dp2",
    "zero2_dp2",
    "zero3_dp2",
    "zero3_offload",
    "tp2",
    "tp2_sp",
    "pp2_1f1b",
    "pp2_uneven",
    "pp2_interleaved",
    "pp2_zbv",
    "dp2xtp2",
    "dp2xpp2",
    "tp2xpp2",
    "zero3_dp2xtp2xpp2_sp",
    "recompute_full_dp2",
    "recompute_selective_tp2_sp",
    "cp2",
    "zero3_dp2xcp2",
    "cp2xtp2_sp",
    "cp2xpp2",
]
LAYOUTS.update(
    {f"llama_{name}": (LAYOUTS[name][0], {**LLAMA, **LAYOUTS[name][1]}, LAYOUTS[name][2]) for name in LLAMA_LAYOUTS}
)
# Qwen3: heads wider than d_model / n_heads split over TP (QKV and the projection's input are 2 x 128 wide), the
# per-head norms replicated, under SP and in a pipeline.
QWEN3_LAYOUTS = ["single", "tp2_sp", "zero3_dp2", "tp2xpp2"]
LAYOUTS.update(
    {f"qwen3_{name}": (LAYOUTS[name][0], {**QWEN3, **LAYOUTS[name][1]}, LAYOUTS[name][2]) for name in QWEN3_LAYOUTS}
)

# uneven stages: the layers of each pipeline rank (interleaved: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3)
UNEVEN = {
    "pp2_uneven": [[0, 1, 2], [3, 4, 5, 6, 7]],
    "llama_pp2_uneven": [[0, 1, 2], [3, 4, 5, 6, 7]],
    "pp2_interleaved_uneven": [[0, 4, 5, 6], [1, 2, 3, 7]],
}
_REFERENCES: dict[tuple, dict] = {}


def _reference(overrides: dict, world: int) -> dict:
    key = (world, tuple(sorted(overrides.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(overrides, STEPS, world)
    return _REFERENCES[key]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


_MODULES: dict[tuple, dict[str, str]] = {}


def _single_process_modules(overrides: dict) -> dict[str, str]:
    """Module name -> class of the single-process model of the overrides' model."""
    from hpctrain.parallel.engine import build_model

    model = {k: v for k, v in overrides.items() if k.startswith("model__")}
    key = tuple(sorted(model.items()))
    if key not in _MODULES:
        cfg = make_cfg(1, **model)
        _MODULES[key] = model_classes([build_model(cfg.model, cfg.train.seed, torch.device("cpu"))])
    return _MODULES[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name: str) -> None:
    world, overrides, dp = LAYOUTS[name]
    ref = _reference(overrides, world)
    results = run_distributed(run_engine, world, overrides, STEPS, timeout=240)

    for rank, r in enumerate(results):
        assert r["dp"][1] == dp, f"rank {rank}: dp_size {r['dp'][1]}, expected {dp}"
        assert r["loss"] == results[0]["loss"], "every rank must report the same global loss"
        assert r["grad_norm"] == results[0]["grad_norm"], "every rank must report the same gradient norm"
    assert sorted({r["dp"] for r in results}) == [(i, dp) for i in range(dp)], "DP coordinates must cover 0..dp-1"
    assert _rel(results[0]["loss"], ref["loss"]) <= 1e-5, (results[0]["loss"], ref["loss"])
    assert _rel(results[0]["grad_norm"], ref["grad_norm"]) <= 1e-5, (results[0]["grad_norm"], ref["grad_norm"])
    # The validation loss: forward only, averaged over DP ranks, the same on every rank, mid-run and at the end.
    assert all(r["val_loss"] == results[0]["val_loss"] for r in results)
    assert _rel(results[0]["val_loss"], ref["val_loss"]) <= 1e-5, (results[0]["val_loss"], ref["val_loss"])

    if name in UNEVEN:  # the layers each pipeline rank holds
        held = [sorted({int(k.split(".")[1]) for k in r["weights"] if k.startswith("layers.")}) for r in results]
        assert held == UNEVEN[name], held
    weights: dict[str, torch.Tensor] = {}
    for r in results:  # pipeline ranks each hold their stages' weights
        weights.update(r["weights"])
    assert set(weights) == set(ref["weights"])
    for key, expected in ref["weights"].items():
        got = weights[key]
        if got.shape != expected.shape:  # TP pads the vocabulary to 64 x tp rows: the padding stays zero
            assert key in ("tok_emb.weight", "output.weight") and not got[expected.shape[0] :].any(), key
            got = got[: expected.shape[0]]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")

    # The layout is applied from outside: every module keeps the single-process model's class and name.
    single_process_modules = _single_process_modules(overrides)
    for r in results:
        for module, cls in r["modules"].items():
            assert single_process_modules[module] == cls, (module, cls)


MIXED = {
    # id -> (processes, overrides, loss bound, norm bound)
    "bf16_dp2_autocast": (2, {"precision__dtype": "bf16"}, 2e-3, 2e-2),
    "bf16_zero3_mp_policy": (2, {"precision__dtype": "bf16", "zero__stage": 3}, 2e-3, 2e-2),
    "bf16_tp2_sp": (
        2,
        {"precision__dtype": "bf16", "parallel__tp": 2, "parallel__sequence_parallel": True},
        2e-3,
        2e-2,
    ),
    "llama_bf16_tp2_sp": (
        2,
        {**LLAMA, "precision__dtype": "bf16", "parallel__tp": 2, "parallel__sequence_parallel": True},
        2e-3,
        2e-2,
    ),
    "llama_bf16_zero3_mp_policy": (2, {**LLAMA, "precision__dtype": "bf16", "zero__stage": 3}, 2e-3, 2e-2),
    # 4 micro-batches a rank: ZeRO-1's fp32 gradient buffer filled as each gradient is made (grad_buffer), the
    # tied head's gradient through a leaf of its own
    "bf16_zero1_buffer": (2, {"precision__dtype": "bf16", "zero__stage": 1, "train__micro_batch": 1}, 2e-3, 2e-2),
    "llama_bf16_zero1_buffer": (
        2,
        {**LLAMA, "precision__dtype": "bf16", "zero__stage": 1, "train__micro_batch": 1},
        2e-3,
        2e-2,
    ),
    "bf16_zero3_accumulate_unsharded_buffer": (
        2,
        {"precision__dtype": "bf16", "zero__stage": 3, "zero__accumulate_unsharded": True, "train__micro_batch": 1},
        2e-3,
        2e-2,
    ),
    "bf16_zero1_tp2_buffer": (
        4,
        {"precision__dtype": "bf16", "zero__stage": 1, "parallel__tp": 2, "train__micro_batch": 1},
        2e-3,
        2e-2,
    ),
    "fp16_dp2": (2, {"precision__dtype": "fp16", "precision__loss_scaling": True}, 5e-4, 5e-3),
    "fp16_zero3": (2, {"precision__dtype": "fp16", "precision__loss_scaling": True, "zero__stage": 3}, 5e-4, 5e-3),
    "fp16_tp2xpp2": (
        4,
        {"precision__dtype": "fp16", "precision__loss_scaling": True, "parallel__tp": 2, "parallel__pp": 2, **PP},
        5e-4,
        5e-3,
    ),
}


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_precision_close_to_fp32(name: str) -> None:
    """bf16/fp16 compute against the fp32 reference, with looser bounds: bf16 keeps 8 mantissa bits (relative
    rounding 2^-9 ~ 2e-3 per op), fp16 11 (~5e-4); the loss averages many such errors, the norm less so.
    Measured: bf16 loss ~1e-4 / norm ~1e-3, fp16 loss ~5e-6 / norm ~1e-4."""
    world, overrides, loss_bound, norm_bound = MIXED[name]
    fp32 = {k: v for k, v in overrides.items() if not k.startswith("precision")}
    ref = _reference(fp32, world)
    results = run_distributed(run_engine, world, overrides, STEPS, timeout=240)
    r = results[0]
    assert all(x["loss"] == r["loss"] for x in results)
    assert not any(r["skipped"]), r["loss_scale"]
    assert _rel(r["loss"], ref["loss"]) <= loss_bound, (r["loss"], ref["loss"])
    assert _rel(r["grad_norm"], ref["grad_norm"]) <= norm_bound, (r["grad_norm"], ref["grad_norm"])
