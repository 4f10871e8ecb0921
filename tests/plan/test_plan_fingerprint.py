"""The checkpoint fingerprint's model shape knows the architecture (hpctrain.records.fingerprint), and manifests
written before it did still match their GPT runs. (Beside the planner's tests: the same model fields decide both.)"""

from __future__ import annotations

import json

from hpctrain.records.fingerprint import (
    Fingerprint,
    ModelShape,
    fingerprint_of,
    upgrade_fingerprint,
)

OLD_FIELDS = ("n_layers", "d_model", "n_heads", "vocab_size", "context", "ffn_mult")


def _saved(cfg) -> dict:
    return json.loads(json.dumps(fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict()))  # as a manifest holds it


def test_a_gpt_run_matches_manifests_written_before_the_arch(compose_cfg) -> None:
    cfg = compose_cfg()
    saved = _saved(cfg)
    assert {k: saved["model"][k] for k in ("arch", "n_kv_heads", "ffn_hidden")} == {
        "arch": "gpt",
        "n_kv_heads": cfg.model.n_heads,
        "ffn_hidden": 4 * cfg.model.d_model,
    }
    named = {**saved, "model": {k: saved["model"][k] for k in OLD_FIELDS}}  # named, without the new fields
    positional = {**saved, "model": [saved["model"][k] for k in OLD_FIELDS]}
    assert upgrade_fingerprint(named) == upgrade_fingerprint(positional) == upgrade_fingerprint(saved) == saved
    assert Fingerprint.from_dict(named) == Fingerprint.from_dict(saved)


def test_the_archs_and_their_shapes_differ(compose_cfg) -> None:
    tiny = _saved(compose_cfg("model=llama_tiny"))
    assert tiny["model"]["arch"] == "llama" and tiny["model"]["n_kv_heads"] == 2 and tiny["model"]["ffn_hidden"] == 352
    as_gpt = _saved(compose_cfg("model=llama_tiny", "model.arch=gpt", "model.n_kv_heads=0", "model.ffn_hidden=0"))
    assert as_gpt["model"] != tiny["model"] and as_gpt["model"]["arch"] == "gpt"
    for override in ("model.n_kv_heads=4", "model.ffn_hidden=384"):
        assert _saved(compose_cfg("model=llama_tiny", override))["model"] != tiny["model"], override
    # the same weights spelled two ways: one fingerprint
    assert (
        _saved(compose_cfg("model=llama_tiny", "model.n_kv_heads=0", "model.n_heads=4"))["model"]
        == _saved(compose_cfg("model=llama_tiny", "model.n_kv_heads=4"))["model"]
    )
    assert Fingerprint.from_dict(tiny).model == ModelShape(4, 128, 4, 256, 256, 4, "llama", 2, 352)
