"""The gpt_relu family entry (torch-free): GPT's shapes, TP plan, stage modules and HF counterpart; its own
summary, builder and one shape rule."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpctrain.models.family import ShapeProblem
from hpctrain.models.gpt import entry as gpt_entry


def shape_problems(m: Any) -> list[ShapeProblem]:
    out = gpt_entry.shape_problems(m)
    if m.dropout:
        out.append(
            ("model.dropout", f"model.arch=gpt_relu trains without dropout, got {m.dropout}", "set model.dropout=0")
        )
    return out


GPT_RELU_FAMILY = replace(
    gpt_entry.GPT_FAMILY,
    name="gpt_relu",
    summary="GPT with a ReLU MLP",
    builder="hpctrain.models.gpt_relu.model:build",
    shape_problems=shape_problems,
)
