"""Per-step efficiency figures for the progress line and the tracker: MFU and peak memory.

Task side: the FLOPs per token come from hpctrain.models.params and the peak from hpctrain.hardware (both
pure), not from the planner, so the training loop and the login-side plan do not depend on each other.
"""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

import torch

from hpctrain.config.cluster import cluster_hardware
from hpctrain.models.family import Dims
from hpctrain.models.params import model_active_param_count, model_flops_per_token

if TYPE_CHECKING:
    from hpctrain.config.schema import Config


def flops_per_token(cfg: Config) -> float:
    """Model FLOPs per trained token: 6 N + 12 l s h (PaLM appendix B, no recomputation counted), N the parameters
    a token goes through for the config's arch (a Mixture of Experts' active count: its top_k experts of each
    layer; GPT's position table counted at the trained length)."""
    m, seq_len = cfg.model, cfg.train.seq_len
    return model_flops_per_token(model_active_param_count(m, seq_len), m.n_layers, seq_len, Dims.of(m).q_dim)


def mfu(cfg: Config, tokens_per_s: float, world_size: int) -> float:
    """Model FLOPs utilisation against the dense peak of cfg.cluster.gpu_type (hpctrain.hardware), or the
    cluster's own (cluster.gpu_peak_tflops): the figure the plan's MFU used."""
    return tokens_per_s * flops_per_token(cfg) / (world_size * cluster_hardware(cfg.cluster).peak_flops)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: CUDA max allocated on a GPU, the resident set size (max RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The step's memory figures: the peak allocated (`peak_mem_gb`) and, on a GPU, what the caching allocator
    reserved at most (`peak_reserved_gb`: allocated plus its cache and fragmentation, what an out-of-memory
    compares with the device) and how often it had to free its cache and retry an allocation (`alloc_retries`,
    cumulative: a count that grows step after step is fragmentation close to an out-of-memory)."""
    metrics = {"peak_mem_gb": peak_memory_gb(device)}
    if device.type == "cuda":
        metrics["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        metrics["alloc_retries"] = float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    return metrics
