"""Model definitions (free of parallelism) and their parameter arithmetic.

The package itself imports no torch (the login node plans with hpctrain.models.params): `create_model` imports
the model modules when it builds one. Whether a model ties its head to its embedding is its class attribute
`tied_embeddings` (GPT: true; Llama: false).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpctrain.models.gpt import GPT
    from hpctrain.models.llama import Llama

    Transformer = GPT | Llama


def create_model(model_cfg: Any, tp: int = 1) -> Transformer:
    """The model of a config's `model` group (model.arch: gpt or llama), embedding padded for `tp`, built on the
    current device context (`with torch.device("meta")` allocates nothing; init_weights() fills it)."""
    if getattr(model_cfg.arch, "value", model_cfg.arch) == "llama":
        from hpctrain.models.llama import Llama, llama_args

        return Llama(llama_args(model_cfg, tp))
    from hpctrain.models.gpt import GPT, gpt_args

    return GPT(gpt_args(model_cfg, tp))
