"""docs/extending/model_family.md, step by step: a model family added as the guide adds it (its folder and one line
of the registry, nothing else), checked against its entry, refused where its own rule says, trained on one process
and on TP 2 (equal), and taken out again.

The family is GPT with a ReLU MLP ("gpt_relu"). Its folder is tests/models/gpt_relu/, which the fixture puts in
hpctrain's place for it, hpctrain/models/gpt_relu/, beside a registry with the guide's one line. The guide quotes
the folder's files and this file's tests; the last tests check that every ```python block still appears here and
that the guide's files and diff are only the folder and that line.
"""

from __future__ import annotations

import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpctrain import models
from hpctrain.models import registry
from hpctrain.models.family import Dims, Family, resolve
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import make_cfg, reference, run_engine

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "extending" / "model_family.md"
FOLDER = Path(__file__).resolve().parent / "gpt_relu"  # hpctrain/models/gpt_relu/ in the tree
REGISTRY = Path(registry.__file__)


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", GUIDE.read_text(), re.S)


def with_diff(source: str, diff: str) -> tuple[str, str, list[str], list[str]]:
    """(the file the diff names, `source` with the diff applied, the lines it adds, the lines it removes): its
    context and removed lines must stand in `source` in that order, one after the other."""
    target, old, new, added, removed = "", [], [], [], []
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            target = line[6:]
        elif line.startswith(("--- a/", "@@")):
            continue
        elif line.startswith("+"):
            new.append(line[1:])
            added.append(line[1:])
        elif line.startswith("-"):
            old.append(line[1:])
            removed.append(line[1:])
        else:
            old.append(line[1:])
            new.append(line[1:])
    lines = source.splitlines()
    at = next((i for i in range(len(lines)) if lines[i : i + len(old)] == old), None)
    assert at is not None, f"the diff's context is not in {target}: {old}"
    return target, "\n".join([*lines[:at], *new, *lines[at + len(old) :]]) + "\n", added, removed


@pytest.fixture(scope="module", autouse=True)
def gpt_relu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """The guide's family as it would land: its folder as hpctrain/models/gpt_relu/ and hpctrain/models/registry.py
    with the guide's diff, run as a module of its own (the tree's registry stays as it is); its entry is then added
    to the registry every hpctrain module reads with `registry.register`, as a family defined outside hpctrain is,
    and taken out again after this module's tests."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(FOLDER, root / "gpt_relu", ignore=shutil.ignore_patterns("__pycache__"))
    models.__path__.append(str(root))
    try:
        _, source, _, _ = with_diff(REGISTRY.read_text(), _blocks("diff")[0])
        patched = types.ModuleType("registry_with_gpt_relu")
        exec(compile(source, str(REGISTRY), "exec"), patched.__dict__)
        entry: Family = patched.FAMILIES["gpt_relu"]
        registry.register(entry)
        try:
            yield entry
        finally:
            registry.unregister("gpt_relu")
    finally:
        models.__path__.remove(str(root))
        for name in [m for m in sys.modules if m.startswith("hpctrain.models.gpt_relu")]:
            del sys.modules[name]


# Step 4: the entry names every parameter the module builds (no torch needed to count them).
def test_the_entry_names_every_parameter() -> None:
    cfg = make_cfg(1, model__arch="gpt_relu")
    entry = registry.family_of(cfg.model)
    with torch.device("meta"):
        model = entry.build(cfg.model)
    dims = Dims.of(cfg.model)
    want = entry.top_shapes(dims, model.tok_emb.weight.shape[0])
    for i in range(cfg.model.n_layers):
        want.update({f"layers.{i}.{k}": v for k, v in entry.block_shapes(dims).items()})
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == want


# Step 5: the checks run the family's own rule, with its key and fix.
def test_the_checks_run_the_familys_rule() -> None:
    from hpctrain.checks.config import model_shape_checks
    from hpctrain.checks.report import CheckReport
    from hpctrain.config.layout import resolve_layout

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


def test_the_family_is_its_folder_and_one_registry_line(gpt_relu: Family) -> None:
    """What the guide adds to hpctrain: the files its table lists are the folder's and registry.py, its diff adds
    one line to registry.py and removes none, and that line alone brings the folder's entry and module in."""
    table = re.findall(r"^\| `(hpctrain/[^`]+)` \|", GUIDE.read_text(), re.M)
    folder = sorted(f"hpctrain/models/<name>/{p.name}" for p in FOLDER.glob("*.py"))
    assert sorted(table) == sorted([*folder, "hpctrain/models/registry.py"])
    diffs = _blocks("diff")
    assert len(diffs) == 1
    target, _, added, removed = with_diff(REGISTRY.read_text(), diffs[0])
    assert target == "hpctrain/models/registry.py" and removed == []
    assert added == ['    "hpctrain.models.gpt_relu.entry:GPT_RELU_FAMILY",']
    module = resolve(gpt_relu.builder).__module__
    assert module == "hpctrain.models.gpt_relu.model"
    assert Path(sys.modules[module].__file__).parent.parent == Path(models.__path__[-1])  # the folder's copy


def test_the_guide_quotes_the_family_and_these_tests() -> None:
    """Every code block of the guide is, as it stands, one of the folder's files or in this file."""
    sources = [Path(__file__).read_text(), *(p.read_text() for p in sorted(FOLDER.glob("*.py")))]
    blocks = _blocks("python")
    assert len(blocks) == 6
    for block in blocks:
        assert any(block in source for source in sources), block
