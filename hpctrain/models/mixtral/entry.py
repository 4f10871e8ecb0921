"""The Mixtral family entry: Llama's attention, a Mixture-of-Experts SwiGLU feed-forward (what the MoE families
share: hpctrain.models.common.moe_entry). Torch-free; the module is hpctrain.models.mixtral.model. Its Hugging Face
counterpart is MixtralForCausalLM: Llama's config.json with the experts' keys, `block_sparse_moe.gate` (the router)
and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down) in its files; its router always renormalises its
top_k weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpctrain.models.common import moe_entry
from hpctrain.models.family import Dims, ShapeProblem, Shapes, refuse
from hpctrain.models.llama import entry as llama_entry

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def block_shapes(d: Dims) -> Shapes:
    return moe_entry.with_moe(llama_entry.block_shapes(d), d)


def shape_problems(m: ModelConfig) -> list[ShapeProblem]:
    """Llama's rules and the router's (`moe_entry.moe_problems`)."""
    return llama_entry.shape_problems(m) + moe_entry.moe_problems(m)


# ---------------------------------------------------------------- Hugging Face: MixtralForCausalLM


def hf_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Sliding-window attention is refused (hpctrain's attention is full causal); the router's jitter noise is
    a training setting transformers applies and hpctrain does not, so a checkpoint with it is still taken."""
    refuse({"sliding_window": (hf.get("sliding_window"), (None,))}, "mixtral")
    return moe_entry.moe_fields(
        hf,
        llama_entry.hf_fields(hf, "mixtral"),
        "llama",
        n_experts=moe_entry.n_experts(hf, 8),
        top_k=hf.get("num_experts_per_tok", 2),
        expert_hidden=hf["intermediate_size"],
        norm_topk_prob=True,
    )


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    moe_entry.exportable(m, "MixtralForCausalLM", (True,))
    d = Dims.of(m)
    dense = {k: v for k, v in llama_entry.hf_config(m, dtype).items() if k not in ("attention_bias", "mlp_bias")}
    return {
        **dense,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": d.expert_hidden,
        "num_local_experts": d.n_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        **moe_entry.router_config(m),
    }


def hf_compared(m: ModelConfig, theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's keys and the experts' (`moe_entry.moe_compared`)."""
    return {**llama_entry.hf_compared(m, theirs), **moe_entry.moe_compared(m)}


MIXTRAL_HF = replace(
    llama_entry.LLAMA_FAMILY.hf,
    model_type="mixtral",
    class_name="MixtralForCausalLM",
    fields=hf_fields,
    config=hf_config,
    compared=hf_compared,
    weight_shapes=moe_entry.expert_weight_shapes(
        llama_entry.hf_weight_shapes, "block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")
    ),
    recipes="hpctrain.models.mixtral.model:hf_recipes",
)

MIXTRAL_FAMILY = replace(
    llama_entry.LLAMA_FAMILY,
    name="mixtral",
    summary="Mixtral: Llama's attention, a Mixture-of-Experts SwiGLU feed-forward (softmax top-k router)",
    builder="hpctrain.models.mixtral.model:build",
    block_shapes=block_shapes,
    tp_dims={k: v for k, v in llama_entry.LLAMA_FAMILY.tp_dims.items() if not k.startswith("mlp.")},
    activations=moe_entry.MOE_ACTIVATIONS,
    shape_problems=shape_problems,
    hf=MIXTRAL_HF,
    ep_dims=moe_entry.EXPERT_WEIGHTS,
    tp_whole=("mlp",),
)
