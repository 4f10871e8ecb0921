"""The model families, one entry each (hpctrain.models.family): model.arch names one of them.

Adding a family is its torch module, its spec and a line here; nothing else in hpctrain names an architecture
(tests/test_families.py).
"""

from __future__ import annotations

from typing import Any

from hpctrain.models.family import Family
from hpctrain.models.gpt_spec import GPT_FAMILY
from hpctrain.models.llama_spec import LLAMA_FAMILY
from hpctrain.models.mixtral_spec import MIXTRAL_FAMILY
from hpctrain.models.qwen3_moe_spec import QWEN3_MOE_FAMILY
from hpctrain.models.qwen3_spec import QWEN3_FAMILY

FAMILIES: dict[str, Family] = {
    f.name: f for f in (GPT_FAMILY, LLAMA_FAMILY, QWEN3_FAMILY, MIXTRAL_FAMILY, QWEN3_MOE_FAMILY)
}
DEFAULT = GPT_FAMILY.name  # model.arch when a model config leaves it out
BUILT_IN = frozenset(FAMILIES)


def register(family: Family) -> None:
    """Add a family defined outside hpctrain (a test's, a site's) at run time: `model.arch=<its name>` is then
    accepted by the configs composed afterwards. hpctrain's own families are the entries of FAMILIES above."""
    if family.name in FAMILIES:
        raise ValueError(f"model arch {family.name!r} is already registered")
    FAMILIES[family.name] = family


def unregister(name: str) -> None:
    """Take a family `register` added out again (hpctrain's own stay)."""
    if name in BUILT_IN:
        raise ValueError(f"model arch {name!r} is one of hpctrain's own families")
    FAMILIES.pop(name, None)


def get(name: str) -> Family:
    """The family called `name` (model.arch); ValueError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model arch {name!r}: one of {', '.join(FAMILIES)}") from None


def family_of(model: Any) -> Family:
    """The family of a config's `model` section."""
    return get(model.arch)


def for_hf(model_type: Any) -> Family:
    """The family whose Hugging Face counterpart has config.json's `model_type`; ValueError otherwise."""
    for family in FAMILIES.values():
        if family.hf.model_type == model_type:
            return family
    known = ", ".join(f"{f.hf.model_type} ({f.hf.class_name})" for f in FAMILIES.values())
    raise ValueError(f"model_type {model_type!r}: hpctrain converts {known}")
