"""The Mixtral family's torch module, which Qwen3-MoE's reuses (hpctrain.models.qwen3_moe.model): Llama's
(hpctrain.models.llama.model) with each block's `mlp` a hpctrain.models.common.moe.MoE, its builder and its Hugging
Face tensor table (the entry, torch-free, is hpctrain.models.mixtral.entry). Knows nothing of parallelism (expert
parallelism is applied from outside, as TP is).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from hpctrain.models.common.moe import MoE, MoEArgs, moe_layers
from hpctrain.models.common.recipes import Recipe, with_experts
from hpctrain.models.llama.model import Llama, LlamaArgs, llama_args
from hpctrain.models.llama.model import hf_recipes as llama_hf_recipes


def moe_args(m: Any) -> MoEArgs:
    """The MoE layer arguments of a config's `model` section (model.moe; expert_hidden 0: model.ffn_hidden)."""
    e = m.moe
    return MoEArgs(
        d_model=m.d_model,
        expert_hidden=e.expert_hidden or llama_args(m).ffn_hidden,
        n_experts=e.n_experts,
        top_k=e.top_k,
        router=str(e.router),
        norm_topk_prob=bool(e.norm_topk_prob),
        n_groups=e.n_groups,
        topk_groups=e.topk_groups,
        route_scale=float(e.route_scale),
        n_shared_experts=e.n_shared_experts,
        capacity_factor=float(e.capacity_factor),
        bias_update_rate=float(e.bias_update_rate),
        balance_coef=float(e.balance_coef),
        z_loss_coef=float(e.z_loss_coef),
    )


class MoELlama(Llama):
    """Llama (or Qwen3, with qk_norm) whose blocks route each token to top_k of n_experts SwiGLU experts."""

    def __init__(self, args: LlamaArgs, moe: MoEArgs) -> None:
        super().__init__(args, mlp=lambda: MoE(moe))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Llama's initialisation by name (the experts' w_down as a residual projection), and the sigmoid router's
        bias at zero (a buffer: to_empty leaves it unset)."""
        super().init_weights(seed)
        for layer in moe_layers(self).values():
            if layer.expert_bias is not None:
                layer.expert_bias.zero_()


def build(m: Any, tp: int = 1) -> MoELlama:
    """The family's builder (`Family.builder`)."""
    return MoELlama(replace(llama_args(m, tp), family="mixtral"), moe_args(m))


def hf_recipes(m: Any) -> dict[str, Recipe]:
    """MixtralForCausalLM: Llama's tensors; `block_sparse_moe.gate` and experts' w1 (gate), w3 (up), w2 (down)."""
    return with_experts(llama_hf_recipes(m), m, "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")
