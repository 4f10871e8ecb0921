"""Model definitions (free of parallelism) and their parameter arithmetic.

The package itself imports no torch (the login node plans with hpctrain.models.params and the families' specs,
hpctrain.models.registry): `create_model` imports the family's torch module when it builds one. Each model
class names its family (`family`) and whether it ties its head to its embedding (`tied_embeddings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.models import registry

if TYPE_CHECKING:
    from hpctrain.models.gpt import GPT
    from hpctrain.models.llama import Llama

    Transformer = GPT | Llama


def create_model(model_cfg: Any, tp: int = 1) -> Transformer:
    """The model of a config's `model` group (its family, model.arch), embedding padded for `tp`, built on the
    current device context (`with torch.device("meta")` allocates nothing; init_weights() fills it)."""
    return registry.family_of(model_cfg).build(model_cfg, tp)
