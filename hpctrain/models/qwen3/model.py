"""The Qwen3 family's torch module: Llama's (hpctrain.models.llama.model) with an RMSNorm on each query and key
head, its builder and its Hugging Face tensor table (the entry, torch-free, is hpctrain.models.qwen3.entry)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpctrain.models.common.recipes import Recipe, same
from hpctrain.models.llama import model as llama


def build(m: Any, tp: int = 1) -> llama.Llama:
    """The family's builder (`Family.builder`): Llama's module with `qk_norm`."""
    return llama.Llama(replace(llama.llama_args(m, tp), qk_norm=True, family="qwen3"))


def hf_recipes(m: Any) -> dict[str, Recipe]:
    """Qwen3ForCausalLM: Llama's tensors plus each layer's per-head q_norm and k_norm."""
    out = llama.hf_recipes(m)
    for i in range(m.n_layers):
        out[f"layers.{i}.attn.norm_q.weight"] = same(f"model.layers.{i}.self_attn.q_norm.weight")
        out[f"layers.{i}.attn.norm_k.weight"] = same(f"model.layers.{i}.self_attn.k_norm.weight")
    return out
