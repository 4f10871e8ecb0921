"""The checkpoint fingerprint's model is the family and every field of its Dims (hpctrain.records.fingerprint, from
hpctrain.models.family.Dims, the one owner of a model's shape): each field changes it, and a resume that changes one
is refused on the login node and by the job, forced or not. Manifests written before still match their runs.
(Beside the planner's tests: the same Dims decide both.)"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from hpctrain.models.family import Dims
from hpctrain.models.params import built_dims
from hpctrain.records.fingerprint import (
    EXPERTS,
    Fingerprint,
    ModelFingerprint,
    config_key,
    fingerprint_of,
    upgrade_fingerprint,
)

OLD_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "context", "ffn_mult")


def _saved(cfg) -> dict:
    return json.loads(json.dumps(fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()))  # as a manifest holds it


@pytest.mark.parametrize("field", [f.name for f in fields(Dims)])
def test_every_dims_field_changes_the_fingerprint_and_a_resume_refuses_it(
    compose_cfg, field: str, tmp_path: Path
) -> None:
    """For each field of Dims (a field added later is a case here without a line): the config key that sets it
    (`config_key`) changes that field of the model's Dims, the fingerprint's model differs, and a resume with it is a
    shape change: the login node refuses the key even with checkpoint.force_resume=true, and so does the job's
    checkpoint manager. moe_tiny is a Mixture of Experts, so its expert fields are live (8 experts against 16)."""
    from hpctrain.checkpoint.manager import CheckpointError, CheckpointManager
    from hpctrain.checkpoint.storage import Committed
    from hpctrain.launch.resume import allowed

    base = compose_cfg("model=moe_tiny")
    before = getattr(built_dims(base.model)[1], field)
    key, value = config_key(field), 2 * before or 1
    changed = compose_cfg("model=moe_tiny", f"{key}={value}", "checkpoint.force_resume=true")
    assert getattr(built_dims(changed.model)[1], field) == value, key
    assert _saved(changed)["model"] != _saved(base)["model"] and _saved(changed)["model"][field] == value
    assert not allowed(key, force=True), key  # refused on the login node, forced or not
    manager = CheckpointManager(changed.checkpoint, 0.0, tmp_path, "r", 0, 1, _saved(changed))
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        manager._check_fingerprint(Committed("disk", 1, tmp_path / "step_00000001", {"fingerprint": _saved(base)}))


def test_eight_experts_and_sixteen_differ(compose_cfg) -> None:
    """The issue's case: before the experts were fingerprinted, these two runs compared equal."""
    eight, sixteen = compose_cfg("model=moe_tiny"), compose_cfg("model=moe_tiny", "model.moe.n_experts=16")
    assert _saved(eight)["model"]["n_experts"] == 8 and _saved(sixteen)["model"]["n_experts"] == 16


def test_a_gpt_run_matches_manifests_written_before_the_arch(compose_cfg) -> None:
    cfg = compose_cfg()
    saved = _saved(cfg)
    m = cfg.model
    assert saved["model"] == {
        "arch": "gpt",
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "kv_heads": m.n_heads,
        "ffn_hidden": 4 * m.d_model,
        "vocab_size": m.vocab_size,
        "context": m.context,
        "head_dim": m.d_model // m.n_heads,
        "n_experts": 0,
        "top_k": 0,
        "expert_hidden": 4 * m.d_model,  # a dense model's: its MLP
        "n_shared_experts": 0,
    }
    old = {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads}
    old |= {"vocab_size": m.vocab_size, "context": m.context, "ffn_mult": m.ffn_mult}
    named = {**saved, "model": old}  # named, without the fields added since
    positional = {**saved, "model": [old[k] for k in OLD_FIELDS]}
    with_arch = {**saved, "model": {**old, "arch": "gpt", "n_kv_heads": m.n_heads, "ffn_hidden": 4 * m.d_model}}
    assert upgrade_fingerprint(named) == upgrade_fingerprint(positional) == upgrade_fingerprint(with_arch) == saved
    assert upgrade_fingerprint(saved) == saved
    assert Fingerprint.from_dict(named) == Fingerprint.from_dict(saved) == Fingerprint.from_dict(positional)


def test_a_llama_manifest_of_the_arch_era_matches_its_run(compose_cfg) -> None:
    """Named with `n_kv_heads`, `ffn_mult` beside `ffn_hidden`, and `head_dim` (the form before the Dims)."""
    cfg = compose_cfg("model=llama_tiny")
    saved, m = _saved(cfg), cfg.model
    old = {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "vocab_size": m.vocab_size}
    old |= {"context": m.context, "ffn_mult": m.ffn_mult, "arch": "llama", "n_kv_heads": 2, "ffn_hidden": 352}
    assert upgrade_fingerprint({**saved, "model": {**old, "head_dim": m.d_model // m.n_heads}}) == saved
    assert upgrade_fingerprint({**saved, "model": old}) == saved  # before head_dim: d_model / n_heads
    assert upgrade_fingerprint({**saved, "model": {**old, "n_kv_heads": 4}}) != saved


def test_an_moe_manifest_from_before_the_experts_takes_them_from_the_run(compose_cfg) -> None:
    """Manifests never recorded the experts: a dense family's read as dense; an MoE family's cannot tell, so the
    run's own experts stand in (the checkpoint's tensor shapes are still held to the run's: tests/checkpoint)."""
    cfg = compose_cfg("model=moe_tiny")
    ours = upgrade_fingerprint(_saved(cfg))
    old = {**ours, "model": {k: v for k, v in ours["model"].items() if k not in EXPERTS}}
    assert upgrade_fingerprint(old, ours) == ours
    assert upgrade_fingerprint(old)["model"]["n_experts"] == 0  # alone: read as dense, so not this run
    llama = compose_cfg("model=llama_tiny")
    dense = upgrade_fingerprint(_saved(llama))
    assert upgrade_fingerprint({**dense, "model": {**dense["model"], "arch": "qwen3_moe"}}, ours) != ours


def test_the_archs_and_their_shapes_differ(compose_cfg) -> None:
    tiny = _saved(compose_cfg("model=llama_tiny"))
    assert tiny["model"]["arch"] == "llama" and tiny["model"]["kv_heads"] == 2 and tiny["model"]["ffn_hidden"] == 352
    as_gpt = _saved(compose_cfg("model=llama_tiny", "model.arch=gpt", "model.n_kv_heads=0", "model.ffn_hidden=0"))
    assert as_gpt["model"] != tiny["model"] and as_gpt["model"]["arch"] == "gpt"
    # the same weights spelled two ways: one fingerprint
    assert (
        _saved(compose_cfg("model=llama_tiny", "model.n_kv_heads=0", "model.n_heads=4"))["model"]
        == _saved(compose_cfg("model=llama_tiny", "model.n_kv_heads=4"))["model"]
    )
    assert Fingerprint.from_dict(tiny).model == ModelFingerprint("llama", Dims(4, 128, 4, 2, 352, 256, 256))


def test_a_field_this_code_does_not_know_is_kept_and_differs(compose_cfg) -> None:
    """A manifest a newer hpctrain wrote, with a model field this one lacks: kept, so the comparison refuses it."""
    saved = _saved(compose_cfg())
    newer = {**saved, "model": {**saved["model"], "n_mtp_heads": 2}}
    assert upgrade_fingerprint(newer)["model"]["n_mtp_heads"] == 2 and upgrade_fingerprint(newer) != saved
    assert upgrade_fingerprint({"model": "other"}) == {"model": "other"}
