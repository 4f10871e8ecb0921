"""The Qwen3-MoE family's entry: Qwen3's attention (per-head q/k norms, head_dim apart from d_model / n_heads) with
the Mixture-of-Experts feed-forward of hpctrain.models.mixtral_spec. Torch-free; the module is
hpctrain.models.moe_llama. Its Hugging Face counterpart is Qwen3MoeForCausalLM.
"""

from __future__ import annotations

from dataclasses import replace

from hpctrain.models import moe_hf, qwen3_spec
from hpctrain.models.family import Dims, Shapes
from hpctrain.models.mixtral_spec import MIXTRAL_FAMILY, MOE_ACTIVATIONS, with_moe


def block_shapes(d: Dims) -> Shapes:
    return with_moe(qwen3_spec.block_shapes(d), d)


QWEN3_MOE_FAMILY = replace(
    MIXTRAL_FAMILY,
    name="qwen3_moe",
    summary="Qwen3-MoE: Qwen3's attention (per-head q/k norms), a Mixture-of-Experts SwiGLU feed-forward",
    builder="hpctrain.models.moe_llama:build_qwen3_moe",
    block_shapes=block_shapes,
    activations=replace(MOE_ACTIVATIONS, head_norms=True),
    tp_head_norms=qwen3_spec.QWEN3_FAMILY.tp_head_norms,
    hf=moe_hf.QWEN3_MOE_HF,
)
