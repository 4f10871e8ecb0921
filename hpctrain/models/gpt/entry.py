"""The GPT family entry (GPT-2/3): torch-free (the login node plans with it); the module is
hpctrain.models.gpt.model.

Block, with h = d_model and f = the MLP's hidden size: LayerNorm (weight, bias), a fused head-major QKV 3h x h,
the projection h x h, a GELU MLP h -> f -> h, all with biases (12 h^2 + 13 h for f = 4h); learned positions;
the output head tied to the token embedding. Its Hugging Face counterpart is GPT2LMHeadModel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpctrain.models.family import BlockActivations, Dims, Family, HFSpec, ShapeProblem, Shapes, refuse

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig


def block_shapes(d: Dims) -> Shapes:
    h, f = d.d_model, d.ffn_hidden
    return {
        "norm1.weight": (h,),
        "norm1.bias": (h,),
        "attn.qkv.weight": (3 * h, h),
        "attn.qkv.bias": (3 * h,),
        "attn.proj.weight": (h, h),
        "attn.proj.bias": (h,),
        "norm2.weight": (h,),
        "norm2.bias": (h,),
        "mlp.fc.weight": (f, h),
        "mlp.fc.bias": (f,),
        "mlp.proj.weight": (h, f),
        "mlp.proj.bias": (h,),
    }


def top_shapes(d: Dims, rows: int) -> Shapes:
    h = d.d_model
    return {"tok_emb.weight": (rows, h), "pos_emb.weight": (d.context, h), "norm_f.weight": (h,), "norm_f.bias": (h,)}


def shape_problems(m: ModelConfig) -> list[ShapeProblem]:
    out: list[ShapeProblem] = []
    if m.n_kv_heads not in (0, m.n_heads):
        out.append(
            (
                "model.n_kv_heads",
                f"model.arch=gpt has multi-head attention only, got n_kv_heads={m.n_kv_heads} for n_heads={m.n_heads}",
                "set model.n_kv_heads=0, or model.arch=llama for grouped-query attention",
            )
        )
    if m.head_dim and m.head_dim * m.n_heads != m.d_model:
        out.append(
            (
                "model.head_dim",
                f"model.arch=gpt's heads split d_model: head_dim must be d_model / n_heads, "
                f"got {m.head_dim} for d_model={m.d_model} and n_heads={m.n_heads}",
                "set model.head_dim=0",
            )
        )
    return out


# ---------------------------------------------------------------- Hugging Face: GPT2LMHeadModel


def hf_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    refuse(
        {
            "activation_function": (hf.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
            "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
            "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        },
        "gpt2",
    )
    d = hf["n_embd"]
    return {
        "arch": "gpt",
        "n_layers": hf["n_layer"],
        "d_model": d,
        "n_heads": hf["n_head"],
        "ffn_hidden": hf.get("n_inner") or 4 * d,
        "vocab_size": hf["vocab_size"],
        "context": hf["n_positions"],
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
    }


def hf_config(m: ModelConfig, dtype: str) -> dict[str, Any]:
    d = Dims.of(m)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.context,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": d.ffn_hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "initializer_range": m.init_std,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def hf_compared(m: ModelConfig, theirs: Mapping[str, Any]) -> dict[str, Any]:
    return {"context": m.context}  # the position table's rows


def hf_weight_shapes(d: Dims) -> Shapes:
    h, f, v = d.d_model, d.ffn_hidden, d.vocab_size
    out: Shapes = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (d.context, h)}
    for i in range(d.n_layers):
        p = f"transformer.h.{i}."
        out.update(
            {
                f"{p}ln_1.weight": (h,),
                f"{p}ln_1.bias": (h,),
                f"{p}attn.c_attn.weight": (h, 3 * h),
                f"{p}attn.c_attn.bias": (3 * h,),
                f"{p}attn.c_proj.weight": (h, h),
                f"{p}attn.c_proj.bias": (h,),
                f"{p}ln_2.weight": (h,),
                f"{p}ln_2.bias": (h,),
                f"{p}mlp.c_fc.weight": (h, f),
                f"{p}mlp.c_fc.bias": (f,),
                f"{p}mlp.c_proj.weight": (f, h),
                f"{p}mlp.c_proj.bias": (h,),
            }
        )
    out.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
    return out


GPT_FAMILY = Family(
    name="gpt",
    summary="GPT-2/3: learned positions, LayerNorm, GELU MLP, tied embeddings",
    builder="hpctrain.models.gpt.model:build",
    tied_embeddings=True,
    grouped_query=False,
    block_shapes=block_shapes,
    top_shapes=top_shapes,
    tp_dims={
        "tok_emb.weight": 0,
        "attn.qkv.weight": 0,
        "attn.qkv.bias": 0,
        "attn.proj.weight": 1,
        "mlp.fc.weight": 0,
        "mlp.fc.bias": 0,
        "mlp.proj.weight": 1,
    },
    activations=BlockActivations(),
    shape_problems=shape_problems,
    hf=HFSpec(
        model_type="gpt2",
        class_name="GPT2LMHeadModel",
        base_prefix="transformer.",
        tied_default=True,
        fields=hf_fields,
        config=hf_config,
        compared=hf_compared,
        weight_shapes=hf_weight_shapes,
        recipes="hpctrain.models.gpt.model:hf_recipes",
        dropout={"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
        not_weights=(".attn.bias", ".attn.masked_bias"),
    ),  # the causal-mask buffers
    stage_modules={"pos_emb": "first", "tok_emb": "ends", "norm_f": "last"},
)
