"""Checkpoints of the Llama's older SwiGLU layout (one `mlp.fc.weight`, rows 2j gate j and 2j + 1 up j, written
before issue 31) load into today's model (`mlp.gate`, `mlp.up`): weights and Adam state converted on load by
hpctrain.checkpoint.reshard, in one process and into TP and FSDP2 x TP shards, and export to Hugging Face.

The old checkpoint is made here: a trained engine's state rewritten in the old names and layout, saved by DCP.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint.reshard import load_state
from hpctrain.config.layout import resolve_layout
from hpctrain.models.llama.model import legacy_source
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import LLAMA, make_cfg, rank_batches

STEPS = 2  # trained before the save; the step after it is compared
GATE = re.compile(r"mlp\.gate\.weight")


def _engine(world: int, **overrides: Any) -> Any:
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **LLAMA, **overrides)
    return cfg, build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))


def _old_layout(state: dict[str, Any]) -> dict[str, Any]:
    """An engine's state (model, flattened optimizer) as an older hpctrain saved it: each gate/up pair (weight,
    exp_avg, exp_avg_sq) one interleaved tensor under `mlp.fc.weight`, AdamW's step once."""
    out: dict[str, Any] = {}
    for part in ("model", "optim"):
        out[part] = {}
        for key, value in state[part].items():
            if GATE.search(key):
                up = value if value.dim() == 0 else state[part][GATE.sub("mlp.up.weight", key)]
                old = GATE.sub("mlp.fc.weight", key)
                out[part][old] = value.clone() if value.dim() == 0 else torch.stack([value, up], 1).flatten(0, 1)
            elif "mlp.up.weight" not in key:
                out[part][key] = value.clone()
    return out


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(an old-layout checkpoint after STEPS steps, the engine's state then, its weights and loss one step later)."""
    cfg, engine = _engine(1)
    for s in range(STEPS):
        engine.step(rank_batches(s, cfg, 0, 1), cfg.optim.lr)
    state = {
        k: {n: v.detach().clone() if isinstance(v, torch.Tensor) else v for n, v in part.items()}
        for k, part in engine.state_dict().items()
        if k in ("model", "optim")
    }
    old = _old_layout(state)
    assert "layers.0.mlp.fc.weight" in old["model"] and "state.layers.0.mlp.fc.weight.exp_avg_sq" in old["optim"]
    path = tmp_path_factory.mktemp("old") / "step"
    dcp.save({"train": old}, checkpoint_id=str(path), no_dist=True)
    loss = engine.step(rank_batches(STEPS, cfg, 0, 1), cfg.optim.lr).loss
    after = {k: v.detach().clone() for k, v in engine.model_parts[0].state_dict().items()}
    return path, state, {"loss": loss, "weights": after}


def test_legacy_source_names_and_takes_every_other_row() -> None:
    fc = torch.arange(12.0).reshape(6, 2)  # rows: gate 0, up 0, gate 1, up 1, ...
    for key, old, rows in [
        ("layers.3.mlp.gate.weight", "layers.3.mlp.fc.weight", [0, 2, 4]),
        ("state.layers.3.mlp.up.weight.exp_avg", "state.layers.3.mlp.fc.weight.exp_avg", [1, 3, 5]),
        ("train.model.layers.0.mlp.up.weight", "train.model.layers.0.mlp.fc.weight", [1, 3, 5]),
    ]:
        found, take = legacy_source(key)
        assert found == old and torch.equal(take(fc), fc[rows]) and take(fc).is_contiguous()
    assert legacy_source("state.layers.0.mlp.gate.weight.step")[1](torch.tensor(2.0)) == 2
    assert legacy_source("layers.0.mlp.fc.weight") is None and legacy_source("layers.0.mlp.proj.weight") is None


def test_an_old_checkpoint_loads_weights_and_adam_state_in_one_process(old_checkpoint) -> None:
    path, saved, after = old_checkpoint
    cfg, engine = _engine(1)
    state = {"train": engine.state_dict()}
    load_state(state, str(path), None, no_dist=True)
    for part in ("model", "optim"):
        assert sorted(state["train"][part]) == sorted(saved[part])
        for key, value in saved[part].items():
            assert torch.equal(state["train"][part][key], value), key
    engine.load_state_dict(state["train"])
    loss = engine.step(rank_batches(STEPS, cfg, 0, 1), cfg.optim.lr).loss
    assert loss == after["loss"]
    for key, value in engine.model_parts[0].state_dict().items():
        assert torch.equal(value, after["weights"][key]), key


def _resume_split(rank: int, world: int, path: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """On each rank: a layout's engine loads the old checkpoint, takes the next step; the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cfg, engine = _engine(world, **overrides)
    state = {"train": engine.state_dict()}
    load_state(state, path, None)
    engine.load_state_dict(state["train"])
    loss = engine.step(rank_batches(STEPS, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr).loss
    full = get_model_state_dict(engine.model_parts[0], options=StateDictOptions(full_state_dict=True))
    return {"loss": loss, "weights": {k: v.detach().clone() for k, v in full.items()}}


@pytest.mark.parametrize(
    "world, overrides",
    [
        (2, {"parallel__tp": 2}),
        (4, {"parallel__tp": 2, "zero__stage": 3}),  # FSDP2 over TP: the weights' dim 0 split twice (_StridedShard)
    ],
    ids=["tp2", "zero3_dp2xtp2"],
)
def test_an_old_checkpoint_resumes_split_by_tp_and_fsdp(old_checkpoint, world: int, overrides: dict[str, Any]) -> None:
    """The gate and up shards each rank takes from the old tensor: the next step is the one-process run's."""
    path, _, after = old_checkpoint
    for got in run_distributed(_resume_split, world, str(path), overrides, timeout=180):
        assert got["loss"] == pytest.approx(after["loss"], rel=1e-5)
        assert sorted(got["weights"]) == sorted(after["weights"])
        for key, value in after["weights"].items():  # TP pads the vocabulary rows further (zeros)
            rows = value.shape[0]
            torch.testing.assert_close(got["weights"][key][:rows], value, rtol=1e-4, atol=1e-5, msg=key)
            assert not got["weights"][key][rows:].any(), key


def test_an_old_checkpoint_exports_to_hugging_face(old_checkpoint, tmp_path: Path) -> None:
    """export_hf reads the old tensors in today's names: gate_proj and up_proj are the saved gate and up."""
    from safetensors.torch import load_file

    from hpctrain.checkpoint.hf import export_hf
    from hpctrain.checkpoint.storage import Committed
    from hpctrain.records.fingerprint import fingerprint_of

    path, saved, _ = old_checkpoint
    cfg = make_cfg(1, **LLAMA)
    manifest = {"fingerprint": fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()}
    export_hf(Committed("old", STEPS, path, manifest), cfg.model, tmp_path / "hf")
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for i in range(cfg.model.n_layers):
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("proj", "down_proj")):
            assert torch.equal(
                hf[f"model.layers.{i}.mlp.{theirs}.weight"], saved["model"][f"layers.{i}.mlp.{ours}.weight"]
            )
    assert len(hf) == 2 + 9 * cfg.model.n_layers + 1  # embedding, head, final norm; 9 per layer
