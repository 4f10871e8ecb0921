"""hpctrain weights <-> Hugging Face transformers weights (GPT2LMHeadModel, LlamaForCausalLM): tensors and configs
only, no files (hpctrain.checkpoint.hf reads and writes them).

What differs, and why each conversion is exact (a permutation, transposition or split; no arithmetic):
- GPT-2: HF's Conv1D stores weights transposed ([in, out]); its fused c_attn is [q | k | v] blocks, hpctrain's
  qkv is head-major ([h0: q k v][h1: q k v]...) so a TP column split keeps whole heads.
- Llama: hpctrain fuses q, k and v into one qkv weight ordered by key/value group (the group's query heads, its
  key head, its value head), which keeps a TP shard self-contained; gate, up and down are HF's gate_proj, up_proj
  and down_proj as they are. RoPE follows HF's rotate_half convention: q and k need no permutation.
- Vocabulary: hpctrain pads the embedding (and Llama's head) with zero rows for TP; HF files hold the
  tokenizer's vocabulary only. Export drops the padding, import adds it back as zeros.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from hpctrain.models.hf_fields import HFMismatch, config_mismatches
from hpctrain.models.params import (
    arch_of,
    block_shapes,
    ffn_hidden_of,
    kv_dim_of,
    kv_heads_of,
    tied_of,
    top_shapes,
)

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
VOCAB_ROWS = ("tok_emb.weight", "output.weight")  # the tensors whose rows are the (padded) vocabulary
# HF state-dict entries that are not weights: GPT-2's causal-mask buffers and Llama's RoPE frequencies
# (saved by older transformers versions), recomputed by both models.
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
# Special token ids belong to the tokenizer, which a model config does not name: left unset, not HF's defaults
# (GPT2Config's 50256 and LlamaConfig's 1 and 2 are wrong for other vocabularies, Llama 3's included).
NO_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": None}
# An HF config's dropout probabilities, with transformers' defaults (GPT2Config's 0.1, LlamaConfig's 0.0): hpctrain
# has one, model.dropout, on attention, residual and embedding alike.
HF_DROPOUT = {"gpt2": {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1},
              "llama": {"attention_dropout": 0.0}}

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Recipe:
    """How one hpctrain tensor is made of HF tensors (join) and back (split)."""

    hf_names: tuple[str, ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(name: str) -> Recipe:
    return Recipe((name,), lambda ts: ts[0], lambda t: [t])


def _transposed(name: str) -> Recipe:
    """GPT-2's Conv1D: the weight is stored [in, out]."""
    return Recipe((name,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


def _vocab(name: str, vocab_size: int) -> Recipe:
    """The padding rows are dropped on the way out; `from_hf` adds them back."""
    return Recipe((name,), lambda ts: ts[0], lambda t: [t[:vocab_size]])


def _gpt2_qkv(name: str, n_heads: int, head_dim: int, bias: bool) -> Recipe:
    """c_attn's [q | k | v] columns <-> hpctrain's head-major rows."""
    tail = () if bias else (-1,)

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0] if bias else ts[0].t()  # [3d(, d)]: blocks q, k, v, each heads x head_dim
        return w.reshape(3, n_heads, head_dim, *tail).transpose(0, 1).reshape(w.shape).contiguous()

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        w = t.reshape(n_heads, 3, head_dim, *tail).transpose(0, 1).reshape(t.shape)
        return [w.contiguous() if bias else w.t().contiguous()]

    return Recipe((name,), join, split)


def _llama_qkv(prefix: str, n_heads: int, n_kv: int, head_dim: int) -> Recipe:
    """q_proj, k_proj, v_proj <-> one weight ordered by key/value group: q heads g*r..g*r+r-1, k head g, v head g."""
    r = n_heads // n_kv

    def join(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        d = q.shape[1]
        return torch.cat([q.reshape(n_kv, r, head_dim, d), k.reshape(n_kv, 1, head_dim, d),
                          v.reshape(n_kv, 1, head_dim, d)], dim=1).reshape(-1, d)

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        groups = t.reshape(n_kv, r + 2, head_dim, t.shape[1])
        return [groups[:, :r].reshape(-1, t.shape[1]).contiguous(), groups[:, r].reshape(-1, t.shape[1]).contiguous(),
                groups[:, r + 1].reshape(-1, t.shape[1]).contiguous()]

    return Recipe((f"{prefix}q_proj.weight", f"{prefix}k_proj.weight", f"{prefix}v_proj.weight"), join, split)


def recipes(m: ModelConfig) -> dict[str, Recipe]:
    """Every hpctrain weight of the config's model, with the HF tensors it corresponds to."""
    arch, head_dim = arch_of(m), m.d_model // m.n_heads
    out: dict[str, Recipe] = {}
    if arch == "gpt":
        out["tok_emb.weight"] = _vocab("transformer.wte.weight", m.vocab_size)
        out["pos_emb.weight"] = _same("transformer.wpe.weight")
        for i in range(m.n_layers):
            ours, hf = f"layers.{i}.", f"transformer.h.{i}."
            for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
                out[f"{ours}{norm}.weight"] = _same(f"{hf}{ln}.weight")
                out[f"{ours}{norm}.bias"] = _same(f"{hf}{ln}.bias")
            out[f"{ours}attn.qkv.weight"] = _gpt2_qkv(f"{hf}attn.c_attn.weight", m.n_heads, head_dim, bias=False)
            out[f"{ours}attn.qkv.bias"] = _gpt2_qkv(f"{hf}attn.c_attn.bias", m.n_heads, head_dim, bias=True)
            for module, hf_module in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                out[f"{ours}{module}.weight"] = _transposed(f"{hf}{hf_module}.weight")
                out[f"{ours}{module}.bias"] = _same(f"{hf}{hf_module}.bias")
        out["norm_f.weight"] = _same("transformer.ln_f.weight")
        out["norm_f.bias"] = _same("transformer.ln_f.bias")
    elif arch == "llama":
        out["tok_emb.weight"] = _vocab("model.embed_tokens.weight", m.vocab_size)
        for i in range(m.n_layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            out[f"{ours}norm1.weight"] = _same(f"{hf}input_layernorm.weight")
            out[f"{ours}attn.qkv.weight"] = _llama_qkv(f"{hf}self_attn.", m.n_heads, kv_heads_of(m), head_dim)
            out[f"{ours}attn.proj.weight"] = _same(f"{hf}self_attn.o_proj.weight")
            out[f"{ours}norm2.weight"] = _same(f"{hf}post_attention_layernorm.weight")
            out[f"{ours}mlp.gate.weight"] = _same(f"{hf}mlp.gate_proj.weight")
            out[f"{ours}mlp.up.weight"] = _same(f"{hf}mlp.up_proj.weight")
            out[f"{ours}mlp.proj.weight"] = _same(f"{hf}mlp.down_proj.weight")
        out["norm_f.weight"] = _same("model.norm.weight")
        out["output.weight"] = _vocab("lm_head.weight", m.vocab_size)
    else:
        raise ValueError(f"unknown model arch {arch!r}")
    return out


def shapes(m: ModelConfig, rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """hpctrain's weights and their shapes, with `rows` embedding rows (the tokenizer's vocabulary when None)."""
    arch, rows = arch_of(m), rows or m.vocab_size
    out = top_shapes(m.d_model, rows, m.context, arch, tied_of(m))
    for i in range(m.n_layers):
        out.update({f"layers.{i}.{k}": v for k, v in block_shapes(m.d_model, ffn_hidden_of(m), arch,
                                                                  kv_dim_of(m)).items()})
    return out


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint's tensors and their shapes for the config's model."""
    meta = {k: torch.empty(s, device="meta") for k, s in shapes(m).items()}
    return {k: tuple(v.shape) for k, v in to_hf(meta, m).items()}


def to_hf(state: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """A full hpctrain model state (padded or not) -> the HF model's state dict, keyed as HF saves it (a tied
    GPT-2 head is not saved: HF ties lm_head to wte on load)."""
    table, expected = recipes(m), shapes(m)
    missing, unknown = sorted(set(table) - set(state)), sorted(set(state) - set(table))
    if missing or unknown:
        raise HFMismatch(f"the {arch_of(m)} state does not match the model config (model={m.name}): missing "
                         f"{missing[:5]}, unexpected {unknown[:5]} ({len(missing)} and {len(unknown)} in all)")
    out: dict[str, torch.Tensor] = {}
    for name, recipe in table.items():
        want = _rows_of(name, expected[name], state[name].shape)
        if tuple(state[name].shape) != want:
            raise HFMismatch(f"{name}: shape {list(state[name].shape)} in the state, the model config "
                             f"(model={m.name}) wants {list(want)}: export with the config the run trained with")
        out.update(zip(recipe.hf_names, recipe.split(state[name])))
    return out


def _rows_of(name: str, shape: tuple[int, ...], actual: torch.Size) -> tuple[int, ...]:
    """The expected shape, with any row count >= the vocabulary accepted for the vocabulary-row tensors."""
    if name in VOCAB_ROWS and len(actual) == 2 and actual[0] >= shape[0]:
        return (actual[0], *shape[1:])
    return shape


def from_hf(hf: Mapping[str, torch.Tensor], m: ModelConfig, rows: int | None = None,
            names: list[str] | None = None, tied: bool = False) -> dict[str, torch.Tensor]:
    """An HF state dict -> hpctrain's weights `names` (all when None), the vocabulary padded with zero rows to
    `rows`. `tied`: the HF model ties lm_head to the embedding (Llama 3.2 1B/3B), so hpctrain's untied head
    starts as a copy of it."""
    return dict(iter_from_hf(hf, m, rows, names, tied))


def iter_from_hf(hf: Mapping[str, torch.Tensor], m: ModelConfig, rows: int | None = None,
                 names: list[str] | None = None, tied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """from_hf one weight at a time: a lazy `hf` (memory-mapped files) is read only as far as the loop goes."""
    table = recipes(m)
    if tied and "output.weight" in table:
        table["output.weight"] = _same(table["tok_emb.weight"].hf_names[0])
    for name in names if names is not None else list(table):
        value = table[name].join([hf[k] for k in table[name].hf_names])
        if name in VOCAB_ROWS and rows and rows > value.shape[0]:
            value = torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])])
        yield name, value


def canonical_name(name: str, m: ModelConfig) -> str:
    """An HF tensor's name as the *ForCausalLM model saves it: files of the bare GPT2Model/LlamaModel (the hub's
    gpt2) leave out the base model's prefix."""
    base = "transformer." if arch_of(m) == "gpt" else "model."
    return name if name.startswith((base, "lm_head.")) else base + name


def check_hf_shapes(found: Mapping[str, tuple[int, ...]], m: ModelConfig, where: str, tied: bool = False
                    ) -> list[str]:
    """Problems with an HF checkpoint's tensors (canonical name -> shape) for the config's model, one line each.
    `tied`: the HF model ties lm_head to the embedding (its lm_head, if saved at all, is not read)."""
    want = hf_shapes(m)
    if tied:
        want.pop("lm_head.weight", None)

    def ignored(k: str) -> bool:
        return k.endswith(_NOT_WEIGHTS) or (k == "lm_head.weight" and k not in want)

    have = {k: tuple(v) for k, v in found.items() if not ignored(k)}
    problems = [f"{k}: missing from {where} (the config's {arch_of(m)} model has it)" for k in want if k not in have]
    problems += [f"{k}: shape {list(have[k])} in {where}, the config wants {list(s)}"
                 for k, s in want.items() if k in have and have[k] != s]
    problems += [f"{k}: in {where}, not in the config's {arch_of(m)} model" for k in have if k not in want]
    return problems


# ---------------------------------------------------------------- config.json


def hf_config(m: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF config.json of the config's model (GPT2Config or LlamaConfig)."""
    arch, dtype_name = arch_of(m), str(dtype).removeprefix("torch.")
    if arch == "gpt":
        return {"architectures": [GPT2], "model_type": "gpt2", "vocab_size": m.vocab_size, "n_positions": m.context,
                "n_embd": m.d_model, "n_layer": m.n_layers, "n_head": m.n_heads, "n_inner": ffn_hidden_of(m),
                "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout,
                "embd_pdrop": m.dropout, "attn_pdrop": m.dropout, "initializer_range": m.init_std,
                "tie_word_embeddings": True, "torch_dtype": dtype_name, **NO_TOKEN_IDS}
    if arch == "llama":
        r = m.rope
        scaling = None if r.scaling_factor <= 0 else {
            "rope_type": "llama3", "factor": r.scaling_factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_context}
        return {"architectures": [LLAMA], "model_type": "llama", "vocab_size": m.vocab_size,
                "hidden_size": m.d_model, "intermediate_size": ffn_hidden_of(m), "num_hidden_layers": m.n_layers,
                "num_attention_heads": m.n_heads, "num_key_value_heads": kv_heads_of(m),
                "head_dim": m.d_model // m.n_heads, "hidden_act": "silu", "max_position_embeddings": m.context,
                "rms_norm_eps": m.norm_eps, "rope_theta": r.theta, "rope_scaling": scaling,
                "attention_bias": False, "attention_dropout": m.dropout, "mlp_bias": False,
                "initializer_range": m.init_std, "tie_word_embeddings": False, "torch_dtype": dtype_name,
                **NO_TOKEN_IDS}
    raise ValueError(f"unknown model arch {arch!r}")


def mismatches(m: ModelConfig, hf: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """hf_fields.config_mismatches; a dropout that differs is no mismatch (continued pretraining often drops it)
    but is logged as a warning (`warn_dropout`): the weights load, the run trains at model.dropout."""
    differ = config_mismatches(m, hf)
    if not differ:
        warn_dropout(m, hf)
    return differ


def dropout_differences(m: ModelConfig, hf: Mapping[str, Any]) -> dict[str, float]:
    """The HF config's dropout probabilities (transformers' default where a key is absent) that differ from the
    run's model.dropout; empty when they agree."""
    found = {key: float(hf[key] if hf.get(key) is not None else default)
             for key, default in HF_DROPOUT.get(str(hf.get("model_type")), {}).items()}
    return {key: value for key, value in found.items() if not math.isclose(value, float(m.dropout), abs_tol=1e-12)}


def warn_dropout(m: ModelConfig, hf: Mapping[str, Any]) -> str | None:
    """model.init_from: a log warning when the Hugging Face model's dropout is not the run's (GPT-2's 0.1 trained
    at hpctrain's 0.0 without a word, before); the line names the HF values and the key to set. Returns it."""
    differ = dropout_differences(m, hf)
    if not differ:
        return None
    theirs = ", ".join(f"{key}={value:g}" for key, value in differ.items())
    line = (f"model.init_from: the Hugging Face config.json ({hf.get('model_type')}) has dropout {theirs}; this run "
            f"trains with model.dropout={float(m.dropout):g} (hpctrain's one dropout: attention, residual and "
            f"embedding). Set model.dropout={max(differ.values()):g} to train with the model's own dropout, or "
            f"keep model.dropout={float(m.dropout):g} (usual for pretraining) and this is only a note")
    log.warning(line)
    return line
