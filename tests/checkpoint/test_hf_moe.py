"""Hugging Face export and import of the Mixture-of-Experts families (Mixtral, Qwen3-MoE), checked against
transformers itself as tests/checkpoint/test_hf.py checks the dense ones: runs trained in several layouts (expert
parallelism included) exported and loaded by MixtralForCausalLM / Qwen3MoeForCausalLM with hpctrain's logits,
save_pretrained's own files started from, config.json both ways, and what the HF classes cannot hold refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.checkpoint.hf import export_hf, open_hf, run_model_config
from hpctrain.checkpoint.inspect import find
from hpctrain.config.schema import ModelConfig
from hpctrain.models import registry
from hpctrain.models.family import Dims
from hpctrain.models.hf import HFMismatch, from_hf, hf_config, mismatches, shapes, to_hf
from hpctrain.models.hf_fields import model_fields
from hpctrain.train import loop
from tests.checkpoint.test_checkpoint import config
from tests.checkpoint.test_hf import (
    TOLERANCE,
    VOCAB,
    assert_starts_from_the_export,
    exported_logits_match,
    hpctrain_logits,
    relative_difference,
    start_from,
    tokens,
    trained_run,
)

transformers = pytest.importorskip("transformers")

# 4 experts of 32 (the dense width would be 96), each token through 2; grouped-query attention, 2 heads a group
EXPERTS = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32"]
MIXTRAL = [
    "model=llama_tiny",
    "model.arch=mixtral",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=96",
    *EXPERTS,
]
QWEN3_MOE = [
    "model=qwen3_tiny",
    "model.arch=qwen3_moe",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=32",
    "model.ffn_hidden=96",
    *EXPERTS,
    "model.moe.norm_topk_prob=false",
]  # Qwen3-MoE's own default: the top_k weights as softmax gave them
FAMILIES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def tiny(compose_cfg_module, tmp_path_factory) -> dict[str, Any]:
    """Each family's model config (composed once: composing takes most of a second)."""
    tmp = tmp_path_factory.mktemp("models")
    return {
        arch: loop.load_config(config(compose_cfg_module, tmp, 1, *VOCAB, *family)).model
        for arch, family in FAMILIES.items()
    }


def saved_by_transformers(m: Any, out: Path) -> Any:
    """transformers' model of hpctrain's config.json (seeded weights), saved in `out` by save_pretrained."""
    torch.manual_seed(0)
    made = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{k: v for k, v in hf_config(m).items() if k != "torch_dtype"})
    ).eval()
    made.save_pretrained(out)
    return made


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_config_json_round_trip_through_transformers(tiny: dict[str, Any], arch: str) -> None:
    """hpctrain's config.json, read by transformers and written back as save_pretrained does (num_experts
    becomes num_local_experts, rope_theta moves into rope_parameters), reads as the run's model."""
    m = tiny[arch]
    ours = hf_config(m)
    assert ours["architectures"] == [CLASSES[arch]] and ours["tie_word_embeddings"] is False
    assert mismatches(m, ours) == []
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in ours.items() if k != "torch_dtype"}).to_dict()
    assert mismatches(m, theirs) == []
    fields = model_fields(theirs)
    assert fields["moe"] == {
        "n_experts": 4,
        "top_k": 2,
        "expert_hidden": 32,
        "n_shared_experts": 0,
        "router": "softmax",
        "norm_topk_prob": arch == "mixtral",
        "n_groups": 1,
        "topk_groups": 1,
        "route_scale": 1.0,
        "balance_coef": 0.0,
    }
    assert fields["ffn_hidden"] == 32  # an MoE model's MLP width is its experts'
    differ = mismatches(OmegaConf.merge(m, {"moe": {"top_k": 1, "expert_hidden": 16}}), theirs)
    assert ("model.moe.top_k", 1, 2) in differ and ("model.moe.expert_hidden", 16, 32) in differ


# conf/model/<name>.yaml: its model's hub name, parameter count and config.json (the keys that decide the model)
PUBLISHED = {
    "mixtral_8x7b": (
        "mistralai/Mixtral-8x7B-v0.1",
        46_702_792_704,
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": 32000,
        },
    ),
    "qwen3_30b_a3b": (
        "Qwen/Qwen3-30B-A3B",
        30_532_122_624,
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_config_reads_as_its_model(compose_cfg, name: str) -> None:
    """The fields of the hub's config.json make a model of the published parameter count, hpctrain's model config
    of that name matches it, and the model's config.json says the same but for Qwen3-MoE's intermediate_size: the
    width of dense layers (mlp_only_layers), which it has none of and hpctrain's model cannot have."""
    hub, count, published = PUBLISHED[name]
    m = OmegaConf.merge(OmegaConf.structured(ModelConfig(name=hub)), model_fields(published))
    assert sum(math.prod(s) for s in registry.family_of(m).hf.weight_shapes(Dims.of(m)).values()) == count
    assert mismatches(m, published) == []
    assert mismatches(compose_cfg(f"model={name}").model, published) == []
    ours = hf_config(m, torch.bfloat16)
    same = {
        k: v for k, v in published.items() if not (k == "intermediate_size" and "moe_intermediate_size" in published)
    }
    assert {k: ours.get(k) for k in same} == same  # Qwen3-MoE's sliding_window (None) is not written


REFUSED = {
    "mixtral sliding window": ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
    "qwen3_moe sliding window": ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True"),
    "qwen3_moe dense layers": ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    "qwen3_moe sparse step": ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    "qwen3_moe no experts": ("qwen3_moe", {"num_experts": 0}, "no experts .* model.arch=qwen3"),
    "mixtral activation": ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_config_json_hpctrain_cannot_represent_is_refused_by_name(tiny: dict[str, Any], case: str) -> None:
    arch, change, message = REFUSED[case]
    hf = {**hf_config(tiny[arch]), **change}
    with pytest.raises(HFMismatch, match=message):
        model_fields(hf)


@pytest.mark.parametrize(
    "arch,change,message",
    [
        ("mixtral", {"norm_topk_prob": False}, "norm_topk_prob=False .*MixtralForCausalLM has only True"),
        ("qwen3_moe", {"n_shared_experts": 1}, "n_shared_experts=1"),
        ("mixtral", {"route_scale": 2.5}, "route_scale=2.5"),
        ("qwen3_moe", {"router": "sigmoid"}, "router='sigmoid'"),
    ],
)
def test_an_moe_the_hf_class_cannot_hold_is_not_exported(
    tiny: dict[str, Any], arch: str, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(HFMismatch, match=f"cannot be written as {CLASSES[arch]}: .*{message}"):
        hf_config(OmegaConf.merge(tiny[arch], {"moe": change}))


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_tensors_are_those_save_pretrained_writes(tiny: dict[str, Any], tmp_path: Path, arch: str) -> None:
    """transformers 5 fuses each layer's experts in memory (gate_up_proj [E, 2 f, h], gate first; down_proj
    [E, h, f]) and writes them one expert at a time: the files hold exactly the tensors hpctrain's table names,
    and the stacked weights are its fused ones."""
    from safetensors.torch import load_file

    m = tiny[arch]
    made = saved_by_transformers(m, tmp_path / "made")
    saved = load_file(tmp_path / "made" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in saved.items()} == registry.family_of(m).hf.weight_shapes(Dims.of(m))
    ours = from_hf(saved, m)
    experts = made.model.layers[1].mlp.experts
    assert torch.equal(
        torch.cat([ours["layers.1.mlp.experts.w_gate"], ours["layers.1.mlp.experts.w_up"]], dim=1),
        experts.gate_up_proj.detach(),
    )
    assert torch.equal(ours["layers.1.mlp.experts.w_down"], experts.down_proj.detach())
    assert torch.equal(ours["layers.1.mlp.router.weight"], made.model.layers[1].mlp.gate.weight.detach())
    back = to_hf(ours, m)
    assert sorted(back) == sorted(saved) and all(torch.equal(back[k], saved[k]) for k in saved)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_conversion_is_exact_both_ways_with_padding(tiny: dict[str, Any], arch: str) -> None:
    m = tiny[arch]
    gen = torch.Generator().manual_seed(1)
    state = {k: torch.randn(s, generator=gen) for k, s in shapes(m, rows=320).items()}
    for name in ("tok_emb.weight", "output.weight"):
        state[name][300:] = 0
    back = from_hf(to_hf(state, m), m, rows=320)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_a_missing_expert_is_named(tiny: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    m = tiny["mixtral"]
    saved_by_transformers(m, tmp_path / "made")
    weights = tmp_path / "made" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(HFMismatch, match=r"model.layers.1.block_sparse_moe.experts.3.w2.weight: missing"):
        open_hf(tmp_path / "made", m)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_login_node_checks_a_directory_save_pretrained_wrote(compose_cfg, tmp_path: Path, arch: str) -> None:
    """Without torch's model (hpctrain.checks.files: config.json and the safetensors headers): transformers'
    own directory passes, and a run with other experts is refused naming the keys."""
    from hpctrain.checks.runner import check_config
    from hpctrain.config.problems import ConfigError

    overrides = [*VOCAB, *FAMILIES[arch], f"run.root={tmp_path / 'runs'}"]
    m = compose_cfg(*overrides).model
    saved_by_transformers(m, tmp_path / "made")
    check_config(compose_cfg(*overrides, f"model.init_from={tmp_path / 'made'}"))
    with pytest.raises(ConfigError) as refused:
        check_config(
            compose_cfg(
                *overrides,
                f"model.init_from={tmp_path / 'made'}",
                "model.moe.n_experts=8",
                "model.moe.expert_hidden=16",
            )
        )
    assert "model.moe.n_experts: 8 here, 4 in config.json" in str(refused.value)
    assert "model.moe.expert_hidden: 16 here, 32 in config.json" in str(refused.value)


# ---------------------------------------------------------------- export

MOE_LAYOUTS = {
    "mixtral-1-process": ("mixtral", 1, []),
    "mixtral-tp2": ("mixtral", 2, ["parallel.tp=2"]),
    "mixtral-ep2": ("mixtral", 2, ["parallel.ep=2"]),
    "qwen3_moe-pp2": ("qwen3_moe", 2, ["parallel.pp=2"]),
    "qwen3_moe-ep2": ("qwen3_moe", 2, ["parallel.ep=2"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(MOE_LAYOUTS))
def test_moe_export_loads_in_transformers_with_the_same_logits(compose_cfg, tmp_path: Path, case: str) -> None:
    """Under EP 2 each rank trained 2 of the 4 experts of each layer: the export holds all 4."""
    arch, world, layout = MOE_LAYOUTS[case]
    cfg, run_dir = trained_run(compose_cfg, tmp_path, world, *FAMILIES[arch], *layout)
    out = tmp_path / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["num_experts_per_tok"]) == (arch, [CLASSES[arch]], 2)
    exported_logits_match(cfg, run_dir, out, case)


@pytest.mark.timeout(300)
def test_moe_export_import_export_round_trip(compose_cfg, tmp_path: Path) -> None:
    """Exported from EP 2, started from in TP 2 (vocabulary padded to 384 rows), exported again: same bytes."""
    _, run_dir = trained_run(compose_cfg, tmp_path / "a", 2, *QWEN3_MOE, "parallel.ep=2")
    out = tmp_path / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out)
    assert_starts_from_the_export(compose_cfg, tmp_path / "b", run_dir, out, 2, *QWEN3_MOE, "parallel.tp=2")


# ---------------------------------------------------------------- model.init_from

SAVED_LAYOUTS = {"mixtral-pp2": ("mixtral", ["parallel.pp=2"]), "qwen3_moe-ep2": ("qwen3_moe", ["parallel.ep=2"])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(SAVED_LAYOUTS))
def test_a_model_saved_by_transformers_starts_a_run_with_its_logits(compose_cfg, tmp_path: Path, case: str) -> None:
    """save_pretrained's own files (per-expert tensors): a 2-rank run starts from them and its model computes
    transformers' logits."""
    arch, layout = SAVED_LAYOUTS[case]
    overrides = [*VOCAB, *FAMILIES[arch], *layout]
    m = loop.load_config(config(compose_cfg, tmp_path, 2, *overrides)).model
    made = saved_by_transformers(m, tmp_path / "made")
    _, weights = start_from(compose_cfg, tmp_path, 2, tmp_path / "made", *overrides)
    assert not weights["tok_emb.weight"][300:].any()  # the run's vocabulary padding
    assert weights["layers.0.mlp.experts.w_gate"].shape == (4, 32, 64)  # all experts, whichever rank held them
    with torch.no_grad():
        diff = relative_difference(hpctrain_logits(m, weights), made(tokens()).logits)
    print(f"\n{case} saved by transformers, started from: relative logits difference {diff:.2e}")
    assert diff <= TOLERANCE
