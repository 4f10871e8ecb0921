"""docs/extending/model_family.md, step by step: a model family defined here, registered, checked against its
spec, refused where its own rule says, trained on one process and on TP 2 (equal), and unregistered.

The family is GPT with a ReLU MLP ("gpt_relu"). The guide quotes this file's code blocks; the last test checks
that every ```python block of the guide appears here verbatim, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpctrain.models import gpt, gpt_spec, registry
from hpctrain.models.family import Dims, ShapeProblem
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import make_cfg, reference, run_engine

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "extending" / "model_family.md"


# Step 1: the torch module (hpctrain/models/<name>.py). No process groups, no DTensor: the layouts are applied
# from outside, by parameter name.
class ReluMLP(gpt.MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)))


class GPTRelu(gpt.GPT):
    family = "gpt_relu"  # its entry in hpctrain.models.registry

    def __init__(self, args: gpt.GPTArgs) -> None:
        super().__init__(args)
        for block in self.layers.values():
            block.mlp = ReluMLP(args)


def build(m: Any, tp: int = 1) -> GPTRelu:
    """The family's builder: the model of a config's `model` section, embedding padded for `tp`."""
    return GPTRelu(gpt.gpt_args(m, tp))


# Step 2: the entry (hpctrain/models/<name>_spec.py, torch-free): the shapes, the TP plan, the stage modules
# and the HF counterpart are GPT's; the summary, the builder and one shape rule are its own.
def shape_problems(m: Any) -> list[ShapeProblem]:
    out = gpt_spec.shape_problems(m)
    if m.dropout:
        out.append(
            ("model.dropout", f"model.arch=gpt_relu trains without dropout, got {m.dropout}", "set model.dropout=0")
        )
    return out


GPT_RELU_FAMILY = replace(
    gpt_spec.GPT_FAMILY,
    name="gpt_relu",
    summary="GPT with a ReLU MLP",
    builder=f"{__name__}:build",
    shape_problems=shape_problems,
)


# Step 3: register it. In hpctrain it is one line of hpctrain/models/registry.py; here, for this module's tests.
@pytest.fixture(autouse=True)
def gpt_relu() -> Iterator[None]:
    registry.register(GPT_RELU_FAMILY)
    try:
        yield
    finally:
        registry.unregister("gpt_relu")


# Step 4: the spec names every parameter the module builds (no torch needed to count them).
def test_the_spec_names_every_parameter() -> None:
    cfg = make_cfg(1, model__arch="gpt_relu")
    spec = registry.family_of(cfg.model)
    with torch.device("meta"):
        model = spec.build(cfg.model)
    dims = Dims.of(cfg.model)
    want = spec.top_shapes(dims, model.tok_emb.weight.shape[0])
    for i in range(cfg.model.n_layers):
        want.update({f"layers.{i}.{k}": v for k, v in spec.block_shapes(dims).items()})
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == want


# Step 5: the checks run the family's own rule, with its key and fix.
def test_the_checks_run_the_familys_rule() -> None:
    from hpctrain.config.checks import model_shape_checks
    from hpctrain.config.layout import resolve_layout
    from hpctrain.config.problems import CheckReport

    cfg = make_cfg(1, model__arch="gpt_relu", model__dropout=0.1)
    report = CheckReport(layout=resolve_layout(cfg))
    model_shape_checks(cfg, report)
    assert [(p.key, p.fix) for p in report.errors] == [("model.dropout", "set model.dropout=0")]


# Step 6: one process: forward and backward through the ReLU, which is not GPT's GELU.
def test_one_process_trains_its_own_mlp() -> None:
    ref = reference({"model__arch": "gpt_relu"}, steps=3)
    gelu = reference({"model__arch": "gpt"}, steps=3)
    assert all(norm > 0 for norm in ref["grad_norm"])  # the backward reaches the weights
    assert ref["loss"][0] != gelu["loss"][0]  # the same initial weights, another activation


# Step 7: a layout case: TP 2 on two processes equals the one-process run.
def test_tp2_equals_one_process() -> None:
    overrides = {"model__arch": "gpt_relu", "parallel__tp": 2}
    ref = reference(overrides, steps=3, world=2)
    results = run_distributed(run_engine, 2, overrides, 3, timeout=240)
    for r in results:
        torch.testing.assert_close(r["loss"], ref["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(r["grad_norm"], ref["grad_norm"], rtol=1e-5, atol=0)


def test_the_guide_quotes_this_file() -> None:
    """Every code block of the guide is in this file as it stands (the diff blocks are the registry's)."""
    source = Path(__file__).read_text()
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 7
    for block in blocks:
        assert block in source, block
