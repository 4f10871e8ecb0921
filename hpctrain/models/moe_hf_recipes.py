"""The Mixture-of-Experts families' weight tables (`Family.hf.recipes`, hpctrain.models.moe_hf): each weight of
hpctrain's Mixtral and Qwen3-MoE with the Hugging Face tensors it is made of.

The attention, norms, embedding and head are their dense relative's (hpctrain.models.llama). The router is HF's
`gate` as it is; each of hpctrain's stacked expert weights ([E, ...], one per projection) is the E per-expert
tensors the HF checkpoint holds, stacked along dim 0: exact, no arithmetic. transformers 5 fuses gate and up into
one `gate_up_proj` in memory only; its files, which these tables read and write, keep one tensor per expert.
"""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.models.family import Dims
from hpctrain.models.hf_recipes import Recipe, same
from hpctrain.models.llama import hf_recipes, qwen3_hf_recipes


def experts(names: list[str]) -> Recipe:
    """E per-expert HF tensors <-> one [E, ...] weight. The pieces are copies, not views of the stacked weight:
    safetensors refuses to save tensors that share memory."""
    return Recipe(tuple(names), torch.stack, lambda t: [x.clone() for x in t.unbind(0)])


def _with_experts(
    dense: dict[str, Recipe], m: Any, router: str, where: str, gate: str, up: str, down: str
) -> dict[str, Recipe]:
    """The dense table with each layer's MLP replaced, in its place (export writes the weights in this order), by
    its router `<layer>.<router>.weight` and experts `<layer>.<where>.<e>.<gate|up|down>.weight`."""
    n = Dims.of(m).n_experts
    out: dict[str, Recipe] = {}
    for name, recipe in dense.items():
        if ".mlp." not in name:
            out[name] = recipe
        elif name.endswith(".mlp.gate.weight"):
            ours, hf = name.removesuffix("gate.weight"), f"model.layers.{name.split('.')[1]}."

            def each(proj: str) -> list[str]:
                return [f"{hf}{where}.{e}.{proj}.weight" for e in range(n)]

            out.update(
                {
                    f"{ours}router.weight": same(f"{hf}{router}.weight"),
                    f"{ours}experts.w_gate": experts(each(gate)),
                    f"{ours}experts.w_up": experts(each(up)),
                    f"{ours}experts.w_down": experts(each(down)),
                }
            )
    return out


def mixtral_hf_recipes(m: Any) -> dict[str, Recipe]:
    """MixtralForCausalLM: Llama's tensors; `block_sparse_moe.gate` and experts' w1 (gate), w3 (up), w2 (down)."""
    return _with_experts(hf_recipes(m), m, "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")


def qwen3_moe_hf_recipes(m: Any) -> dict[str, Recipe]:
    """Qwen3MoeForCausalLM: Qwen3's tensors; `mlp.gate` and experts' gate_proj, up_proj, down_proj."""
    return _with_experts(qwen3_hf_recipes(m), m, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")
