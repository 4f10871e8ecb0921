"""How one hpctrain weight is made of Hugging Face tensors and back: the pieces each family's table is built of
(`hf_recipes` in each family's module, named by `Family.hf.recipes`).

Every conversion is exact: a permutation, transposition or split, no arithmetic (hpctrain.models.hf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.models.family import Dims


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


def experts(names: list[str]) -> Recipe:
    """E per-expert HF tensors <-> one [E, ...] weight. The pieces are copies, not views of the stacked weight:
    safetensors refuses to save tensors that share memory."""
    return Recipe(tuple(names), torch.stack, lambda t: [x.clone() for x in t.unbind(0)])


def with_experts(
    dense: dict[str, Recipe], m: Any, router: str, where: str, gate: str, up: str, down: str
) -> dict[str, Recipe]:
    """A Mixture-of-Experts family's table: the dense relative's with each layer's MLP replaced, in its place
    (export writes the weights in this order), by its router `<layer>.<router>.weight` (HF's as it is) and experts
    `<layer>.<where>.<e>.<gate|up|down>.weight`, each of hpctrain's stacked [E, ...] weights the E per-expert tensors
    stacked along dim 0 (transformers 5 fuses gate and up in memory only; its files keep one tensor per expert)."""
    n = Dims.of(m).n_experts
    out: dict[str, Recipe] = {}
    for name, recipe in dense.items():
        if ".mlp." not in name:
            out[name] = recipe
        elif name.endswith(".mlp.gate.weight"):
            ours, hf = name.removesuffix("gate.weight"), f"model.layers.{name.split('.')[1]}."
            each = {proj: [f"{hf}{where}.{e}.{proj}.weight" for e in range(n)] for proj in (gate, up, down)}
            out.update(
                {
                    f"{ours}router.weight": same(f"{hf}{router}.weight"),
                    f"{ours}experts.w_gate": experts(each[gate]),
                    f"{ours}experts.w_up": experts(each[up]),
                    f"{ours}experts.w_down": experts(each[down]),
                }
            )
    return out
