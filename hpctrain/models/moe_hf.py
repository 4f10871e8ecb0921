"""The Mixture-of-Experts families' Hugging Face counterparts, MixtralForCausalLM and Qwen3MoeForCausalLM:
torch-free (the login node checks an HF directory with them); the weight tables are hpctrain.models.moe_hf_recipes.

Both are their dense relative's config.json (Llama's, Qwen3's) with the experts' keys added, and their checkpoints
hold each expert apart, as save_pretrained writes them (transformers 5 fuses the experts in memory only): Mixtral
`block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down), Qwen3-MoE
`mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`. Their routers are hpctrain's softmax router (no
groups, no scale, no shared experts), Mixtral's always renormalising its top_k weights. An MoE family's MLP width
is its experts' (intermediate_size for Mixtral, moe_intermediate_size for Qwen3-MoE), read into both model.ffn_hidden
and model.moe.expert_hidden and compared as the expert width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpctrain.models import llama_spec, qwen3_spec
from hpctrain.models.family import Dims, HFMismatch, Shapes, refuse

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def _moe_fields(
    hf: Mapping[str, Any],
    dense: dict[str, Any],
    dense_arch: str,
    *,
    n_experts: int,
    top_k: int,
    expert_hidden: int,
    norm_topk_prob: bool,
) -> dict[str, Any]:
    """The dense fields with the MLP width set to the experts' and model.moe filled in (the values are the HF
    class's, its defaults where config.json leaves a key out)."""
    if n_experts < 1:
        raise HFMismatch(
            f"this {dense['arch']} model has no experts (num_experts={n_experts}): a dense model is "
            f"model.arch={dense_arch}"
        )
    return {
        **dense,
        "ffn_hidden": expert_hidden,
        "moe": {
            "n_experts": n_experts,
            "top_k": top_k,
            "expert_hidden": expert_hidden,
            "n_shared_experts": 0,
            "router": "softmax",
            "norm_topk_prob": norm_topk_prob,
            "n_groups": 1,
            "topk_groups": 1,
            "route_scale": 1.0,
            "balance_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        },
    }


def _n_experts(hf: Mapping[str, Any], default: int) -> int:
    """transformers reads either key (its configs map num_experts to num_local_experts) and writes
    num_local_experts; the hub's Qwen3-MoE files say num_experts."""
    return hf.get("num_local_experts", hf.get("num_experts", default))


def mixtral_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Sliding-window attention is refused (hpctrain's attention is full causal); the router's jitter noise is
    a training setting transformers applies and hpctrain does not, so a checkpoint with it is still taken."""
    refuse({"sliding_window": (hf.get("sliding_window"), (None,))}, "mixtral")
    return _moe_fields(
        hf,
        llama_spec.hf_fields(hf, "mixtral"),
        "llama",
        n_experts=_n_experts(hf, 8),
        top_k=hf.get("num_experts_per_tok", 2),
        expert_hidden=hf["intermediate_size"],
        norm_topk_prob=True,
    )


def qwen3_moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
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
    dense = llama_spec.hf_fields({**hf, "intermediate_size": expert_hidden}, "qwen3_moe")
    return _moe_fields(
        hf,
        dense,
        "qwen3",
        n_experts=_n_experts(hf, 128),
        top_k=hf.get("num_experts_per_tok", 8),
        expert_hidden=expert_hidden,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def _exportable(m: ModelConfig, class_name: str, norm_topk_prob: tuple[bool, ...]) -> None:
    """HFMismatch naming each model.moe setting the HF class has no counterpart for (its router is the plain
    softmax one: no groups, no scale, no shared experts). capacity_factor, balance_coef and z_loss_coef shape
    training only: the model is HF's dropless forward whatever they were."""
    moe = m.moe
    wanted = {
        "router": (moe.router, ("softmax",)),
        "n_groups": (moe.n_groups, (1,)),
        "route_scale": (float(moe.route_scale), (1.0,)),
        "n_shared_experts": (moe.n_shared_experts, (0,)),
        "norm_topk_prob": (bool(moe.norm_topk_prob), norm_topk_prob),
    }
    bad = [
        f"model.moe.{k}={v!r} ({class_name} has only {', '.join(map(repr, ok))})"
        for k, (v, ok) in wanted.items()
        if v not in ok
    ]
    if bad:
        raise HFMismatch(f"this model cannot be written as {class_name}: " + "; ".join(bad))


def _router_config(m: ModelConfig) -> dict[str, Any]:
    return {
        "num_experts_per_tok": m.moe.top_k,
        "router_aux_loss_coef": m.moe.balance_coef,
        "output_router_logits": False,
    }


def mixtral_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    _exportable(m, "MixtralForCausalLM", (True,))
    d = Dims.of(m)
    dense = {k: v for k, v in llama_spec.hf_config(m, dtype).items() if k not in ("attention_bias", "mlp_bias")}
    return {
        **dense,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": d.expert_hidden,
        "num_local_experts": d.n_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        **_router_config(m),
    }


def qwen3_moe_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    _exportable(m, "Qwen3MoeForCausalLM", (True, False))
    d = Dims.of(m)
    return {
        **qwen3_spec.hf_config(m, dtype),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": d.expert_hidden,
        "num_experts": d.n_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": m.moe.norm_topk_prob,
        **_router_config(m),
    }


def compared(m: ModelConfig, theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's keys, the MLP width as the experts' and the router's settings; balance_coef is a training choice
    and is not compared."""
    d, moe = Dims.of(m), m.moe
    return {
        **llama_spec.hf_compared(m, theirs),
        "ffn_hidden": d.expert_hidden,
        "moe": {
            "n_experts": d.n_experts,
            "top_k": d.top_k,
            "expert_hidden": d.expert_hidden,
            "n_shared_experts": moe.n_shared_experts,
            "router": moe.router,
            "norm_topk_prob": moe.norm_topk_prob,
            "n_groups": moe.n_groups,
            "route_scale": float(moe.route_scale),
        },
    }


def _weight_shapes(
    dense: Callable[[Dims], Shapes], router: str, experts: str, names: tuple[str, str, str]
) -> Callable[[Dims], Shapes]:
    """The dense family's tensors with each layer's MLP replaced by the router `<layer>.<router>` [E, h] and
    expert e's gate, up and down (`names`) under `<layer>.<experts>.<e>.`."""

    def shapes(d: Dims) -> Shapes:
        h, f = d.d_model, d.expert_hidden
        out = {k: v for k, v in dense(d).items() if ".mlp." not in k}
        for i in range(d.n_layers):
            p = f"model.layers.{i}."
            out[f"{p}{router}.weight"] = (d.n_experts, h)
            for e in range(d.n_experts):
                gate, up, down = (f"{p}{experts}.{e}.{n}.weight" for n in names)
                out.update({gate: (f, h), up: (f, h), down: (h, f)})
        return out

    return shapes


MIXTRAL_HF = replace(
    llama_spec.LLAMA_FAMILY.hf,
    model_type="mixtral",
    class_name="MixtralForCausalLM",
    fields=mixtral_fields,
    config=mixtral_config,
    compared=compared,
    weight_shapes=_weight_shapes(
        llama_spec.hf_weight_shapes, "block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2")
    ),
    recipes="hpctrain.models.moe_hf_recipes:mixtral_hf_recipes",
)

QWEN3_MOE_HF = replace(
    llama_spec.LLAMA_FAMILY.hf,
    model_type="qwen3_moe",
    class_name="Qwen3MoeForCausalLM",
    fields=qwen3_moe_fields,
    config=qwen3_moe_config,
    compared=compared,
    weight_shapes=_weight_shapes(
        qwen3_spec.hf_weight_shapes, "mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")
    ),
    recipes="hpctrain.models.moe_hf_recipes:qwen3_moe_hf_recipes",
)
