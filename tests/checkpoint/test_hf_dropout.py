"""model.init_from with a Hugging Face model whose dropout is not the run's (issue 29: GPT-2's 0.1 was trained
at hpctrain's 0.0 without a word): the weights load, and a warning names the HF values and model.dropout to set.
Real directories: the files `save_hf` writes (as `tools/checkpoint.py export --format hf` does), and one
saved by transformers' save_pretrained with GPT2Config's own defaults."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint.hf import open_hf, save_hf
from hpctrain.models.hf import shapes
from hpctrain.train import loop

LLAMA = [
    "model=llama_tiny",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=96",
]


def model(compose_cfg: Callable[..., Any], *overrides: str) -> Any:
    return loop.load_config(compose_cfg("model.vocab_size=300", *overrides)).model


def hf_directory(m: Any, out: Path, **config: Any) -> Path:
    """A Hugging Face model directory of the model config `m` (random weights), config.json edited."""
    torch.manual_seed(0)
    save_hf({k: torch.randn(s) for k, s in shapes(m).items()}, m, out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "dropout" in r.getMessage()]


def test_gpt2_dropout_is_warned_naming_the_values_and_the_key(
    compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = model(compose_cfg)
    assert m.dropout == 0.0
    directory = hf_directory(m, tmp_path / "gpt2", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        weights, _ = open_hf(directory, m)
    assert "transformer.h.0.attn.c_attn.weight" in weights  # it loads: a warning, not a refusal
    (line,) = warnings_of(caplog)
    assert "attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1" in line
    assert "model.dropout=0" in line and "Set model.dropout=0.1" in line


def test_gpt2_config_without_dropout_keys_has_transformers_default(
    compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GPT2Config defaults all three to 0.1: a config.json that leaves them out trains with 0.1 in transformers."""
    m = model(compose_cfg)
    directory = hf_directory(m, tmp_path / "gpt2")
    config = json.loads((directory / "config.json").read_text())
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        open_hf(directory, m)
    (line,) = warnings_of(caplog)
    assert "attn_pdrop=0.1" in line and "Set model.dropout=0.1" in line


def test_llama_attention_dropout_is_warned(
    compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = model(compose_cfg, *LLAMA)
    directory = hf_directory(m, tmp_path / "llama", attention_dropout=0.05)
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        open_hf(directory, m)
    (line,) = warnings_of(caplog)
    assert "(llama) has dropout attention_dropout=0.05" in line and "Set model.dropout=0.05" in line


def test_the_same_dropout_is_not_warned(
    compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = model(compose_cfg, "model.dropout=0.1")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        open_hf(hf_directory(m, tmp_path / "gpt2"), m)  # save_hf writes the run's 0.1 for all three
        llama = model(compose_cfg, *LLAMA)
        open_hf(hf_directory(llama, tmp_path / "llama"), llama)  # 0.0 and 0.0
    assert warnings_of(caplog) == []


def test_a_model_saved_by_transformers_with_gpt2_defaults(
    compose_cfg: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    transformers = pytest.importorskip("transformers")
    m = model(compose_cfg)
    hf_cfg = transformers.GPT2Config(
        vocab_size=m.vocab_size,
        n_positions=m.context,
        n_embd=m.d_model,
        n_layer=m.n_layers,
        n_head=m.n_heads,
        layer_norm_epsilon=m.norm_eps,
    )
    assert hf_cfg.attn_pdrop == 0.1  # transformers' own default
    transformers.GPT2LMHeadModel(hf_cfg).save_pretrained(tmp_path / "made")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        open_hf(tmp_path / "made", m)
    (line,) = warnings_of(caplog)
    assert "attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1" in line and "model.dropout" in line
