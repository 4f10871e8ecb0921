"""The model families, one family entry each (hpctrain.models.family.Family): model.arch names one of them.

Adding a family is its folder, hpctrain/models/<name>/, and one line in ENTRIES; nothing else in hpctrain names an
architecture (tests/test_families.py), and the guide's family shows it (tests/models/test_family_guide.py).
"""

from __future__ import annotations

from typing import Any

from hpctrain.models.family import Family, resolve

# One line per family: "module:name" of its family entry (torch-free: the login node plans with it)
ENTRIES = (
    "hpctrain.models.gpt.entry:GPT_FAMILY",
    "hpctrain.models.llama.entry:LLAMA_FAMILY",
    "hpctrain.models.qwen3.entry:QWEN3_FAMILY",
    "hpctrain.models.mixtral.entry:MIXTRAL_FAMILY",
    "hpctrain.models.qwen3_moe.entry:QWEN3_MOE_FAMILY",
)
FAMILIES: dict[str, Family] = {f.name: f for f in map(resolve, ENTRIES)}
BUILT_IN = frozenset(FAMILIES)


def register(family: Family) -> None:
    """Add a family defined outside hpctrain (a test's, a site's) at run time: `model.arch=<its name>` is then
    accepted by the configs composed afterwards. hpctrain's own families are those of ENTRIES above."""
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
