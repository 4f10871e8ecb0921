"""Mixture-of-Experts layouts reproduce the single-process run: expert parallelism alone, with FSDP, TP, PP and
recomputation, the load-balancing loss and router z-loss on.

The reference (`moe_reference`) is plain PyTorch in one process that walks the global batch in the layouts'
micro-batches (the balancing loss is a per-micro-batch statistic: of the whole batch at once it would differ) and
adds each micro-batch's auxiliary losses through the layer's gradient hook, as the engine does. Bounds are the
dense layout suite's (tests/parallel/test_engine_layouts.py): fp32, 1e-5 relative on loss and gradient norm, the
final weights after 5 AdamW steps with eps 1e-4 within 1e-5 / 1e-6. The routing a step reports (tokens per expert
per layer, summed over the global batch) must equal the reference's exactly: it counts whole tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.distributed_harness import run_distributed
from tests.parallel.layouts import EVAL_AFTER, VALIDATION, global_batch, make_cfg, rank_batches

pytestmark = pytest.mark.usefixtures("gpu_rules")

STEPS = 5
# A tiny Qwen3-MoE: per-head q/k norms, 4 experts of hidden 32, top 2, both auxiliary losses on.
MOE = {
    "model__arch": "qwen3_moe",
    "model__n_kv_heads": 2,
    "model__head_dim": 32,
    "model__ffn_hidden": 32,
    "model__rope__theta": 500000.0,
    "model__moe__n_experts": 4,
    "model__moe__top_k": 2,
    "model__moe__balance_coef": 0.01,
    "model__moe__z_loss_coef": 0.001,
}
MIXTRAL = {**MOE, "model__arch": "mixtral", "model__head_dim": 0}
PP = {"train__micro_batch": 2}

# id -> (processes, overrides)
CASES = {
    "single": (1, {}),
    "accum4_single": (1, {"train__micro_batch": 2}),
    "dp2": (2, {}),
    "ep2": (2, {"parallel__ep": 2}),
    "ep2_accum": (2, {"parallel__ep": 2, "train__micro_batch": 2}),
    "ep2_zero3": (2, {"parallel__ep": 2, "zero__stage": 3, "train__micro_batch": 2}),
    "ep2_zero1": (2, {"parallel__ep": 2, "zero__stage": 1, "train__micro_batch": 2}),
    "ep2_fsdp4": (
        4,
        {"parallel__ep": 2, "zero__stage": 3, "train__micro_batch": 2},
    ),  # experts sharded by FSDP over the 2 ranks EP leaves
    "ep4": (4, {"parallel__ep": 4, "zero__stage": 2, "train__micro_batch": 2}),
    # experts that do not divide over the ranks sharding them: FSDP2 shards their rows (dim 1), not dim 0
    "ep2_fsdp4_dim1": (4, {"parallel__ep": 2, "model__moe__n_experts": 6, "zero__stage": 3, "train__micro_batch": 2}),
    "fsdp4_dim1": (4, {"model__moe__n_experts": 6, "zero__stage": 2, "train__micro_batch": 2}),
    "tp2_sp": (2, {"parallel__tp": 2, "parallel__sequence_parallel": True}),
    "ep2_tp2_sp": (4, {"parallel__ep": 2, "parallel__tp": 2, "parallel__sequence_parallel": True}),
    "ep2_tp2": (4, {"parallel__ep": 2, "parallel__tp": 2, "zero__stage": 3}),
    "pp2": (2, {"parallel__pp": 2, **PP}),
    "ep2_pp2": (4, {"parallel__ep": 2, "parallel__pp": 2, **PP}),
    "ep2_recompute_full": (2, {"parallel__ep": 2, "parallel__recompute": "full"}),
    # the selective policy reruns the all-to-alls (and waits on them), takes TP's collectives from its cache
    "ep2_recompute_selective": (2, {"parallel__ep": 2, "parallel__recompute": "selective"}),
    "tp2_sp_recompute_selective": (
        2,
        {"parallel__tp": 2, "parallel__sequence_parallel": True, "parallel__recompute": "selective"},
    ),
    "mixtral_ep2": (2, {**MIXTRAL, "parallel__ep": 2}),
}


def moe_reference(overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    """One process, the global batch in micro_batch-row micro-batches, the mean of their losses."""
    from hpctrain.models.common.moe import ROUTING_FIELDS, moe_layers
    from hpctrain.parallel.engine import build_model, build_optimizer, token_loss

    cfg = make_cfg(1, **{**MOE, **overrides})
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"))
    opt = build_optimizer(model.parameters(), cfg.optim)
    layers = moe_layers(model)
    losses, norms, val_loss, routing = [], [], [], []
    for s in range(steps):
        x, y = global_batch(s, cfg)
        chunks = list(zip(x.split(cfg.train.micro_batch), y.split(cfg.train.micro_batch)))
        total = 0.0
        for layer in layers.values():
            layer.aux_grad_scale = 1.0 / len(chunks)
        for xi, yi in chunks:
            loss = token_loss(model(xi), yi, cfg.model.vocab_size)
            (loss / len(chunks)).backward()
            total += loss.item() / len(chunks)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        routing.append([layer.take_routing()[:-ROUTING_FIELDS].tolist() for layer in layers.values()])
        if s in EVAL_AFTER or s == steps - 1:
            with torch.no_grad():
                val_loss.append(
                    sum(
                        token_loss(model(x), y, cfg.model.vocab_size).item()
                        for x, y in (global_batch(VALIDATION + b, cfg) for b in range(2))
                    )
                    / 2
                )
    return {
        "loss": losses,
        "grad_norm": norms,
        "val_loss": val_loss,
        "routing": routing,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def run_moe_engine(rank: int, world: int, overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **{**MOE, **overrides})
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    stats, val_loss = [], []
    validation = [rank_batches(VALIDATION + b, cfg, engine.dp_rank, engine.dp_size) for b in range(2)]
    for s in range(steps):
        stats.append(engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr))
        if s in EVAL_AFTER or s == steps - 1:
            val_loss.append(engine.evaluate(validation))
    experts = {
        name: (str(p.placements), p.to_local().numel(), p.numel())
        for part in engine.model_parts
        for name, p in part.named_parameters()
        if ".experts." in name and isinstance(p, DTensor)
    }
    weights: dict[str, torch.Tensor] = {}
    for part in engine.model_parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().clone() for k, v in sd.items()})
    return {
        "loss": [s.loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "val_loss": val_loss,
        "routing": [s.moe.tokens_per_expert for s in stats],
        "balance": [s.moe.balance_loss for s in stats],
        "weights": weights,
        "experts": experts,
    }


_REFERENCES: dict[tuple, dict] = {}


def _reference(overrides: dict[str, Any]) -> dict[str, Any]:
    model = {k: v for k, v in overrides.items() if k.startswith(("model__", "train__"))}
    key = tuple(sorted(model.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = moe_reference(model, STEPS)
    return _REFERENCES[key]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layout_matches_single_process(name: str) -> None:
    world, overrides = CASES[name]
    ref = _reference(overrides)
    results = run_distributed(run_moe_engine, world, overrides, STEPS, timeout=300)
    r = results[0]
    for other in results:
        assert other["loss"] == r["loss"] and other["grad_norm"] == r["grad_norm"]
        assert other["routing"] == r["routing"], "every rank reports the same routing"
    assert _rel(r["loss"], ref["loss"]) <= 1e-5, (r["loss"], ref["loss"])
    assert _rel(r["grad_norm"], ref["grad_norm"]) <= 1e-5, (r["grad_norm"], ref["grad_norm"])
    assert _rel(r["val_loss"], ref["val_loss"]) <= 1e-5, (r["val_loss"], ref["val_loss"])
    assert r["routing"] == ref["routing"]
    assert all(b > 0.9 for b in r["balance"])  # n_experts x sum f_e P_e: 1 when perfectly balanced, top_k-scaled
    weights: dict[str, torch.Tensor] = {}
    for res in results:
        weights.update(res["weights"])
    assert set(weights) == set(ref["weights"])
    for key, expected in ref["weights"].items():
        got = weights[key]
        if got.shape != expected.shape:
            assert key in ("tok_emb.weight", "output.weight") and not got[expected.shape[0] :].any(), key
            got = got[: expected.shape[0]]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    if name.endswith("_dim1"):  # each rank holds 1/world of every expert weight, no padding
        for res in results:
            for key, (placements, local, full) in res["experts"].items():
                assert "Shard(dim=1)" in placements and local * world == full, (key, placements, local, full)
