"""The plan's per-stage parameter counts (closed form, no torch) against the model built on the meta device."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hpctrain.config.layout import Layout, lighter_ends
from hpctrain.config.rules import layer_split
from hpctrain.config.schema import Config
from hpctrain.models.params import built_dims, padded_vocab, param_count, stage_param_counts, tp_local_numel
from hpctrain.plan.report import stage_counts
from tests.plan.shapes import GPT


def _cfg(arch: str, tp: int, pad_multiple: int = 8, vocab: int = 250) -> object:
    """A small GPT or Llama with 8 layers (room for pp x virtual stages up to 8); vocab 250 with no padding splits
    unevenly. The Llama has grouped-query attention (8 query heads, 4 key/value heads) and a SwiGLU MLP of 80."""
    model = {
        "name": "t",
        "n_layers": 8,
        "d_model": 48,
        "n_heads": 4,
        "vocab_size": vocab,
        "context": 40,
        "vocab_pad_multiple": pad_multiple,
    }
    if arch == "llama":
        model.update(arch="llama", n_heads=8, n_kv_heads=4, ffn_hidden=80)
    return OmegaConf.merge(OmegaConf.structured(Config), {"model": model, "parallel": {"tp": tp}})


LAYOUTS = [  # tp, pp, virtual stages, schedule
    (1, 1, 1, "1f1b"),
    (2, 1, 1, "1f1b"),
    (4, 1, 1, "1f1b"),
    (1, 2, 1, "1f1b"),
    (2, 2, 1, "gpipe"),
    (4, 4, 1, "1f1b"),
    (2, 2, 2, "interleaved_1f1b"),
    (1, 4, 2, "interleaved_1f1b"),
    (4, 2, 4, "looped_bfs"),
    (2, 2, 2, "zbv"),
    (1, 4, 2, "zbv"),
]


@pytest.mark.parametrize("tp,pp,v,schedule", LAYOUTS)
@pytest.mark.parametrize("pad", [8, 1])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_closed_form_matches_the_meta_device_model(
    tp: int, pp: int, v: int, schedule: str, pad: int, arch: str
) -> None:
    from hpctrain.parallel.stages import meta_stage_counts

    cfg = _cfg(arch, tp, pad)
    whole, shard = meta_stage_counts(cfg, (cfg.model.n_layers // (pp * v),) * (pp * v), tp)
    assert stage_param_counts(cfg.model, (cfg.model.n_layers // (pp * v),) * (pp * v), tp) == whole
    assert stage_param_counts(cfg.model, (cfg.model.n_layers // (pp * v),) * (pp * v), tp, per_gpu=True) == shard
    plan = stage_counts(cfg.model, Layout(dp=1, tp=tp, pp=pp, virtual_stages=v, schedule=schedule))
    assert plan["params_per_stage"] == whole
    assert sum(plan["params_per_gpu_before_zero"]) == sum(shard)


def test_zbv_puts_the_first_and_the_last_stage_on_rank_0() -> None:
    """The V: rank r holds stages r and 2p - 1 - r, so rank 0 keeps the embedding and its tied copy."""
    cfg = _cfg("gpt", 2)
    plan = stage_counts(cfg.model, Layout(dp=1, tp=2, pp=2, virtual_stages=2, schedule="zbv"))
    assert plan["stages_of_rank"] == [[0, 3], [1, 2]]
    shard = stage_param_counts(cfg.model, (cfg.model.n_layers // 4,) * 4, 2, per_gpu=True)
    assert plan["params_per_gpu_before_zero"] == [shard[0] + shard[3], shard[1] + shard[2]]
    assert plan["params_per_gpu_before_zero"][0] > plan["params_per_gpu_before_zero"][1]


def test_one_stage_holds_the_whole_model_once() -> None:
    """Without PP the tied head adds nothing: the count is the model's, with the padded rows."""
    cfg = _cfg("gpt", 1, pad_multiple=64)
    m = cfg.model
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple)
    assert rows == 256 and stage_param_counts(m, (m.n_layers,)) == [param_count(*built_dims(m), embedding_rows=rows)]


def test_llama_stages_hold_the_embedding_first_and_the_head_last() -> None:
    """Untied: the first stage holds tok_emb, the last norm_f and output, each once (no embedding copy)."""
    cfg = _cfg("llama", 1, pad_multiple=64)
    block = 48 * (48 + 2 * 24) + 48 * 48 + 3 * 48 * 80 + 2 * 48  # QKV with 4 of 8 heads for K and V, SwiGLU
    assert stage_param_counts(cfg.model, (4, 4)) == [4 * block + 256 * 48, 4 * block + 48 + 256 * 48]
    assert stage_param_counts(cfg.model, (8,)) == [8 * block + 2 * 256 * 48 + 48]


def test_uneven_tp_split_counts_the_largest_shard() -> None:
    assert tp_local_numel(GPT, "tok_emb.weight", (250, 48), 4) == 63 * 48
    assert tp_local_numel(GPT, "layers.0.attn.proj.weight", (48, 48), 4) == 48 * 12
    assert tp_local_numel(GPT, "layers.0.norm1.weight", (48,), 4) == 48


def test_uneven_stages_split_as_set() -> None:
    """The stages set take their layers, the others share the rest evenly; a cut that cannot be made is None."""
    assert layer_split(126, 16, 7, 7) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B as Meta cut it
    assert layer_split(8, 2, 3) == (3, 5) and layer_split(8, 2, 0, 6) == (2, 6)
    assert layer_split(8, 4, 1, 1) == (1, 3, 3, 1)
    assert layer_split(8, 2, 3, 6) is None and layer_split(8, 4, 1) is None and layer_split(8, 1, 3) is None
    assert layer_split(8, 2, 8) is None  # the last stage would hold nothing
    ends = [lighter_ends(126, 16), lighter_ends(94, 32), lighter_ends(96, 8), lighter_ends(126, 128)]
    assert ends == [7, 2, None, None]


@pytest.mark.parametrize(
    "tp,pp,v,first,last,schedule",
    [(2, 2, 1, 3, 0, "1f1b"), (1, 2, 2, 1, 1, "interleaved_1f1b"), (2, 3, 1, 2, 2, "1f1b"), (1, 2, 2, 1, 1, "zbv")],
)
def test_uneven_closed_form_matches_the_meta_device_model(
    tp: int, pp: int, v: int, first: int, last: int, schedule: str
) -> None:
    """The planner's per-stage and per-rank counts of an uneven cut equal the meta-device model cut the same way;
    each rank's layers are its chunks' (zbv: rank 0 holds the first and the last chunk)."""
    from hpctrain.parallel.stages import meta_stage_counts

    cfg = _cfg("llama", tp)
    lay = Layout(
        dp=1, tp=tp, pp=pp, virtual_stages=v, schedule=schedule, first_stage_layers=first, last_stage_layers=last
    )
    split = lay.layer_split(8)
    whole, shard = meta_stage_counts(cfg, split, tp)
    assert stage_param_counts(cfg.model, split, tp) == whole
    assert stage_param_counts(cfg.model, split, tp, per_gpu=True) == shard
    plan = stage_counts(cfg.model, lay)
    assert plan["layers_per_stage"] == list(split) and plan["params_per_stage"] == whole
    assert plan["params_per_gpu_before_zero"] == [sum(shard[s] for s in lay.stages_of(r)) for r in range(pp)]
    assert sum(lay.layers_on(8, r) for r in range(pp)) == 8
