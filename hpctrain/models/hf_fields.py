"""What a Hugging Face config.json stands for in hpctrain's model.* keys, and how it differs from a run's model.

Pure and torch-free: the login node's file checks (hpctrain/checks/files.py) and the task's import of
a Hugging Face directory (hpctrain/models/hf.py) compare through these same functions. What a model type's
config.json holds is its family's (hpctrain.models.registry, `Family.hf`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hpctrain.models import registry
from hpctrain.models.family import Dims, HFMismatch

__all__ = ["HFMismatch", "config_mismatches", "hf_weight_shapes", "model_fields"]


def hf_weight_shapes(m: Any) -> dict[str, tuple[int, ...]]:
    """The tensors an HF checkpoint of the config's model holds, by canonical name, with their shapes (its
    family's `hf.weight_shapes`; a tied head is not saved)."""
    return registry.family_of(m).hf.weight_shapes(Dims.of(m))


def model_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A ModelConfig-compatible dict (model.* keys) from an HF config.json; HFMismatch for what hpctrain's models
    cannot represent (another model type, activation, attention bias, RoPE scaling)."""
    try:
        family = registry.for_hf(hf.get("model_type"))
    except ValueError as exc:
        raise HFMismatch(str(exc)) from None
    return family.hf.fields(hf)


def config_mismatches(m: Any, hf: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(model.* key, the run's value, the HF model's value) for every field that differs: the shape every family
    has, and what the HF model's family compares besides (`HFSpec.compared`)."""
    theirs = model_fields(hf)
    d = Dims.of(m)
    ours: dict[str, Any] = {
        "arch": registry.family_of(m).name,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "ffn_hidden": d.ffn_hidden,
        "vocab_size": m.vocab_size,
        "norm_eps": m.norm_eps,
        **registry.get(theirs["arch"]).hf.compared(m, theirs),
    }
    flat = _flat(theirs)
    return [
        (f"model.{key}", value, flat.get(key)) for key, value in _flat(ours).items() if not _equal(value, flat.get(key))
    ]


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    equal: bool = a == b
    return equal
