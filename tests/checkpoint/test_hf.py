"""Hugging Face export and import, checked against transformers itself: runs trained by the real harness in
several layouts, exported, loaded with AutoModelForCausalLM (logits equal hpctrain's), and loaded back into new
runs (model.init_from) bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.checkpoint.hf import export_hf, open_hf, run_model_config, save_hf
from hpctrain.checkpoint.inspect import consolidated_model, find
from hpctrain.config.layout import resolve_layout
from hpctrain.distributed.environment import DistEnv
from hpctrain.models.hf import VOCAB_ROWS, HFMismatch, from_hf, hf_config, mismatches, shapes, to_hf
from hpctrain.parallel.engine import build_model
from hpctrain.train import loop
from tests.checkpoint.test_checkpoint import config, tiers
from tests.checkpoint.training import train
from tests.distributed_harness import DistributedTestError, run_distributed

transformers = pytest.importorskip("transformers")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "checkpoint.py"
VOCAB = ["model.vocab_size=300"]  # not a multiple of 64: the padding rows are dropped on export, added on import
LLAMA = [
    "model=llama_tiny",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=96",
]  # grouped-query attention: 2 query heads per key/value head
QWEN3 = [
    "model=qwen3_tiny",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=32",
    "model.ffn_hidden=96",
]  # per-head q/k norms, heads 2 x wider than d_model / n_heads
ROPE_SCALED = ["model.rope.scaling_factor=8", "model.rope.original_context=64"]  # Llama 3's, felt within 32 tokens
TOLERANCE = 1e-4  # relative logits difference, fp32
SMALL_SHARDS = 200_000  # bytes: the tiny models' weights (~0.5 MB) go into several files with an index


def trained_run(
    compose_cfg, tmp_path: Path, world: int, *overrides: str, steps: int = 3
) -> tuple[dict[str, Any], Path]:
    """A run of `steps` steps through the real per-task training function, with its config.yaml."""
    cfg = config(
        compose_cfg, tmp_path, world, f"train.max_steps={steps}", *tiers(tmp_path, 100, 100, 100), *VOCAB, *overrides
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    train(world, cfg, run_dir)
    return cfg, run_dir


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


def hpctrain_logits(m: Any, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """hpctrain's own model (model config `m`'s arch) holding `state` (vocabulary padded or not), on `tokens()`."""
    m = OmegaConf.merge(m, {"vocab_pad_multiple": 1})
    model = build_model(m, 0, torch.device("cpu")).eval()
    model.load_state_dict({k: v[: m.vocab_size] if k in VOCAB_ROWS else v for k, v in state.items()})
    with torch.no_grad():
        return model(tokens())


def hf_logits(out: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        return model(tokens()).logits


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def exported_logits_match(cfg: dict[str, Any], run_dir: Path, out: Path, label: str) -> None:
    """hpctrain's logits from the checkpoint vs transformers' from the export: within TOLERANCE."""
    ours = hpctrain_logits(loop.load_config(cfg).model, consolidated_model(find(run_dir)))
    theirs = hf_logits(out)
    assert theirs.dtype == torch.float32
    diff = relative_difference(ours, theirs)
    print(f"\n{label}: relative logits difference hpctrain vs transformers {diff:.2e}")
    assert diff <= TOLERANCE, (label, diff)


# ---------------------------------------------------------------- GPT-2


@pytest.fixture(scope="module")
def gpt_export(compose_cfg_module, tmp_path_factory) -> tuple[dict[str, Any], Path, Path]:
    """A GPT trained 3 steps on one process and exported in several safetensors files: (config, run, export)."""
    tmp = tmp_path_factory.mktemp("gpt")
    cfg, run_dir = trained_run(compose_cfg_module, tmp, 1)
    out = tmp / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out, SMALL_SHARDS)
    return cfg, run_dir, out


@pytest.mark.timeout(300)
def test_gpt2_export_in_shards_loads_in_transformers_with_the_same_logits(gpt_export) -> None:
    cfg, run_dir, out = gpt_export
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).stat().st_size <= SMALL_SHARDS + 10_000 for f in files)
    assert "lm_head.weight" not in index["weight_map"]  # tied: HF ties it to wte on load
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 300
    exported_logits_match(cfg, run_dir, out, "gpt2 1 process (sharded files)")


@pytest.mark.timeout(300)
def test_gpt2_export_from_tp2_with_the_tool(compose_cfg, tmp_path: Path) -> None:
    """TP pads the vocabulary to 384 rows here: the tool's export holds the 300 real ones."""
    cfg, run_dir = trained_run(compose_cfg, tmp_path, 2, "parallel.tp=2")
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, str(TOOL), "export", str(run_dir), str(out), "--format", "hf"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    exported_logits_match(cfg, run_dir, out, "gpt2 tp2 (tool)")
    again = subprocess.run(
        [sys.executable, str(TOOL), "export", str(run_dir), str(out), "--format", "hf"], capture_output=True, text=True
    )
    assert again.returncode == 2 and "not empty" in again.stderr


# ---------------------------------------------------------------- Llama

LLAMA_LAYOUTS = {
    "1-process-rope-scaled": (1, ROPE_SCALED),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2-rope-scaled": (2, ["parallel.pp=2", *ROPE_SCALED]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(LLAMA_LAYOUTS))
def test_llama_export_loads_in_transformers_with_the_same_logits(compose_cfg, tmp_path: Path, case: str) -> None:
    world, layout = LLAMA_LAYOUTS[case]
    cfg, run_dir = trained_run(compose_cfg, tmp_path, world, *LLAMA, *layout)
    out = tmp_path / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out)
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_key_value_heads"] == 2 and hf["tie_word_embeddings"] is False
    exported_logits_match(cfg, run_dir, out, f"llama {case}")
    if ROPE_SCALED[0] in layout:  # the scaling matters here: without it transformers computes something else
        assert hf["rope_scaling"]["rope_type"] == "llama3"
        unscaled = tmp_path / "unscaled"
        shutil.copytree(out, unscaled)
        (unscaled / "config.json").write_text(json.dumps({**hf, "rope_scaling": None}))
        plain = relative_difference(
            hpctrain_logits(loop.load_config(cfg).model, consolidated_model(find(run_dir))), hf_logits(unscaled)
        )
        print(f"llama {case}: the same weights without the RoPE scaling differ by {plain:.2e}")
        assert plain > 10 * TOLERANCE


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["1-process", "tp2"])
def test_qwen3_export_loads_in_transformers_with_the_same_logits(compose_cfg, tmp_path: Path, case: str) -> None:
    """Qwen3ForCausalLM from a run trained with TP 2: each rank held one key/value group with its 2 query heads
    of 32 (Q 128 wide in a 64-wide model), and the per-head norms whole."""
    cfg, run_dir = trained_run(
        compose_cfg, tmp_path, 2 if case == "tp2" else 1, *QWEN3, *(["parallel.tp=2"] if case == "tp2" else [])
    )
    out = tmp_path / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    exported_logits_match(cfg, run_dir, out, f"qwen3 {case}")


# ---------------------------------------------------------------- model.init_from


def _step0_weights(rank: int, world: int, config: dict[str, Any], run_dir: str) -> tuple[int, dict[str, Any]]:
    """On each rank: the training loop's own start-up (`_resume`), then the full weights of this rank's parts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cfg = loop.load_config(config)
    env = DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 0, "localhost", "test")
    engine, _, step, _ = loop._resume(cfg, resolve_layout(cfg), Path(run_dir), env, torch.device("cpu"), {})
    weights: dict[str, torch.Tensor] = {}
    for part in engine.model_parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: v.detach().clone() for k, v in full.items()})
    return step, weights


def start_from(compose_cfg, tmp_path: Path, world: int, out: Path, *overrides: str) -> tuple[Any, dict]:
    """A new run's model config and its step-0 weights (merged over the ranks), started from `out`."""
    cfg = config(
        compose_cfg, tmp_path, world, *tiers(tmp_path, 100, 100, 100), *VOCAB, f"model.init_from={out}", *overrides
    )
    results = run_distributed(_step0_weights, world, cfg, str(tmp_path / "run"), timeout=120)
    assert all(step == 0 for step, _ in results)
    return loop.load_config(cfg).model, {k: v for _, w in results for k, v in w.items()}


def assert_starts_from_the_export(
    compose_cfg, tmp_path: Path, run_dir: Path, out: Path, world: int, *overrides: str
) -> None:
    """Step-0 weights = those of the checkpoint `out` was exported from (padding rows zero); exported again, they
    are the same bytes as `out`."""
    m, weights = start_from(compose_cfg, tmp_path, world, out, *overrides)
    exported = consolidated_model(find(run_dir))
    assert sorted(weights) == sorted(exported)
    for name, value in weights.items():
        rows = exported[name].shape[0]
        assert torch.equal(value[:rows], exported[name]), name
        assert not value[rows:].any(), name  # the layout's vocabulary padding
    again = tmp_path / "again"
    shards = {p.name for p in out.iterdir()}
    save_hf(weights, m, again, SMALL_SHARDS if "model.safetensors.index.json" in shards else 5 * 10**9)
    assert sorted(p.name for p in again.iterdir()) == sorted(shards)
    for name in shards:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


INIT_LAYOUTS = {"pp2": (2, ["parallel.pp=2"]), "dp2-zero3": (2, ["zero=stage3"])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(INIT_LAYOUTS))
def test_gpt2_init_from_starts_from_the_export_in_any_layout(
    compose_cfg, tmp_path: Path, gpt_export, case: str
) -> None:
    world, layout = INIT_LAYOUTS[case]
    _, run_dir, out = gpt_export
    assert_starts_from_the_export(compose_cfg, tmp_path, run_dir, out, world, *layout)


@pytest.mark.timeout(300)
def test_llama_export_import_export_round_trip(compose_cfg, tmp_path: Path) -> None:
    """Exported from pp2, started from in tp2 (vocabulary padded to 384 rows), exported again: same bytes."""
    _, run_dir = trained_run(compose_cfg, tmp_path / "a", 2, *LLAMA, *ROPE_SCALED, "parallel.pp=2")
    out = tmp_path / "hf"
    export_hf(find(run_dir), run_model_config(run_dir), out)
    assert_starts_from_the_export(compose_cfg, tmp_path / "b", run_dir, out, 2, *LLAMA, *ROPE_SCALED, "parallel.tp=2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["gpt2", "llama-tied", "qwen3-tied"])
def test_a_model_saved_by_transformers_starts_a_run_with_its_logits(compose_cfg, tmp_path: Path, arch: str) -> None:
    """save_pretrained's own files (a Llama with its head tied to the embedding, as Llama 3.2 1B; a Qwen3 tied as
    Qwen3-0.6B to 4B are): a pp2 run starts from them and its model computes transformers' logits."""
    family = {"llama": LLAMA, "qwen3": QWEN3}.get(arch.split("-")[0], [])
    overrides = [*VOCAB, "parallel.pp=2", *family]
    m = loop.load_config(config(compose_cfg, tmp_path, 2, *overrides)).model
    fields = {k: v for k, v in hf_config(m).items() if k != "torch_dtype"}
    hf_cfg = transformers.AutoConfig.for_model(
        **{**fields, "tie_word_embeddings": fields["tie_word_embeddings"] or "tied" in arch}
    )
    torch.manual_seed(0)
    made = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    made.save_pretrained(tmp_path / "made")
    _, weights = start_from(compose_cfg, tmp_path, 2, tmp_path / "made", *overrides)
    assert not weights["tok_emb.weight"][300:].any()  # the run's vocabulary padding
    if "tied" in arch:
        assert torch.equal(weights["output.weight"], weights["tok_emb.weight"])
    with torch.no_grad():
        diff = relative_difference(hpctrain_logits(m, weights), made(tokens()).logits)
    print(f"\n{arch} saved by transformers, started from in pp2: relative logits difference {diff:.2e}")
    assert diff <= TOLERANCE


def test_a_bare_gpt2model_directory_reads_as_the_hub_gpt2_does(compose_cfg, tmp_path: Path) -> None:
    """The hub's gpt2 holds GPT2Model's weights (h.0..., wte): the same tensors as the full model's."""
    m = loop.load_config(config(compose_cfg, tmp_path, 1, *VOCAB)).model
    made = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{k: v for k, v in hf_config(m).items() if k != "torch_dtype"})
    )
    made.transformer.save_pretrained(tmp_path / "bare")
    weights, _ = open_hf(tmp_path / "bare", m)
    assert "transformer.h.0.attn.c_attn.weight" in weights
    ours = from_hf(weights, m)
    assert torch.equal(ours["tok_emb.weight"], made.transformer.wte.weight.detach())
    assert torch.equal(ours["layers.1.mlp.fc.weight"], made.transformer.h[1].mlp.c_fc.weight.detach().t())


def test_init_from_refuses_another_shape_with_the_keys_and_the_fix(compose_cfg, tmp_path: Path, gpt_export) -> None:
    out = gpt_export[2]
    cfg = config(
        compose_cfg,
        tmp_path,
        1,
        "train.max_steps=1",
        *tiers(tmp_path, 100, 100, 100),
        *VOCAB,
        "model.n_layers=3",
        f"model.init_from={out}",
    )
    with pytest.raises(DistributedTestError) as failed:  # the real run fails at start-up, before any step
        train(1, cfg, tmp_path / "run", timeout=120)
    message = str(failed.value)
    assert "HFMismatch" in message and "model.n_layers: the run's config has 3" in message, message[-3000:]
    assert "has 2" in message and "Fix: set model.n_layers=2" in message


def test_a_gpt2_directory_does_not_load_into_a_llama(compose_cfg, tmp_path: Path, gpt_export) -> None:
    m = loop.load_config(config(compose_cfg, tmp_path, 1, *VOCAB, *LLAMA)).model
    with pytest.raises(HFMismatch, match=r"model.arch: the run's config has 'llama', .* has 'gpt'") as failed:
        open_hf(gpt_export[2], m)
    assert "Fix: set model.arch=gpt" in str(failed.value)


def test_weights_that_disagree_with_their_config_json_are_named(compose_cfg, tmp_path: Path, gpt_export) -> None:
    from safetensors.torch import load_file, save_file

    cfg, _, out = gpt_export
    m = loop.load_config(cfg).model
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    first = broken / min(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    tensors = load_file(first)
    name = next(iter(tensors))
    tensors[name] = tensors[name][..., :-1].contiguous()
    save_file(tensors, first, metadata={"format": "pt"})
    with pytest.raises(HFMismatch, match=rf"{name}: shape .* the config wants"):
        open_hf(broken, m)


def test_pickled_weights_are_never_read(compose_cfg, tmp_path: Path, gpt_export) -> None:
    cfg, _, out = gpt_export
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(out / "config.json", pickled / "config.json")
    torch.save({"transformer.wte.weight": torch.zeros(300, 64)}, pickled / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin: pickles are never read"):
        open_hf(pickled, loop.load_config(cfg).model)


# ---------------------------------------------------------------- configs


def test_llama3_8b_config_is_the_published_one(compose_cfg) -> None:
    """conf/model/llama3_8b.yaml <-> meta-llama/Llama-3.1-8B's config.json (the context is hpctrain's training
    length, not HF's 128k maximum, and is not compared)."""
    published = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    m = compose_cfg("model=llama3_8b").model
    assert mismatches(m, published) == []
    ours = hf_config(m, torch.bfloat16)
    assert {k: ours[k] for k in published if k != "max_position_embeddings"} == {
        k: v for k, v in published.items() if k != "max_position_embeddings"
    }
    mismatched = mismatches(compose_cfg("model=llama3_8b", "model.rope.scaling_factor=0").model, published)
    assert ("model.rope.scaling_factor", 0.0, 8.0) in mismatched


def test_conversion_is_exact_both_ways_with_padding(compose_cfg) -> None:
    """hpctrain -> HF -> hpctrain gives the same tensors, padding rows back as zeros, for both architectures."""
    for overrides in ([], LLAMA):
        m = compose_cfg(*VOCAB, "model.n_layers=2", "model.d_model=64", "model.n_heads=4", *overrides).model
        gen = torch.Generator().manual_seed(1)
        state = {k: torch.randn(s, generator=gen) for k, s in shapes(m, rows=320).items()}
        for name in ("tok_emb.weight", "output.weight"):
            if name in state:
                state[name][300:] = 0
        back = from_hf(to_hf(state, m), m, rows=320)
        assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
