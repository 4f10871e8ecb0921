"""The Qwen3-MoE family's torch module: Mixtral's (hpctrain.models.mixtral.model) with Qwen3's per-head query and
key norms, its builder and its Hugging Face tensor table (the entry, torch-free, is hpctrain.models.qwen3_moe.entry).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpctrain.models.common.recipes import Recipe, with_experts
from hpctrain.models.llama.model import llama_args
from hpctrain.models.mixtral.model import MoELlama, moe_args
from hpctrain.models.qwen3 import model as qwen3


def build(m: Any, tp: int = 1) -> MoELlama:
    """The family's builder (`Family.builder`): per-head query/key norms, as dense Qwen3."""
    return MoELlama(replace(llama_args(m, tp), qk_norm=True, family="qwen3_moe"), moe_args(m))


def hf_recipes(m: Any) -> dict[str, Recipe]:
    """Qwen3MoeForCausalLM: Qwen3's tensors; `mlp.gate` and experts' gate_proj, up_proj, down_proj."""
    return with_experts(qwen3.hf_recipes(m), m, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")
