"""How one hpctrain weight is made of Hugging Face tensors and back: the pieces each family's table is built of
(`hf_recipes` in hpctrain.models.gpt and hpctrain.models.llama, named by `Family.hf.recipes`).

Every conversion is exact: a permutation, transposition or split, no arithmetic (hpctrain.models.hf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recipe:
    """How one hpctrain tensor is made of HF tensors (join) and back (split)."""

    hf_names: tuple[str, ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]


def same(name: str) -> Recipe:
    return Recipe((name,), lambda ts: ts[0], lambda t: [t])


def transposed(name: str) -> Recipe:
    """GPT-2's Conv1D: the weight is stored [in, out]."""
    return Recipe((name,), lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])


def vocab(name: str, vocab_size: int) -> Recipe:
    """The padding rows are dropped on the way out; `from_hf` adds them back."""
    return Recipe((name,), lambda ts: ts[0], lambda t: [t[:vocab_size]])
