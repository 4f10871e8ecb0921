"""Per-step efficiency figures for the progress line and the tracker: MFU and peak memory."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from hpctrain.plan.flops import model_flops_per_token
from hpctrain.plan.types import ModelShape, hardware


def flops_per_token(cfg: Any) -> float:
    """Model FLOPs per trained token: 6 N + 12 l s h (PaLM appendix B, no recomputation counted)."""
    m = cfg.model
    shape = ModelShape(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=cfg.train.seq_len,
                       vocab_size=m.vocab_size, ffn_hidden=m.ffn_mult * m.d_model)
    return model_flops_per_token(shape)


def mfu(cfg: Any, tokens_per_s: float, world_size: int) -> float:
    """Model FLOPs utilisation against the dense peak of cfg.cluster.gpu_type (hpctrain.plan.types)."""
    return tokens_per_s * flops_per_token(cfg) / (world_size * hardware(cfg.cluster.gpu_type).peak_flops)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: CUDA max allocated on a GPU, the resident set size (max RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
