"""Model definitions (free of parallelism) and their parameter arithmetic: one folder per family
(hpctrain/models/<name>/: its family entry and its torch module), the blocks they share (common/), the family
entry's type (family.py), the registry (one line per family), the parameter counts (params.py) and the Hugging Face
converter (hf.py, hf_fields.py).

The package itself imports no torch (the login node plans with hpctrain.models.params and the family entries,
hpctrain.models.registry): `create_model` imports the family's torch module when it builds one, `as_module` torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpctrain.models import registry
from hpctrain.models.family import FamilyModule

if TYPE_CHECKING:
    from torch import nn

    from hpctrain.config.schema import ModelConfig


def create_model(model_cfg: ModelConfig, tp: int = 1) -> FamilyModule:
    """The model of a config's `model` group (its family, model.arch), embedding padded for `tp`, built on the
    current device context (`with torch.device("meta")` allocates nothing; init_weights() fills it)."""
    return registry.family_of(model_cfg).build(model_cfg, tp)


def as_module(model: FamilyModule) -> nn.Module:
    """The family's module as the nn.Module it is, for torch's APIs (FSDP2, DDP, hooks, submodules): a Protocol
    cannot derive from nn.Module, so the one check that every builder made one is here."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"a family's builder made a {type(model).__name__}, not a torch.nn.Module")
    return model
