"""Check moe (see tools/gpu_check.py): a tiny Qwen3-MoE (`model=moe_tiny`) through the public model and engine.

Five parts, each on this one device in a one-rank world ("cpu:gloo,cuda:nccl"; gloo with --cpu):
- bf16: the model under FSDP2's bf16 mixed precision on a one-rank mesh (bf16 weights in the experts' GEMMs, as
  every FSDP2 layout runs them): a forward and a backward, each under an op log. Where
  `hpctrain.models.common.moe.grouped_mm_serves` says the grouped GEMM serves these shapes (bf16 on an H100/H200/B200),
  `aten._grouped_mm` must have run in the forward and in the backward; its loss against an fp32 forward of the
  same weights.
- autocast: the engine on one rank, precision=bf16 (no FSDP2: fp32 weights, bf16 activations under autocast),
  one step under an op log: on a GPU where the grouped GEMM serves bf16 it must run here too (issue 45, S1: it
  fell back to a per-expert loop with a host sync per layer).
- capacity: model.moe.capacity_factor=0.5, two engine steps: assignments are dropped (StepStats.moe.dropped > 0)
  and the loss is finite.
- router bias: model.moe.router=sigmoid, two engine steps: each MoE layer's `expert_bias` moves, and equals an
  fp64 CPU replay of the update rule (bias += rate * sign(mean load - load)) on the step's reported loads.
- EP: the model with expert parallelism applied over a one-rank mesh (`hpctrain.parallel.expert_parallel.apply_ep`:
  the experts' all-to-all dispatch on the device group, NCCL on a GPU) against the same model without it, same
  weights and tokens: logits and gradients equal.
"""

from __future__ import annotations

from typing import Any

from .common import Ctx, Outcome, compose, expect, finite, free_port, init_world, one_rank_backend, small_overrides
from .control import synthetic_batches
from .probes import OpLog, grads_of, max_rel_error, one_rank_mesh

MODEL = "moe_tiny"
STEPS = 2
GROUPED_PROBE_ROWS = 16  # rows of the probe grouped_mm_serves is asked about (only shapes and dtypes matter)
LOSS_GAP = 0.02  # bf16 (FSDP2 mixed precision, autocast) against fp32 on the same weights and tokens: relative
BIAS_TOLERANCE = 1e-8  # the device's fp32 bias against the fp64 replay (multiples of the rate 1e-3, a few steps)
# EP over one rank against no EP: the same experts on the same rows. The forward is exact in practice; backward,
# on a GPU, flash attention's dq is accumulated with atomics in another order each run (bf16: a few ulps).
EP_TOLERANCE = {"logits": 1e-6, "grads_float32": 1e-6, "grads_bfloat16": 2e-2}


def _config(ctx: Ctx, name: str, extra: list[str] = ()) -> Any:
    from hpctrain.train.loop import load_config

    return load_config(
        compose(
            ctx,
            [
                *small_overrides(ctx, name, 1, STEPS, model=MODEL, precision_name="bf16"),
                "checkpoint=none",
                "health.preflight=off",
                *extra,
            ],
        )
    )


def _built(cfg: Any, device: Any, layout_fn: Any = None) -> Any:
    """create_model on meta, a layout applied there (`layout_fn(model)`), then the weights on `device`."""
    import torch

    from hpctrain.models import create_model

    with torch.device("meta"):
        model = create_model(cfg.model)
    if layout_fn is not None:
        layout_fn(model)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.train.seed)
    return model


def grouped_expected(ctx: Ctx, cfg: Any) -> bool:
    """Whether grouped_mm_serves bf16 rows and stacked expert weights of this model on this device."""
    import torch

    from hpctrain.models.common.moe import grouped_mm_serves

    d, h, e = cfg.model.d_model, cfg.model.moe.expert_hidden or cfg.model.ffn_hidden, cfg.model.moe.n_experts
    rows = torch.empty(GROUPED_PROBE_ROWS, d, dtype=torch.bfloat16, device=ctx.device)
    return grouped_mm_serves(rows, torch.empty(e, h, d, dtype=torch.bfloat16, device=ctx.device))


def _bf16_fsdp(ctx: Ctx, cfg: Any, x: Any, y: Any, expect_grouped: bool) -> dict[str, Any]:
    """FSDP2's bf16 mixed precision on a one-rank mesh: forward and backward under op logs, the loss against an
    fp32 forward of the same weights."""
    import torch

    from hpctrain.parallel.data_parallel import apply_fsdp
    from hpctrain.parallel.engine import token_loss

    mesh = one_rank_mesh(ctx.device, ("dp_shard",))
    model = _built(cfg, ctx.device, lambda m: apply_fsdp(m, mesh, cfg.zero, cfg.precision, zero_stage=2))
    with OpLog() as forward:
        loss = token_loss(model(x), y, cfg.model.vocab_size)
    with OpLog() as backward:
        loss.backward()
    grads = grads_of(model)
    expert_grads = [g for n, g in grads.items() if ".experts." in n]
    expect(
        bool(expert_grads) and all(g is not None and float(g.abs().sum()) > 0 for g in expert_grads),
        "bf16 (FSDP2): an expert weight got no gradient",
    )
    reference = _built(cfg, ctx.device)  # fp32, no layout: the same weights (drawn by name)
    with torch.no_grad():
        ref_loss = float(token_loss(reference(x), y, cfg.model.vocab_size))
    value = float(loss)
    gap = abs(value - ref_loss) / abs(ref_loss)
    expect(
        finite(value) and gap <= LOSS_GAP,
        f"bf16 (FSDP2): loss {value:.5f} vs fp32 {ref_loss:.5f} on the same weights (relative {gap:.3g} > {LOSS_GAP})",
    )
    ran = {"forward": forward.count("_grouped_mm"), "backward": backward.count("_grouped_mm")}
    if expect_grouped:
        expect(
            ran["forward"] > 0,
            "bf16 (FSDP2): torch._grouped_mm did not run in the forward although "
            "grouped_mm_serves says it serves (the experts ran a per-expert loop)",
        )
        expect(ran["backward"] > 0, "bf16 (FSDP2): torch._grouped_mm did not run in the backward")
    return {"loss": value, "fp32_loss": ref_loss, "gap": gap, "grouped_mm_calls": ran}


def _engine_steps(ctx: Ctx, cfg: Any, steps: int, log: OpLog | None = None) -> tuple[Any, list[Any], list[Any]]:
    """build_engine on this one-rank world and `steps` steps on fixed synthetic batches; the engine, the step
    stats and, after each step, every MoE layer's expert_bias (float64 CPU copies, None without a bias)."""
    import contextlib

    from hpctrain.config.layout import resolve_layout
    from hpctrain.models.common.moe import moe_layers
    from hpctrain.parallel.engine import build_engine

    layout = resolve_layout(cfg)
    engine = build_engine(cfg, layout, ctx.device)
    layers = moe_layers(engine.model_parts[0])
    batches = synthetic_batches(cfg, layout, cfg.train.seed, steps)
    stats, biases = (
        [],
        [{i: None if m.expert_bias is None else m.expert_bias.detach().double().cpu() for i, m in layers.items()}],
    )
    for batch in batches:
        with log if log is not None else contextlib.nullcontext():
            stats.append(engine.step(batch, cfg.optim.lr))
        biases.append(
            {i: None if m.expert_bias is None else m.expert_bias.detach().double().cpu() for i, m in layers.items()}
        )
    for s in stats:
        expect(finite(s.loss) and finite(s.grad_norm), f"engine step: loss {s.loss}, gradient norm {s.grad_norm}")
        expect(s.moe is not None, "the engine reported no routing statistics for an MoE model")
    return engine, stats, biases


def _bias_replay(cfg: Any, stats: list[Any], biases: list[dict[int, Any]]) -> float:
    """The largest difference between each layer's bias after each step and an fp64 CPU replay of the rule."""
    import torch

    rate = float(cfg.model.moe.bias_update_rate)
    worst = 0.0
    replay = {i: torch.zeros_like(b) for i, b in biases[0].items()}
    for step, s in enumerate(stats, 1):
        for i in replay:
            load = torch.tensor(s.moe.tokens_per_expert[i], dtype=torch.float64)
            replay[i] = replay[i] + rate * torch.sign(load.mean() - load)
            got = biases[step][i]
            expect(got is not None, f"layer {i}: no expert_bias with model.moe.router=sigmoid")
            worst = max(worst, float((got - replay[i]).abs().max()))
    return worst


def _ep_against_plain(ctx: Ctx, cfg: Any, x: Any, y: Any) -> dict[str, Any]:
    """Expert parallelism over a one-rank mesh against no EP: logits and every gradient (bf16 weights on a GPU,
    as FSDP2 gives the experts; fp32 on the CPU)."""
    import torch

    from hpctrain.models.common.moe import moe_layers
    from hpctrain.parallel.engine import token_loss
    from hpctrain.parallel.expert_parallel import apply_ep

    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    mesh = one_rank_mesh(ctx.device, ("ep",))
    results = {}
    for name, layout_fn in (("plain", None), ("ep", lambda m: apply_ep(m, mesh))):
        model = _built(cfg, ctx.device, layout_fn).to(dtype)
        if name == "ep":
            groups = {id(layer.experts.ep_group) for layer in moe_layers(model).values()}
            expect(
                len(groups) == 1 and None not in {layer.experts.ep_group for layer in moe_layers(model).values()},
                "apply_ep left an MoE layer without its EP group",
            )
        with OpLog() as log:
            logits = model(x)
            token_loss(logits, y, cfg.model.vocab_size).backward()
        results[name] = (logits.detach(), grads_of(model), log)
    (plain, plain_grads, _), (ep, ep_grads, ep_log) = results["plain"], results["ep"]
    expect(ep_log.ran("all_to_all_single"), "EP: no all-to-all ran: the experts did not dispatch over the EP group")
    logits_error = max_rel_error(ep, plain)
    grad_error = max(max_rel_error(ep_grads[n], g) for n, g in plain_grads.items() if g is not None)
    expect(sorted(ep_grads) == sorted(plain_grads), "EP: the parameters' names changed")
    grad_bound = EP_TOLERANCE[f"grads_{str(dtype).removeprefix('torch.')}"]
    expect(
        logits_error <= EP_TOLERANCE["logits"] and grad_error <= grad_bound,
        f"EP over one rank differs from no EP: logits {logits_error:.2e} (bound {EP_TOLERANCE['logits']:g}), "
        f"gradients {grad_error:.2e} (bound {grad_bound:g}), relative",
    )
    return {"dtype": str(dtype).removeprefix("torch."), "logits_error": logits_error, "grad_error": grad_error}


def check_moe(ctx: Ctx) -> Outcome:
    import torch

    backend = one_rank_backend(ctx)
    init_world(ctx, 0, 1, free_port(), backend)
    cfg = _config(ctx, "moe")
    from hpctrain.config.layout import resolve_layout

    batch = synthetic_batches(cfg, resolve_layout(cfg), cfg.train.seed, 1)[0]
    x, y = batch[0, 0].to(ctx.device), batch[1, 0].to(ctx.device)
    grouped = grouped_expected(ctx, cfg)

    bf16 = _bf16_fsdp(ctx, cfg, x, y, grouped)

    log = OpLog()
    _, stats, _ = _engine_steps(ctx, cfg, 1, log)
    auto = {"loss": stats[0].loss, "grouped_mm_calls": log.count("_grouped_mm")}
    if grouped:
        expect(
            auto["grouped_mm_calls"] > 0,
            "autocast (engine, precision=bf16, fp32 weights): the experts ran a "
            "per-expert loop, not torch._grouped_mm (issue 45 S1)",
        )

    _, capacity_stats, _ = _engine_steps(ctx, _config(ctx, "moe_capacity", ["model.moe.capacity_factor=0.5"]), STEPS)
    dropped = [s.moe.dropped for s in capacity_stats]
    expect(all(d > 0 for d in dropped), f"capacity_factor=0.5: assignments dropped per step {dropped}, expected > 0")

    sigmoid = _config(ctx, "moe_sigmoid", ["model.moe.router=sigmoid"])
    _, bias_stats, biases = _engine_steps(ctx, sigmoid, STEPS)
    moved = max(float(b.abs().max()) for b in biases[-1].values())
    expect(moved > 0, "router=sigmoid: expert_bias did not move after the steps")
    bias_error = _bias_replay(sigmoid, bias_stats, biases)
    expect(
        bias_error <= BIAS_TOLERANCE,
        f"router=sigmoid: expert_bias differs from the fp64 replay of the update "
        f"rule by {bias_error:.2e} (bound {BIAS_TOLERANCE:g})",
    )

    ep = _ep_against_plain(ctx, cfg, x, y)
    if not ctx.cpu:
        torch.cuda.synchronize()
    where = "grouped GEMM" if grouped else "per-expert loop (grouped_mm_serves: no)"
    numbers = {
        "backend": backend,
        "grouped_mm_serves": grouped,
        "bf16_fsdp": bf16,
        "autocast": auto,
        "capacity_dropped": dropped,
        "capacity_losses": [s.loss for s in capacity_stats],
        "bias_max": moved,
        "bias_error": bias_error,
        "ep": ep,
    }
    g = bf16["grouped_mm_calls"]
    return Outcome(
        True,
        f"bf16 {where}: _grouped_mm fwd {g['forward']} / bwd {g['backward']}, loss "
        f"{bf16['loss']:.4f} vs fp32 {bf16['fp32_loss']:.4f}; autocast _grouped_mm "
        f"{auto['grouped_mm_calls']}, loss {auto['loss']:.4f}; capacity 0.5 dropped "
        f"{'/'.join(f'{d:.0f}' for d in dropped)}; sigmoid bias |max| {moved:.0e}, replay error "
        f"{bias_error:.0e}; EP on 1-rank {backend.split(',')[-1]} ({ep['dtype']}) vs none: "
        f"logits {ep['logits_error']:.0e}, grads {ep['grad_error']:.0e}",
        numbers,
    )
