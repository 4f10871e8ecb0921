"""The Qwen3 family entry (dense Qwen3): torch-free; the module is hpctrain.models.qwen3.model, Llama's with
`qk_norm`.

Qwen3 is Llama's block with an RMSNorm over each query and key head (head_dim wide, shared by the heads) before
RoPE, and a head width set apart from d_model / n_heads (128 at every size: Qwen3-4B's 32 heads are 4096 wide in a
2560-wide model). Its Hugging Face counterpart is Qwen3ForCausalLM; the smaller sizes tie the head to the
embedding there (hpctrain's head starts as a copy, as for Llama 3.2 1B).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpctrain.models.family import BlockActivations, Dims, Shapes, refuse
from hpctrain.models.llama import entry as llama_entry

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def block_shapes(d: Dims) -> Shapes:
    return {**llama_entry.block_shapes(d), "attn.norm_q.weight": (d.head_dim,), "attn.norm_k.weight": (d.head_dim,)}


def hf_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    refuse({"use_sliding_window": (hf.get("use_sliding_window", False), (False,))}, "qwen3")
    return llama_entry.hf_fields(hf, "qwen3")


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    config = llama_entry.hf_config(m, dtype)
    return {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}


def hf_weight_shapes(d: Dims) -> Shapes:
    out = llama_entry.hf_weight_shapes(d)
    for i in range(d.n_layers):
        p = f"model.layers.{i}.self_attn."
        out.update({f"{p}q_norm.weight": (d.head_dim,), f"{p}k_norm.weight": (d.head_dim,)})
    return out


QWEN3_FAMILY = replace(
    llama_entry.LLAMA_FAMILY,
    name="qwen3",
    summary="Qwen3: Llama's block with per-head RMSNorm on queries and keys, head_dim apart from d_model / n_heads",
    builder="hpctrain.models.qwen3.model:build",
    block_shapes=block_shapes,
    activations=BlockActivations(gated_mlp=True, rope=True, norm_fp32_copy=True, head_norms=True),
    tp_head_norms=("attn.norm_q", "attn.norm_k"),
    hf=replace(
        llama_entry.LLAMA_FAMILY.hf,
        model_type="qwen3",
        class_name="Qwen3ForCausalLM",
        fields=hf_fields,
        config=hf_config,
        weight_shapes=hf_weight_shapes,
        recipes="hpctrain.models.qwen3.model:hf_recipes",
    ),
)
