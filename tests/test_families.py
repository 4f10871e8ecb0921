"""A model family is one family entry (hpctrain.models.registry) in a folder of its own: the entry must describe
its torch module exactly, and nothing outside the family folders may branch on an architecture's name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.checks.config import check_schema
from hpctrain.config.problems import ConfigError
from hpctrain.config.schema import Config, ModelConfig
from hpctrain.models import registry
from hpctrain.models.family import Dims, Family, FamilyModule

PACKAGE = Path(__file__).resolve().parent.parent / "hpctrain"


def _family_files() -> set[Path]:
    """The registry, the Family class, and each of hpctrain's families' folders (hpctrain/models/<name>/). The
    blocks the families share (hpctrain/models/common/) name none of them."""
    own = {PACKAGE / "models" / "registry.py", PACKAGE / "models" / "family.py"}
    for name in registry.BUILT_IN:
        own |= set((PACKAGE / "models" / name).rglob("*.py"))
    return own


@pytest.mark.parametrize("family", sorted(registry.BUILT_IN))
def test_each_family_is_its_own_folder(family: str) -> None:
    """The family entry, its torch module and its Hugging Face table are in hpctrain/models/<name>/ (a family
    built on another, as Qwen3 on Llama, imports that one's pieces, and inherits its entry's other fields)."""
    entry = registry.get(family)
    package = f"hpctrain.models.{family}."
    assert [e for e in registry.ENTRIES if e.startswith(package)] == [f"{package}entry:{family.upper()}_FAMILY"]
    assert entry.builder.startswith(package) and entry.hf.recipes.startswith(package)
    assert entry.block_shapes.__module__.startswith(package) and entry.hf.fields.__module__.startswith(package)


def _names() -> set[str]:
    """Every name that identifies a family: model.arch, HF's model_type and class name."""
    out: set[str] = set()
    for f in registry.FAMILIES.values():
        out |= {f.name, f.hf.model_type, f.hf.class_name}
    return out


def architecture_branches(source: str, names: set[str]) -> list[str]:
    """Lines that decide by a family's name: a comparison or membership test against it, a dict keyed by it, a
    or match case on it."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        consts: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            consts = [node.left, *node.comparators]
            consts += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts]
        elif isinstance(node, ast.Dict):
            consts = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            consts = [node.value]
        found += [
            f"line {c.lineno}: {c.value!r}"
            for c in consts
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names
        ]
    return found


def test_no_module_outside_the_families_branches_on_an_architecture_name() -> None:
    own, names = _family_files(), _names()
    assert all(path.is_file() for path in own), sorted(str(p) for p in own if not p.is_file())
    offenders = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in own
        if (hits := architecture_branches(path.read_text(), names))
    }
    assert not offenders, f"branch on an architecture name outside the family folders: {offenders}"


def test_the_scan_finds_what_it_looks_for() -> None:
    """The shapes of branch the codebase had before the registry (hpctrain/plan/types.py, estimate.py, checks.py,
    hf.py) are all found."""
    names = _names()
    planted = """
if arch == "gpt": pass
kv = n if arch_of(m) == "llama" else 0
if kind in ("gpt2", "llama"): pass
table = {"gpt": 1}
match kind:
    case "LlamaForCausalLM": pass
"""
    assert len(architecture_branches(planted, names)) == 6
    assert architecture_branches('if schedule == "1f1b": pass\nname = "llama"  # a value, not a branch\n', names) == []


def _tiny(family: str, **over: object) -> ModelConfig:
    m = OmegaConf.structured(
        ModelConfig(
            name="tiny", arch=family, n_layers=2, d_model=64, n_heads=4, vocab_size=100, context=32, ffn_hidden=96
        )
    )
    if registry.get(family).moe:
        m.moe.merge_with({"n_experts": 4, "top_k": 2, "expert_hidden": 32})
    for key, value in over.items():
        m[key] = value
    return m


def _heads(entry: Family) -> dict[str, int]:
    """Grouped-query attention where the family has it, with heads wider than d_model / n_heads (64 / 4)."""
    return {"n_kv_heads": 2, "head_dim": 32} if entry.grouped_query else {}


@pytest.mark.parametrize("family", sorted(registry.FAMILIES))
def test_the_entry_names_every_parameter_of_the_torch_module(family: str) -> None:
    entry = registry.get(family)
    m = _tiny(family, **_heads(entry))
    with torch.device("meta"):
        model = entry.build(m, 1)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    dims = Dims.of(m)
    want = entry.top_shapes(dims, model.tok_emb.weight.shape[0])
    for i in range(m.n_layers):
        want.update({f"layers.{i}.{k}": v for k, v in entry.block_shapes(dims).items()})
    if entry.tied_embeddings:
        assert "output.weight" not in want
    assert built == want
    assert isinstance(model, FamilyModule)
    assert model.family == family and model.tied_embeddings == entry.tied_embeddings
    names = {name.split(".", 2)[-1] if name.startswith("layers.") else name for name in built}
    assert set(entry.tp_dims) <= names and set(entry.ep_dims) <= names
    for module in entry.stage_modules:
        assert hasattr(model, module)


@pytest.mark.parametrize("family", sorted(registry.FAMILIES))
def test_the_entry_names_every_hf_tensor(family: str) -> None:
    """The torch-free HF tensor table (what the login node checks a model directory against) is what the
    converter makes of the model's weights."""
    from hpctrain.models.hf import hf_shapes

    entry = registry.get(family)
    m = _tiny(family, **_heads(entry))
    assert entry.hf.weight_shapes(Dims.of(m)) == hf_shapes(m)
    assert registry.for_hf(entry.hf.model_type) is entry
    config = entry.hf.config(m, "float32")
    assert config["model_type"] == entry.hf.model_type and config["architectures"] == [entry.hf.class_name]
    fields = entry.hf.fields(config)
    assert fields["arch"] == family and (fields["n_layers"], fields["d_model"]) == (2, 64)


def test_the_family_entries_import_no_torch() -> None:
    """The registry resolves its family entries by name (ENTRIES), which the import contracts do not follow: the
    login node plans with them, so a fresh interpreter importing the registry, and every entry, imports no torch."""
    probe = "import sys, hpctrain.models.registry; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_schemas_default_arch_is_a_family() -> None:
    """hpctrain.config imports no models (models read config: the import-linter "config" contract), so the schema's
    default model.arch is a plain name: it must be one of hpctrain's own families."""
    assert OmegaConf.structured(ModelConfig).arch in registry.BUILT_IN


def test_an_unknown_family_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model arch 'mamba': one of gpt, llama, qwen3"):
        registry.get("mamba")
    with pytest.raises(ValueError, match="model_type 'mamba': hpctrain converts gpt2"):
        registry.for_hf("mamba")


def test_a_registered_family_is_accepted_until_unregistered() -> None:
    """registry.register (a family defined outside hpctrain: tests/models/test_family_guide.py) gives model.arch the
    new name; unregister takes it out again, and hpctrain's own families stay."""
    from dataclasses import replace

    family = replace(registry.get("gpt"), name="gpt_other")
    config = OmegaConf.structured(Config)
    config.model.merge_with({"name": "other", "arch": "gpt_other"})
    registry.register(family)
    try:
        check_schema(config)
        assert registry.family_of(config.model) is family
        with pytest.raises(ValueError, match="already registered"):
            registry.register(family)
    finally:
        registry.unregister("gpt_other")
    with pytest.raises(ConfigError, match=r"model.arch: 'gpt_other' is not a model family\n.*The families: gpt, llama"):
        check_schema(config)
    with pytest.raises(ValueError, match="one of hpctrain's own"):
        registry.unregister("gpt")
    assert set(registry.FAMILIES) == registry.BUILT_IN
