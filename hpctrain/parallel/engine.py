"""The engine: how one optimizer step runs on this rank, whatever the layout.

The training loop hands the engine this rank's microbatches and the step's learning rate; the engine owns
the wrapped model, the optimizer, gradient accumulation, clipping and the reductions that make the
reported loss the mean over the global batch. The loop stays the same for every layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hpctrain.config.layout import Layout
from hpctrain.models.gpt import GPT, GPTArgs


@dataclass
class StepStats:
    loss: float  # mean token loss over the global batch
    grad_norm: float  # global gradient norm before clipping
    skipped: bool = False


def gpt_args(cfg: Any) -> GPTArgs:
    m = cfg.model
    return GPTArgs(
        n_layers=m.n_layers,
        d_model=m.d_model,
        n_heads=m.n_heads,
        vocab_size=m.vocab_size,
        seq_len=m.context,
        ffn_hidden=m.ffn_mult * m.d_model,
        dropout=m.dropout,
        init_std=m.init_std,
    )


def build_model(cfg: Any, device: torch.device) -> GPT:
    """Build on the meta device, then materialise: no full copy is ever allocated before the layout."""
    with torch.device("meta"):
        model = GPT(gpt_args(cfg))
    model.to_empty(device=device)
    model.init_weights(seed=cfg.train.seed)
    return model


def build_optimizer(params: list[nn.Parameter] | Any, cfg: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (biases and LayerNorm gains are not decayed)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.betas[0], o.betas[1]),
        eps=o.eps,
    )


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class DataParallelEngine:
    """ZeRO-0: DDP with bucketed all-reduce overlapped with backward; no sync on inner microbatches."""

    def __init__(self, cfg: Any, layout: Layout, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        model = build_model(cfg, device)
        self.distributed = dist.is_initialized() and layout.dp > 1
        if self.distributed:
            model = nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=cfg.zero.reduce_bucket_size / 2**20, gradient_as_bucket_view=True
            )
        self.model = model
        self.optimizer = build_optimizer(model.parameters(), cfg)
        self.dp_rank = dist.get_rank() if self.distributed else 0
        self.dp_size = layout.dp

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name, the same in every layout (DCP reshards)."""
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        return {
            "model": get_model_state_dict(self.model, options=opts),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=opts)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepStats:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or not self.distributed else self.model.no_sync()
            with sync:
                loss = token_loss(self.model(x.to(self.device)), y.to(self.device)) / len(batches)
                loss.backward()
            total += loss.detach()
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.distributed:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return StepStats(loss=total.item(), grad_norm=float(grad_norm))


def build_engine(cfg: Any, layout: Layout, device: torch.device) -> DataParallelEngine:
    if (layout.tp, layout.pp, layout.zero_stage) != (1, 1, 0):
        raise NotImplementedError(
            f"layout tp={layout.tp} pp={layout.pp} zero.stage={layout.zero_stage} needs the parallel engine"
        )
    return DataParallelEngine(cfg, layout, device)
