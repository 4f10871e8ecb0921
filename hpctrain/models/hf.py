"""hpctrain weights <-> Hugging Face transformers weights: tensors and configs only, no files
(hpctrain.checkpoint.hf reads and writes them). What each family's HF model is, its config.json and its tensor
names are the family entry's (`Family.hf`; the tables in its torch module); this module applies them.

What differs today, and why each conversion is exact (a permutation, transposition or split; no arithmetic):
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
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from hpctrain.models.common.recipes import Recipe, same
from hpctrain.models.family import Dims, resolve
from hpctrain.models.hf_fields import HFMismatch, config_mismatches
from hpctrain.models.registry import family_of, for_hf

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

VOCAB_ROWS = ("tok_emb.weight", "output.weight")  # the tensors whose rows are the (padded) vocabulary
# Special token ids belong to the tokenizer, which a model config does not name: left unset, not HF's defaults
# (GPT2Config's 50256 and LlamaConfig's 1 and 2 are wrong for other vocabularies, Llama 3's included).
NO_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": None}

log = logging.getLogger("hpctrain")


def recipes(m: ModelConfig) -> dict[str, Recipe]:
    """Every hpctrain weight of the config's model, with the HF tensors it corresponds to (its family's table)."""
    table: dict[str, Recipe] = resolve(family_of(m).hf.recipes)(m)
    return table


def shapes(m: ModelConfig, rows: int | None = None) -> dict[str, tuple[int, ...]]:
    """hpctrain's weights and their shapes, with `rows` embedding rows (the tokenizer's vocabulary when None)."""
    family, dims = family_of(m), Dims.of(m)
    out = family.top_shapes(dims, rows or m.vocab_size)
    for i in range(m.n_layers):
        out.update({f"layers.{i}.{k}": v for k, v in family.block_shapes(dims).items()})
    return out


def hf_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint's tensors and their shapes for the config's model, as `to_hf` makes them (the torch-free
    hf_fields.hf_weight_shapes that the login node checks with must equal these: a test holds them to it)."""
    meta = {k: torch.empty(s, device="meta") for k, s in shapes(m).items()}
    return {k: tuple(v.shape) for k, v in to_hf(meta, m).items()}


def to_hf(state: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """A full hpctrain model state (padded or not) -> the HF model's state dict, keyed as HF saves it (a tied
    GPT-2 head is not saved: HF ties lm_head to wte on load)."""
    table, expected = recipes(m), shapes(m)
    missing, unknown = sorted(set(table) - set(state)), sorted(set(state) - set(table))
    if missing or unknown:
        raise HFMismatch(
            f"the {family_of(m).name} state does not match the model config (model={m.name}): missing "
            f"{missing[:5]}, unexpected {unknown[:5]} ({len(missing)} and {len(unknown)} in all)"
        )
    out: dict[str, torch.Tensor] = {}
    for name, recipe in table.items():
        want = _rows_of(name, expected[name], state[name].shape)
        if tuple(state[name].shape) != want:
            raise HFMismatch(
                f"{name}: shape {list(state[name].shape)} in the state, the model config "
                f"(model={m.name}) wants {list(want)}: export with the config the run trained with"
            )
        out.update(zip(recipe.hf_names, recipe.split(state[name])))
    return out


def _rows_of(name: str, shape: tuple[int, ...], actual: torch.Size) -> tuple[int, ...]:
    """The expected shape, with any row count >= the vocabulary accepted for the vocabulary-row tensors."""
    if name in VOCAB_ROWS and len(actual) == 2 and actual[0] >= shape[0]:
        return (actual[0], *shape[1:])
    return shape


def from_hf(
    hf: Mapping[str, torch.Tensor],
    m: ModelConfig,
    rows: int | None = None,
    names: list[str] | None = None,
    tied: bool = False,
) -> dict[str, torch.Tensor]:
    """An HF state dict -> hpctrain's weights `names` (all when None), the vocabulary padded with zero rows to
    `rows`. `tied`: the HF model ties lm_head to the embedding (Llama 3.2 1B/3B), so hpctrain's untied head
    starts as a copy of it."""
    return dict(iter_from_hf(hf, m, rows, names, tied))


def iter_from_hf(
    hf: Mapping[str, torch.Tensor],
    m: ModelConfig,
    rows: int | None = None,
    names: list[str] | None = None,
    tied: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """from_hf one weight at a time: a lazy `hf` (memory-mapped files) is read only as far as the loop goes."""
    table = recipes(m)
    if tied and "output.weight" in table:
        table["output.weight"] = same(table["tok_emb.weight"].hf_names[0])
    for name in names if names is not None else list(table):
        value = table[name].join([hf[k] for k in table[name].hf_names])
        if name in VOCAB_ROWS and rows and rows > value.shape[0]:
            value = torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])])
        yield name, value


def canonical_name(name: str, m: ModelConfig) -> str:
    """An HF tensor's name as the *ForCausalLM model saves it: files of the bare GPT2Model/LlamaModel (the hub's
    gpt2) leave out the base model's prefix."""
    base = family_of(m).hf.base_prefix
    return name if name.startswith((base, "lm_head.")) else base + name


def check_hf_shapes(found: Mapping[str, tuple[int, ...]], m: ModelConfig, where: str, tied: bool = False) -> list[str]:
    """Problems with an HF checkpoint's tensors (canonical name -> shape) for the config's model, one line each.
    `tied`: the HF model ties lm_head to the embedding (its lm_head, if saved at all, is not read)."""
    want = hf_shapes(m)
    if tied:
        want.pop("lm_head.weight", None)

    def ignored(k: str) -> bool:
        return k.endswith(family_of(m).hf.not_weights) or (k == "lm_head.weight" and k not in want)

    have = {k: tuple(v) for k, v in found.items() if not ignored(k)}
    problems = [
        f"{k}: missing from {where} (the config's {family_of(m).name} model has it)" for k in want if k not in have
    ]
    problems += [
        f"{k}: shape {list(have[k])} in {where}, the config wants {list(s)}"
        for k, s in want.items()
        if k in have and have[k] != s
    ]
    problems += [f"{k}: in {where}, not in the config's {family_of(m).name} model" for k in have if k not in want]
    return problems


# ---------------------------------------------------------------- config.json


def hf_config(m: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The HF config.json of the config's model (its family's `hf.config`), special token ids left unset."""
    return {**family_of(m).hf.config(m, str(dtype).removeprefix("torch.")), **NO_TOKEN_IDS}


def mismatches(m: ModelConfig, hf: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """hf_fields.config_mismatches; a dropout that differs is no mismatch (continued pretraining often drops it)
    but is logged as a warning (`warn_dropout`): the weights load, the run trains at model.dropout."""
    differ = config_mismatches(m, hf)
    if not differ:
        warn_dropout(m, hf)
    return differ


def dropout_differences(m: ModelConfig, hf: Mapping[str, Any]) -> dict[str, float]:
    """The HF config's dropout probabilities (transformers' default where a key is absent: its family's
    `hf.dropout`) that differ from the run's model.dropout; empty when they agree. hpctrain has one dropout,
    model.dropout, on attention, residual and embedding alike."""
    found = {
        key: float(hf[key] if hf.get(key) is not None else default) for key, default in _dropout_defaults(hf).items()
    }
    return {key: value for key, value in found.items() if not math.isclose(value, float(m.dropout), abs_tol=1e-12)}


def _dropout_defaults(hf: Mapping[str, Any]) -> dict[str, float]:
    try:
        return for_hf(hf.get("model_type")).hf.dropout
    except ValueError:
        return {}


def warn_dropout(m: ModelConfig, hf: Mapping[str, Any]) -> str | None:
    """model.init_from: a log warning when the Hugging Face model's dropout is not the run's (GPT-2's 0.1 trained
    at hpctrain's 0.0 without a word, before); the line names the HF values and the key to set. Returns it."""
    differ = dropout_differences(m, hf)
    if not differ:
        return None
    theirs = ", ".join(f"{key}={value:g}" for key, value in differ.items())
    line = (
        f"model.init_from: the Hugging Face config.json ({hf.get('model_type')}) has dropout {theirs}; this run "
        f"trains with model.dropout={float(m.dropout):g} (hpctrain's one dropout: attention, residual and "
        f"embedding). Set model.dropout={max(differ.values()):g} to train with the model's own dropout, or "
        f"keep model.dropout={float(m.dropout):g} (usual for pretraining) and this is only a note"
    )
    log.warning(line)
    return line
