"""Validation of the planner's value types."""

from dataclasses import replace

import pytest

from hpctrain.models import registry
from hpctrain.models.family import Dims
from hpctrain.models.params import param_count
from hpctrain.plan.types import KNOWN_HARDWARE, Layout, ModelShape, hardware
from tests.plan.shapes import dims, gpt, shape


def test_model_params_come_from_param_count():
    m = gpt(96, 12288, 96, 2048, 50257)
    assert m.params == param_count(registry.get("gpt"), m.dims) == 174_604_259_328
    assert m.dims.ffn_hidden == 4 * 12288
    untied = shape("llama", 2, 64, 4, 32, 100, ffn_hidden=100)
    assert not untied.tied_embeddings and untied.params == param_count(registry.get("llama"), untied.dims)


def test_a_config_s_model_is_its_family_and_dims(compose_cfg):
    """ModelShape.of holds the config's Dims (hpctrain.models.family, the one owner of the shape) and only what is
    not the shape beside them; a key the family does not build (GPT's key/value groups) is not in it."""
    cfg = compose_cfg("model=moe_tiny", "model.dropout=0.1")
    m = ModelShape.of(cfg.model, 128)
    assert (m.family.name, m.dims, m.seq_len) == ("qwen3_moe", Dims.of(cfg.model), 128)
    assert (m.vocab_pad_multiple, m.dropout) == (cfg.model.vocab_pad_multiple, 0.1)
    gpt_cfg = compose_cfg("model.n_kv_heads=2")  # refused by the family's checks; the planner sees n_heads
    assert ModelShape.of(gpt_cfg.model, 64).dims.kv_heads == gpt_cfg.model.n_heads


def test_model_rejects_bad_heads():
    with pytest.raises(ValueError):
        gpt(2, 65, 4, 32, 100)
    assert shape("qwen3", 2, 65, 4, 32, 100, head_dim=32).dims.q_dim == 128  # a head width of its own: no rule
    with pytest.raises(ValueError, match="grouped-query"):
        gpt(2, 64, 4, 32, 100, kv_heads=2)
    with pytest.raises(ValueError, match="Mixture of Experts"):
        ModelShape(registry.get("mixtral"), dims(64, 4, vocab_size=100), 32)
    with pytest.raises(ValueError, match="top_k"):
        ModelShape(registry.get("mixtral"), dims(64, 4, vocab_size=100, n_experts=4, top_k=5), 32)
    with pytest.raises(ValueError, match="seq_len"):
        replace(gpt(2, 64, 4, 32, 100), seq_len=0)


def test_layout_batch_arithmetic():
    lay = Layout(dp=64, tp=8, pp=8, micro_batch=4, grad_accum=12, zero_stage=3, dp_replicate=8)
    assert lay.global_batch == 3072
    assert lay.microbatches == 12
    assert lay.n_gpus == 4096
    assert lay.zero_shard == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(zero_stage=4),
        dict(recompute="some"),
        dict(dtype="int8"),
        dict(virtual_stages=2),  # needs the interleaved schedule
        dict(dp_replicate=3),  # 4 % 3
        dict(offload_params=True),  # needs ZeRO-3
        dict(sequence_parallel=True, tp=1),
        dict(micro_batch=0),
        dict(schedule="zbv", virtual_stages=3),  # ZB-V has exactly 2 chunks per GPU
        dict(schedule="pipedream"),
    ],
)
def test_layout_rejects(kwargs):
    base = dict(dp=4, tp=2, pp=2)
    base.update(kwargs)
    with pytest.raises(ValueError):
        Layout(**base)


def test_known_hardware():
    a100 = hardware("a100_80gb")
    assert a100.peak_flops == 312e12
    assert a100.inter_node_bw == 8 * 200e9 / 8 / 8  # 8 x 200 Gb/s HDR per node, per GPU, in bytes/s
    assert hardware("h200").gpu_mem_bytes > hardware("h100_80gb").gpu_mem_bytes
    assert set(KNOWN_HARDWARE) >= {"a100_40gb", "a100_80gb", "h100_80gb", "h200", "cpu"}
    with pytest.raises(ValueError):
        hardware("tpu")


def test_model_padding_and_dropout():
    m = gpt(96, 12288, 96, 2048, 50257, vocab_pad_multiple=64)
    assert m.params == 174_604_259_328  # the published count: padding apart
    assert (m.vocab_rows(1), m.vocab_rows(8)) == (50304, 50688)
    assert m.padding_params(8) == 431 * 12288
    assert shape("llama", 2, 64, 4, 32, 100, vocab_pad_multiple=64).padding_params() == 2 * 28 * 64
    with pytest.raises(ValueError):
        gpt(2, 64, 4, 32, 100, dropout=1.0)
