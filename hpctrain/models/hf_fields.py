"""What a Hugging Face config.json stands for in hpctrain's model.* keys, and how it differs from a run's model.

Pure and torch-free: the login node's file checks (hpctrain/config/file_checks.py) and the task's import of
a Hugging Face directory (hpctrain/models/hf.py) compare through these same functions.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from hpctrain.models.params import arch_of, ffn_hidden_of, kv_heads_of


class HFMismatch(ValueError):
    """An HF model that does not fit the run's model config; the message names each key, both values, the fix."""


def model_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A ModelConfig-compatible dict (model.* keys) from an HF config.json; HFMismatch for what hpctrain's models
    cannot represent (another model type, activation, attention bias, RoPE scaling)."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        unsupported = {"activation_function": (hf.get("activation_function", "gelu_new"),
                                               ("gelu_new", "gelu_pytorch_tanh")),
                       "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
                       "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,))}
        _refuse(unsupported, "gpt2")
        d = hf["n_embd"]
        return {"arch": "gpt", "n_layers": hf["n_layer"], "d_model": d, "n_heads": hf["n_head"],
                "ffn_hidden": hf.get("n_inner") or 4 * d, "vocab_size": hf["vocab_size"],
                "context": hf["n_positions"], "norm_eps": hf.get("layer_norm_epsilon", 1e-5)}
    if kind == "llama":
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})  # transformers >= 5 keeps theta and scaling here
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        _refuse({"hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
                 "attention_bias": (hf.get("attention_bias", False), (False,)),
                 "mlp_bias": (hf.get("mlp_bias", False), (False,)),
                 "head_dim": (hf.get("head_dim") or d // heads, (d // heads,)),
                 "rope_scaling.rope_type": (rope_type, ("default", "llama3"))}, "llama")
        fields = {"arch": "llama", "n_layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads,
                  "n_kv_heads": hf.get("num_key_value_heads") or heads, "ffn_hidden": hf["intermediate_size"],
                  "vocab_size": hf["vocab_size"], "context": hf.get("max_position_embeddings", 2048),
                  "norm_eps": hf.get("rms_norm_eps", 1e-6), "rope": {"theta": float(theta), "scaling_factor": 0.0}}
        if rope_type == "llama3":
            fields["rope"].update(scaling_factor=float(scaling["factor"]),
                                  low_freq_factor=float(scaling["low_freq_factor"]),
                                  high_freq_factor=float(scaling["high_freq_factor"]),
                                  original_context=int(scaling["original_max_position_embeddings"]))
        return fields
    raise HFMismatch(f"model_type {kind!r}: hpctrain converts gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)")


def _refuse(values: dict[str, tuple[Any, tuple[Any, ...]]], kind: str) -> None:
    bad = [f"{k}={v!r} (hpctrain's model supports {', '.join(map(repr, ok))})"
           for k, (v, ok) in values.items() if v not in ok]
    if bad:
        raise HFMismatch(f"this {kind} model cannot be represented by hpctrain's: " + "; ".join(bad))


def config_mismatches(m: Any, hf: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(model.* key, the run's value, the HF model's value) for every field that differs. The context of a Llama
    is not compared: RoPE has no position table, and training at a shorter context than HF's maximum is usual."""
    theirs = model_fields(hf)
    ours: dict[str, Any] = {"arch": arch_of(m), "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                            "ffn_hidden": ffn_hidden_of(m), "vocab_size": m.vocab_size,
                            "norm_eps": m.norm_eps}
    if theirs["arch"] == "gpt":
        ours["context"] = m.context  # the position table's rows
    else:
        ours["n_kv_heads"] = kv_heads_of(m)
        ours["rope"] = {"theta": float(m.rope.theta), "scaling_factor": float(m.rope.scaling_factor)}
        if theirs["rope"]["scaling_factor"] > 0 and m.rope.scaling_factor > 0:
            ours["rope"].update(low_freq_factor=float(m.rope.low_freq_factor),
                                high_freq_factor=float(m.rope.high_freq_factor),
                                original_context=int(m.rope.original_context))
    flat = _flat(theirs)
    return [(f"model.{key}", value, flat.get(key)) for key, value in _flat(ours).items()
            if not _equal(value, flat.get(key))]


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return a == b
