"""The gpt_relu family's torch module: GPT's, with a ReLU MLP."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hpctrain.models.gpt import model as gpt


class ReluMLP(gpt.MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)))


class GPTRelu(gpt.GPT):
    family = "gpt_relu"  # its family entry's name in hpctrain.models.registry

    def __init__(self, args: gpt.GPTArgs) -> None:
        super().__init__(args)
        for block in self.layers.values():
            block.mlp = ReluMLP(args)


def build(m: Any, tp: int = 1) -> GPTRelu:
    """The family's builder: the model of a config's `model` section, embedding padded for `tp`."""
    return GPTRelu(gpt.gpt_args(m, tp))
