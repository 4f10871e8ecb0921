"""The Mixtral family's entry, and what the Mixture-of-Experts families share (Qwen3-MoE: qwen3_moe_spec.py):
torch-free; the module is hpctrain.models.moe_llama.

Each is its dense relative's block (Llama's for Mixtral, Qwen3's with per-head q/k norms for Qwen3-MoE) with the
SwiGLU MLP replaced by hpctrain.models.moe.MoE under the same name, `mlp`: a router `mlp.router` (E x h, kept in
fp32 for the routing) and E experts stacked in three parameters, `mlp.experts.w_gate`/`w_up` [E, f_e, h] and
`mlp.experts.w_down` [E, h, f_e] (f_e = model.moe.expert_hidden), plus optional shared experts `mlp.shared.*`.
Per block: the attention's parameters + E h + 3 E h f_e (+ 3 h f_s); each token runs top_k of the E experts, so
the active parameters count 3 top_k h f_e of them. Expert parallelism splits dim 0 of the expert weights; TP leaves
the MoE layer whole (each TP rank runs it on the full sequence; expert-tensor parallelism is not built).
Their Hugging Face counterparts are MixtralForCausalLM and Qwen3MoeForCausalLM (hpctrain.models.moe_hf).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hpctrain.models import llama_spec, moe_hf
from hpctrain.models.family import BlockActivations, Dims, ShapeProblem, Shapes

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

ROUTERS = ("softmax", "sigmoid")
EXPERT_WEIGHTS = {"mlp.experts.w_gate": 0, "mlp.experts.w_up": 0, "mlp.experts.w_down": 0}  # EP splits the experts


def moe_shapes(d: Dims) -> Shapes:
    """The MoE layer's parameters (names under `layers.<i>.`)."""
    h, e, f = d.d_model, d.n_experts, d.expert_hidden
    out: Shapes = {
        "mlp.router.weight": (e, h),
        "mlp.experts.w_gate": (e, f, h),
        "mlp.experts.w_up": (e, f, h),
        "mlp.experts.w_down": (e, h, f),
    }
    if d.n_shared_experts:
        fs = d.n_shared_experts * f
        out.update(
            {"mlp.shared.gate.weight": (fs, h), "mlp.shared.up.weight": (fs, h), "mlp.shared.proj.weight": (h, fs)}
        )
    return out


def with_moe(dense: Shapes, d: Dims) -> Shapes:
    return {**{k: v for k, v in dense.items() if not k.startswith("mlp.")}, **moe_shapes(d)}


def mixtral_block_shapes(d: Dims) -> Shapes:
    return with_moe(llama_spec.block_shapes(d), d)


def shape_problems(m: ModelConfig) -> list[ShapeProblem]:
    """Llama's rules, and the router's: experts to route to, top_k within them, groups that divide them."""
    out = llama_spec.shape_problems(m)
    moe = m.moe
    if moe.n_experts < 1:
        out.append(
            (
                "model.moe.n_experts",
                f"model.arch={m.arch} is a Mixture of Experts, but model.moe.n_experts={moe.n_experts}",
                "set model.moe.n_experts (Mixtral 8, Qwen3-MoE 128), or a dense arch (llama, qwen3)",
            )
        )
        return out
    if not 1 <= moe.top_k <= moe.n_experts:
        out.append(
            (
                "model.moe.top_k",
                f"each token must go through 1 to n_experts={moe.n_experts} experts, got top_k={moe.top_k}",
                f"set model.moe.top_k between 1 and {moe.n_experts}",
            )
        )
    if moe.router not in ROUTERS:
        out.append(("model.moe.router", f"unknown router {moe.router!r}", f"use one of {', '.join(ROUTERS)}"))
    if moe.n_groups < 1 or moe.n_experts % moe.n_groups or not 1 <= moe.topk_groups <= moe.n_groups:
        out.append(
            (
                "model.moe.n_groups",
                f"n_groups={moe.n_groups} must divide n_experts={moe.n_experts} and "
                f"topk_groups={moe.topk_groups} be between 1 and n_groups",
                "set model.moe.n_groups=1",
            )
        )
    elif moe.n_groups > 1 and (
        moe.router != "sigmoid"
        or moe.n_experts // moe.n_groups < 2
        or moe.top_k > moe.topk_groups * moe.n_experts // moe.n_groups
    ):
        out.append(
            (
                "model.moe.n_groups",
                "expert groups need the sigmoid router, at least 2 experts a group and "
                "top_k <= topk_groups x experts per group",
                "set model.moe.n_groups=1",
            )
        )
    if moe.capacity_factor < 0:
        out.append(
            (
                "model.moe.capacity_factor",
                f"must be >= 0 (0: dropless), got {moe.capacity_factor}",
                "set model.moe.capacity_factor=0",
            )
        )
    for key in ("balance_coef", "z_loss_coef"):
        if getattr(moe, key) < 0:
            out.append(
                (
                    f"model.moe.{key}",
                    f"a loss coefficient must be >= 0, got {getattr(moe, key)}",
                    f"set model.moe.{key}=0 to turn it off",
                )
            )
    if moe.expert_hidden < 0 or moe.n_shared_experts < 0:
        out.append(
            (
                "model.moe.expert_hidden",
                "expert sizes must be >= 0 (expert_hidden 0: model.ffn_hidden)",
                "set model.moe.expert_hidden and model.moe.n_shared_experts to non-negative values",
            )
        )
    return out


MOE_ACTIVATIONS = BlockActivations(gated_mlp=True, rope=True, norm_fp32_copy=True, moe=True)

MIXTRAL_FAMILY = replace(
    llama_spec.LLAMA_FAMILY,
    name="mixtral",
    summary="Mixtral: Llama's attention, a Mixture-of-Experts SwiGLU feed-forward (softmax top-k router)",
    builder="hpctrain.models.moe_llama:build_mixtral",
    block_shapes=mixtral_block_shapes,
    tp_dims={k: v for k, v in llama_spec.LLAMA_FAMILY.tp_dims.items() if not k.startswith("mlp.")},
    activations=MOE_ACTIVATIONS,
    shape_problems=shape_problems,
    hf=moe_hf.MIXTRAL_HF,
    ep_dims=EXPERT_WEIGHTS,
    tp_whole=("mlp",),
)
