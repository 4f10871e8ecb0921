"""The Llama family entry (Llama 2/3): torch-free (the login node plans with it); the module is
hpctrain.models.llama.model.

Block, with h = d_model, f = the MLP's hidden size and k = n_kv_heads x head_dim (the width of K and V): RMSNorm
(weight only), a fused QKV (h + 2k) x h ordered by key/value group (grouped-query attention: k < h), the
projection h x h, a SwiGLU MLP (gate and up, f x h each, and down h x f), no biases: 2 h^2 + 2 h k + 3 h f + 2 h;
RoPE (no position table); an untied output head. Its Hugging Face counterpart is LlamaForCausalLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpctrain.models.family import BlockActivations, Dims, Family, HFSpec, ShapeProblem, Shapes, refuse

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def block_shapes(d: Dims) -> Shapes:
    h, f, q, k = d.d_model, d.ffn_hidden, d.q_dim, d.kv_dim
    return {
        "norm1.weight": (h,),
        "attn.qkv.weight": (q + 2 * k, h),
        "attn.proj.weight": (h, q),
        "norm2.weight": (h,),
        "mlp.gate.weight": (f, h),
        "mlp.up.weight": (f, h),
        "mlp.proj.weight": (h, f),
    }


def top_shapes(d: Dims, rows: int) -> Shapes:
    return {"tok_emb.weight": (rows, d.d_model), "norm_f.weight": (d.d_model,), "output.weight": (rows, d.d_model)}


def shape_problems(m: ModelConfig) -> list[ShapeProblem]:
    out: list[ShapeProblem] = []
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads >= 1 and (kv < 1 or m.n_heads % kv):
        out.append(
            (
                "model.n_kv_heads",
                f"model.n_heads={m.n_heads} is not divisible by n_kv_heads={kv}: each "
                "key/value head serves a whole group of query heads",
                f"use an n_kv_heads that divides {m.n_heads} (0: as many as query heads)",
            )
        )
    head_dim = m.head_dim or (m.d_model // m.n_heads if m.n_heads >= 1 and m.d_model % m.n_heads == 0 else 0)
    if head_dim % 2:
        key = "model.head_dim" if m.head_dim else "model.d_model"
        out.append(
            (
                key,
                f"the head dimension {head_dim} is odd: RoPE rotates pairs of dimensions",
                "set an even model.head_dim"
                if m.head_dim
                else "choose d_model and n_heads with an even d_model / n_heads",
            )
        )
    if m.dropout:
        out.append(
            (
                "model.dropout",
                f"model.arch=llama has no dropout (Llama 2/3 train without), got {m.dropout}",
                "set model.dropout=0.0",
            )
        )
    return out


# ---------------------------------------------------------------- Hugging Face: LlamaForCausalLM


def hf_fields(hf: Mapping[str, Any], model_type: str = "llama") -> dict[str, Any]:
    """config.json -> model.* keys for this module (Llama's, and Qwen3's whose config names the same fields)."""
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps theta and scaling here
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling: Mapping[str, Any] = hf.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else {}
    )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    refuse(
        {
            "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
            "attention_bias": (hf.get("attention_bias", False), (False,)),
            "mlp_bias": (hf.get("mlp_bias", False), (False,)),
            "rope_scaling.rope_type": (rope_type, ("default", "llama3")),
        },
        model_type,
    )
    fields = {
        "arch": model_type,
        "n_layers": hf["num_hidden_layers"],
        "d_model": d,
        "n_heads": heads,
        "head_dim": hf.get("head_dim") or d // heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "context": hf.get("max_position_embeddings", 2048),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope": {"theta": float(theta), "scaling_factor": 0.0},
    }
    if rope_type == "llama3":
        fields["rope"].update(
            scaling_factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_context=int(scaling["original_max_position_embeddings"]),
        )
    return fields


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    d, r = Dims.of(m), m.rope
    scaling = (
        None
        if r.scaling_factor <= 0
        else {
            "rope_type": "llama3",
            "factor": r.scaling_factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_context,
        }
    )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": d.ffn_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.context,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": r.theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "attention_dropout": m.dropout,
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def hf_compared(m: ModelConfig, theirs: Mapping[str, Any]) -> dict[str, Any]:
    """The context is not compared: RoPE has no position table, and training at a shorter context than HF's
    maximum is usual."""
    ours: dict[str, Any] = {
        "n_kv_heads": Dims.of(m).kv_heads,
        "head_dim": Dims.of(m).head_dim,
        "rope": {"theta": float(m.rope.theta), "scaling_factor": float(m.rope.scaling_factor)},
    }
    if theirs["rope"]["scaling_factor"] > 0 and m.rope.scaling_factor > 0:
        ours["rope"].update(
            low_freq_factor=float(m.rope.low_freq_factor),
            high_freq_factor=float(m.rope.high_freq_factor),
            original_context=int(m.rope.original_context),
        )
    return ours


def hf_weight_shapes(d: Dims) -> Shapes:
    h, f, v = d.d_model, d.ffn_hidden, d.vocab_size
    out: Shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(d.n_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                f"{p}input_layernorm.weight": (h,),
                f"{p}self_attn.q_proj.weight": (d.q_dim, h),
                f"{p}self_attn.k_proj.weight": (d.kv_dim, h),
                f"{p}self_attn.v_proj.weight": (d.kv_dim, h),
                f"{p}self_attn.o_proj.weight": (h, d.q_dim),
                f"{p}post_attention_layernorm.weight": (h,),
                f"{p}mlp.gate_proj.weight": (f, h),
                f"{p}mlp.up_proj.weight": (f, h),
                f"{p}mlp.down_proj.weight": (h, f),
            }
        )
    out.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return out


LLAMA_FAMILY = Family(
    name="llama",
    summary="Llama 2/3: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, untied embeddings",
    builder="hpctrain.models.llama.model:build",
    tied_embeddings=False,
    grouped_query=True,
    block_shapes=block_shapes,
    top_shapes=top_shapes,
    tp_dims={
        "tok_emb.weight": 0,
        "output.weight": 0,
        "attn.qkv.weight": 0,
        "attn.proj.weight": 1,
        "mlp.gate.weight": 0,
        "mlp.up.weight": 0,
        "mlp.proj.weight": 1,
    },
    activations=BlockActivations(gated_mlp=True, rope=True, norm_fp32_copy=True),
    shape_problems=shape_problems,
    hf=HFSpec(
        model_type="llama",
        class_name="LlamaForCausalLM",
        base_prefix="model.",
        tied_default=False,
        fields=hf_fields,
        config=hf_config,
        compared=hf_compared,
        weight_shapes=hf_weight_shapes,
        recipes="hpctrain.models.llama.model:hf_recipes",
        dropout={"attention_dropout": 0.0},
        not_weights=("rotary_emb.inv_freq",),
    ),  # saved by older transformers, recomputed
    stage_modules={"tok_emb": "first", "norm_f": "last", "output": "last"},
)
