"""The Qwen3-MoE family entry: Qwen3's attention (per-head q/k norms, head_dim apart from d_model / n_heads) with
Mixtral's Mixture-of-Experts feed-forward (hpctrain.models.mixtral.entry). Torch-free; the module is
hpctrain.models.qwen3_moe.model. Its Hugging Face counterpart is Qwen3MoeForCausalLM: Qwen3's config.json with the
experts' keys, `mlp.gate` (the router) and `mlp.experts.{e}.gate_proj/up_proj/down_proj` in its files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpctrain.models.common import moe_entry
from hpctrain.models.family import Dims, Shapes, refuse
from hpctrain.models.llama import entry as llama_entry
from hpctrain.models.mixtral import entry as mixtral_entry
from hpctrain.models.qwen3 import entry as qwen3_entry

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def block_shapes(d: Dims) -> Shapes:
    return moe_entry.with_moe(qwen3_entry.block_shapes(d), d)


# ---------------------------------------------------------------- Hugging Face: Qwen3MoeForCausalLM


def hf_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer must be an MoE layer (hpctrain's blocks are all alike): no dense `mlp_only_layers`, a
    decoder_sparse_step of 1; the dense intermediate_size, which only those layers use, is not read."""
    refuse(
        {
            "use_sliding_window": (hf.get("use_sliding_window", False), (False,)),
            "mlp_only_layers": (list(hf.get("mlp_only_layers") or []), ([],)),
            "decoder_sparse_step": (hf.get("decoder_sparse_step", 1), (1,)),
        },
        "qwen3_moe",
    )
    expert_hidden = hf.get("moe_intermediate_size", 768)
    dense = llama_entry.hf_fields({**hf, "intermediate_size": expert_hidden}, "qwen3_moe")
    return moe_entry.moe_fields(
        hf,
        dense,
        "qwen3",
        n_experts=moe_entry.n_experts(hf, 128),
        top_k=hf.get("num_experts_per_tok", 8),
        expert_hidden=expert_hidden,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    moe_entry.exportable(m, "Qwen3MoeForCausalLM", (True, False))
    d = Dims.of(m)
    return {
        **qwen3_entry.hf_config(m, dtype),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": d.expert_hidden,
        "num_experts": d.n_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": m.moe.norm_topk_prob,
        **moe_entry.router_config(m),
    }


QWEN3_MOE_HF = replace(
    mixtral_entry.MIXTRAL_HF,
    model_type="qwen3_moe",
    class_name="Qwen3MoeForCausalLM",
    fields=hf_fields,
    config=hf_config,
    weight_shapes=moe_entry.expert_weight_shapes(
        qwen3_entry.hf_weight_shapes, "mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")
    ),
    recipes="hpctrain.models.qwen3_moe.model:hf_recipes",
)

QWEN3_MOE_FAMILY = replace(
    mixtral_entry.MIXTRAL_FAMILY,
    name="qwen3_moe",
    summary="Qwen3-MoE: Qwen3's attention (per-head q/k norms), a Mixture-of-Experts SwiGLU feed-forward",
    builder="hpctrain.models.qwen3_moe.model:build",
    block_shapes=block_shapes,
    activations=replace(moe_entry.MOE_ACTIVATIONS, head_norms=True),
    tp_head_norms=qwen3_entry.QWEN3_FAMILY.tp_head_norms,
    hf=QWEN3_MOE_HF,
)
