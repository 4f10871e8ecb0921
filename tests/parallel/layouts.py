"""Shared pieces of the engine tests: tiny configs, fixed data, and the plain single-process reference."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf

from hpctrain.config.layout import resolve_layout
from hpctrain.config.schema import Config

SEQ = 16
VOCAB = 64
VALIDATION = 100  # validation batches are global_batch(VALIDATION + b): never trained on
EVAL_AFTER = (1,)  # steps (0-based) after which the engine evaluates, besides the last


# A tiny Llama of the same size: grouped-query attention (2 key/value heads for 4 query heads), SwiGLU
# (hidden 176 = 2.75 d), RoPE with Llama 3's base.
LLAMA = {"model__arch": "llama", "model__n_kv_heads": 2, "model__ffn_hidden": 176, "model__rope__theta": 500000.0}
# A tiny Qwen3: the Llama above with per-head query/key norms and heads of 32 (4 x 32 = 128 wide in a 64-wide model).
QWEN3 = {**LLAMA, "model__arch": "qwen3", "model__head_dim": 32}


def make_cfg(world: int, **overrides: Any) -> Any:
    """A tiny GPT (4 layers, d 64; **LLAMA: a Llama) on `world` processes; overrides are dotted keys, e.g.
    parallel__tp=2."""
    base = {
        "model": {"name": "test", "n_layers": 4, "d_model": 64, "n_heads": 4, "vocab_size": VOCAB, "context": 32},
        "cluster": {"name": "test", "nodes": 1, "gpus_per_node": world},
        "train": {"global_batch": 8, "micro_batch": 4, "seq_len": SEQ, "seed": 7, "max_steps": 5},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.1, "grad_clip": 1.0, "eps": 1e-4},
        "data": {"kind": "synthetic", "vocab_size": VOCAB},
    }
    dotted = OmegaConf.from_dotlist([f"{k.replace('__', '.')}={v}" for k, v in overrides.items()])
    return OmegaConf.merge(OmegaConf.structured(Config), base, dotted)


def global_batch(step: int, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch: fixed random tokens, inputs and shifted targets."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, VOCAB, (cfg.train.global_batch, SEQ + 1), generator=gen)
    return rows[:, :-1], rows[:, 1:]


def rank_batches(step: int, cfg: Any, dp_rank: int, dp: int) -> torch.Tensor:
    """This DP rank's slice of the global batch, cut into microbatches (as the training loop does):
    [2 (inputs, targets), microbatches, micro_batch, seq]."""
    x, y = global_batch(step, cfg)
    per = cfg.train.global_batch // dp
    x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
    return torch.stack([x, y]).reshape(2, -1, cfg.train.micro_batch, SEQ)


def run_engine(rank: int, world: int, overrides: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train `steps` steps through hpctrain's engine; return losses, norms and the full final weights."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    layout = resolve_layout(cfg)
    engine = build_engine(cfg, layout, torch.device("cpu"))
    stats, val_loss = [], []
    validation = [rank_batches(VALIDATION + b, cfg, engine.dp_rank, engine.dp_size) for b in range(2)]
    for s in range(steps):
        stats.append(engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr))
        if s in EVAL_AFTER or s == steps - 1:  # mid-run too: training must go on exactly after an evaluation
            val_loss.append(engine.evaluate(validation))
    weights: dict[str, torch.Tensor] = {}
    for part in engine.model_parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().clone() for k, v in sd.items()})
    return {
        "loss": [s.loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "skipped": [s.skipped for s in stats],
        "loss_scale": [s.loss_scale for s in stats],
        "val_loss": val_loss,
        "weights": weights,
        "modules": model_classes(engine.stage_models),
        "dp": (engine.dp_rank, engine.dp_size),
        "local_numel": sum(_local_numel(p) for m in engine.stage_models for p in m.parameters()),
    }


def _local_numel(p: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def model_classes(models: list[Any]) -> dict[str, str]:
    """Module name -> the model's own class (hpctrain.models or torch.nn) under any layout wrapper."""
    out = {}
    for model in models:
        for name, module in model.named_modules():
            own = next(
                c for c in type(module).__mro__ if c.__module__.startswith(("hpctrain.models", "torch.nn.modules"))
            )
            out[name] = f"{own.__module__}.{own.__qualname__}"
    return out


def reference(overrides: dict[str, Any], steps: int, world: int = 1) -> dict[str, Any]:
    """Plain PyTorch, one process, the whole global batch at once: what every layout must reproduce (the model
    of model.arch, built by build_model)."""
    from hpctrain.parallel.engine import build_model, build_optimizer, token_loss

    cfg = make_cfg(world, **overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.train.seed, torch.device("cpu"), cfg.parallel.tp)
    opt = build_optimizer(model.parameters(), cfg.optim)
    losses, norms, val_loss = [], [], []
    for s in range(steps):
        x, y = global_batch(s, cfg)
        loss = token_loss(model(x), y, cfg.model.vocab_size)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
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
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
