"""The planner on the Llama architecture: parameter counts against the published ones, FLOPs against the Llama 3
paper (Grattafiori et al. 2024, "The Llama 3 Herd of Models"), the Llama block's activations, and the 405B plan on
thousands of GPUs."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from hpctrain.config.layout import lighter_ends
from hpctrain.launch.cli import run
from hpctrain.models.params import built_dims, model_param_count, param_count
from hpctrain.plan.activations import activation_bytes_per_layer
from hpctrain.plan.flops import (
    flops_per_iteration,
    layer_forward_flops,
    model_flops_per_token,
)
from hpctrain.plan.memory import (
    layer_params_per_gpu,
    memory_per_gpu,
    stage_params_per_gpu,
)
from hpctrain.plan.search import search_layouts
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import Layout, ModelShape, hardware
from tests.conftest import run_hpctrain
from tests.plan.shapes import GPT, LLAMA, dims, gpt, shape

# Hugging Face's counts of meta-llama/Llama-3.1-{8B,70B,405B} (sum of numel, untied head, vocabulary 128256).
PUBLISHED = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}
# The Llama 3 paper's 405B pre-training: 15.6T tokens, "3.8 x 10^25 FLOPs"; Table 4: 16,384 H100s as TP 8 x PP 16
# x DP 128, sequences of 8192, 16 per DP rank (global batch 2048 = 16M tokens), BF16 MFU 38-43%.
LLAMA_405B = shape("llama", 126, 16384, 128, 8192, 128256, ffn_hidden=53248, vocab_pad_multiple=64, kv_heads=8)
H100 = hardware("h100_80gb")
GPUS_405B = [
    "model=llama3_405b",
    "cluster=slurm",
    "cluster.nodes=2048",
    "cluster.gpus_per_node=8",
    "cluster.gpu_type=h100_80gb",
    "precision=bf16",
    "data=synthetic",
    "data.vocab_size=128256",
    "train.seq_len=8192",
    "train.global_batch=2048",
    "train.micro_batch=1",
]


@pytest.mark.parametrize("name", PUBLISHED)
def test_llama3_parameter_counts_are_the_published_ones(compose_cfg, name: str) -> None:
    """l (2 h^2 + 2 h k + 3 h f + 2 h) + 2 V h + h: QKV (h + 2k) x h, projection h x h, SwiGLU 3 h x f, 2 RMSNorms
    per layer; embedding and untied head V x h; the final RMSNorm. k = n_kv_heads x head_dim."""
    m = compose_cfg(f"model={name}").model
    L, h, f, v = m.n_layers, m.d_model, m.ffn_hidden, m.vocab_size
    k = m.n_kv_heads * h // m.n_heads
    assert L * (2 * h * h + 2 * h * k + 3 * h * f + 2 * h) + 2 * v * h + h == PUBLISHED[name]
    assert model_param_count(m) == PUBLISHED[name]
    assert ModelShape.of(m, m.context).params == PUBLISHED[name]


def test_llama_shapes_are_the_models() -> None:
    """The names and shapes hpctrain.models.llama.model builds (no biases; gate and up separate), and GPT's
    unchanged."""
    d, f, k = 48, 128, 24  # 4 query heads of 12, 2 key/value heads: K and V k = 24 wide
    assert LLAMA.block_shapes(dims(d, 4, ffn_hidden=f, kv_heads=2)) == {
        "norm1.weight": (d,),
        "attn.qkv.weight": (d + 2 * k, d),
        "attn.proj.weight": (d, d),
        "norm2.weight": (d,),
        "mlp.gate.weight": (f, d),
        "mlp.up.weight": (f, d),
        "mlp.proj.weight": (d, f),
    }
    assert LLAMA.top_shapes(dims(d, 4, vocab_size=256, context=40), 256) == {
        "tok_emb.weight": (256, d),
        "norm_f.weight": (d,),
        "output.weight": (256, d),
    }
    gpt2 = dims(d, 4, n_layers=2, vocab_size=256, context=40)
    assert param_count(GPT, gpt2) == 2 * (12 * d * d + 13 * d) + (256 + 40) * d + 2 * d


def test_meta_device_llama_3_8b_matches_the_closed_form_per_stage_and_rank(compose_cfg) -> None:
    """Llama 3 8B as built for TP 8 (vocabulary 128256 -> 128512 rows, embedding and head) on the meta device."""
    import torch

    from hpctrain.models import create_model
    from hpctrain.models.params import padded_vocab, stage_param_counts
    from hpctrain.parallel.stages import meta_stage_counts

    cfg = compose_cfg("model=llama3_8b", "parallel.tp=8")
    with torch.device("meta"):
        model = create_model(cfg.model, 8)
    rows = padded_vocab(128256, 64, 8)
    assert rows == 128512
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["llama3_8b"] + 2 * (rows - 128256) * 4096
    whole, shard = meta_stage_counts(cfg, (cfg.model.n_layers // 4,) * 4, 8)
    assert stage_param_counts(cfg.model, (cfg.model.n_layers // 4,) * 4, 8) == whole
    assert stage_param_counts(cfg.model, (cfg.model.n_layers // 4,) * 4, 8, per_gpu=True) == shard
    # the planner's per-GPU figure is the same closed form: stage 0 embeds, stage 3 holds norm_f and the head
    model = ModelShape.of(cfg.model, 8192)
    assert [stage_params_per_gpu(model, Layout(dp=1, tp=8, pp=4), s) for s in range(4)] == shard


def test_405b_training_flops_are_the_papers() -> None:
    """6 N D with N = 405.85B and D = 15.6T tokens is the paper's 3.8e25; the attention term 12 l s h (s = 8192)
    adds 8% (4.1e25), which the paper's figure leaves out."""
    n, tokens = LLAMA_405B.params, 15.6e12
    assert round(6 * n * tokens / 1e25, 1) == 3.8
    per_token = model_flops_per_token(LLAMA_405B)
    assert per_token == 6 * n + 12 * 126 * 8192 * 16384
    assert round(per_token * tokens / 1e25, 1) == 4.1


def test_the_training_loops_mfu_counts_the_llama(compose_cfg) -> None:
    """The progress line's MFU (hpctrain.parallel.metrics) uses the same 6 N + 12 l s h, N the Llama count."""
    from hpctrain.parallel.metrics import flops_per_token

    cfg = compose_cfg("model=llama3_8b", "train.seq_len=8192")
    assert flops_per_token(cfg) == 6 * PUBLISHED["llama3_8b"] + 12 * 32 * 8192 * 4096


def test_llama_matmul_flops_are_six_times_the_matrices() -> None:
    """Forward matmuls per token: 2 x every matrix's parameters (QKV (h + 2k) h, projection h^2, SwiGLU 3 h f, head
    V h) + the attention core 4 s h; training without recomputation 3x that: 6 (N - V h - norms) + 12 l s h per
    token, the MFU numerator less the embedding lookup and the norms."""
    m = replace(LLAMA_405B, vocab_pad_multiple=1)
    h, k, f, s, L, v = 16384, 1024, 53248, 8192, 126, 128256
    assert (
        layer_forward_flops(s, s, h, f, k, gated=True) == 2 * s * (h * (h + 2 * k) + h * h + 3 * h * f) + 4 * s * s * h
    )
    assert 4 * h * h + 4 * h * k + 6 * h * f == 23.75 * h * h  # "24 h^2" of a GPT layer with f = 4h
    tokens = 2048 * s
    matrices = m.params - v * h - (2 * L + 1) * h
    assert flops_per_iteration(m, 2048, "none") == pytest.approx(tokens * (6 * matrices + 12 * L * s * h), rel=1e-12)
    mha = gpt(4, 64, 4, 32, 100)  # kv_dim = h, not gated: the GPT count
    assert (
        layer_forward_flops(32, 32, 64, 256, 64)
        == layer_forward_flops(32, 32, 64, 256)
        == 24 * 32 * 64 * 64 + 4 * 32 * 32 * 64
    )  # Narayanan's 24 B s h^2 + 4 B s^2 h
    assert mha.dims.kv_dim == 64 and not mha.gated


def test_llama_block_activations() -> None:
    """sbh units, 16-bit, no TP: two RMSNorms 12 (fp32 input copy 4 + normalised 2 each), QKV/MLP-in inputs 4, the
    QKV output 2 + 4 k / h (V is a view of it), RoPE's Q 2 and K 2 k / h, attention output 2, log-sum-exp 4 a / h,
    SwiGLU 8 f / h. Llama 3 8B (k = h / 4, f = 3.5 h): 51.5 + lse, where a GPT block of the same h keeps 32;
    selective keeps the block input 2, the QKV output 3, the attention output 2 and log-sum-exp, the gate/up output
    14 and the row-parallel outputs 4."""
    s, h, a = 8192, 4096, 32
    sbh, lse = s * h, 4 * a / h
    llama = dims(h, a, ffn_hidden=14336, kv_heads=8)
    assert activation_bytes_per_layer(LLAMA, llama, s, 1) == pytest.approx(sbh * (51.5 + lse))
    assert activation_bytes_per_layer(LLAMA, llama, s, 1, recompute="selective") == pytest.approx(sbh * (25 + lse))
    assert activation_bytes_per_layer(LLAMA, llama, s, 1, recompute="full") == 2 * sbh
    # TP 4 + SP: the norms split by SP, the gathered QKV/MLP-in inputs whole, the rest split by TP
    assert activation_bytes_per_layer(LLAMA, llama, s, 1, 4, True) == pytest.approx(
        sbh * (12 / 4 + 4 + (3 + 2.5 + 2 + 28 + lse) / 4)
    )
    # grouped-query attention: the QKV output 4 x 3/4 and the rotated K 2 x 3/4 smaller than multi-head's
    mha = activation_bytes_per_layer(LLAMA, dims(h, a, ffn_hidden=14336), s, 1)
    assert mha - activation_bytes_per_layer(LLAMA, llama, s, 1) == pytest.approx(4.5 * sbh)


def test_llama_block_saves_what_the_formula_counts(compose_cfg) -> None:
    """The tensors autograd saves for hpctrain.models.llama.model's Block in bf16 on CPU (storages counted once,
    parameters left out): the formula, plus RoPE's cos/sin tables and RMSNorm's per-token fp32 1/rms."""
    from tests.plan.saved import block_saved_bytes

    d, a, g, f, s, b = 256, 8, 2, 704, 512, 2
    cfg = compose_cfg(
        "model=llama_tiny",
        f"model.d_model={d}",
        f"model.n_heads={a}",
        f"model.n_kv_heads={g}",
        f"model.ffn_hidden={f}",
        "model.n_layers=1",
    )
    rope_tables, inv_rms = 2 * s * (d // a) * 2, 2 * b * s * 4  # one cached bf16 cos/sin pair for q and k
    formula = activation_bytes_per_layer(*built_dims(cfg.model), s, b)
    assert block_saved_bytes(cfg.model, b, s) == formula + rope_tables + inv_rms


def test_llama_weights_per_tp_rank() -> None:
    """Norm weights are the only replicated parameters of a Llama layer (2 h); the head is split like the embedding."""
    h = 16384
    block = sum(a * b for a, b in ((h + 2048, h), (h, h), (2 * 53248, h), (h, 53248)))
    assert layer_params_per_gpu(LLAMA_405B, 8) == block / 8 + 2 * h
    rows = LLAMA_405B.vocab_rows(8)
    assert stage_params_per_gpu(LLAMA_405B, Layout(dp=1, tp=8, pp=2), 1) == 63 * (block / 8 + 2 * h) + rows * h / 8 + h
    assert (
        stage_params_per_gpu(LLAMA_405B, Layout(dp=1, tp=8, pp=1), 0)
        == 126 * (block / 8 + 2 * h) + 2 * rows * h / 8 + h
    )


def test_the_papers_405b_layout_estimate() -> None:
    """TP 8 x PP 16 x DP 128, micro-batch 1, 16 microbatches (Table 4: 41% MFU at this size), the paper's cut of 126
    layers: 7 on the first and the last stage, 8 on each between (parallel.first_stage_layers / last_stage_layers);
    interleaved, the chunks take the same shape (2 per rank: 3 + 30 x 4 + 3, 4 per rank: 1 + 62 x 2 + 1; 8 per rank
    would be 128 chunks for 126 layers). The pipeline runs at the pace of the 8-layer ranks (126 / 16 = 7.875 on
    average). Without recomputation 1F1B idles 15/31 of the pipeline (27%); interleaving brings the estimate to
    the paper's figure (4 chunks: 41%). hpctrain's own stack would not fit that (DTensor SP's gathered inputs, 16
    microbatches in flight): only full recomputation does, at 20-31%. docs/planner.md has the table."""
    base = Layout(
        dp=128,
        tp=8,
        pp=16,
        micro_batch=1,
        grad_accum=16,
        zero_stage=1,
        sequence_parallel=True,
        recompute="none",
        reduce_dtype="fp32",
        first_stage_layers=7,
        last_stage_layers=7,
    )

    def at(v: int, recompute: str = "none") -> Layout:
        ends = lighter_ends(126, 16 * v)
        return replace(
            base,
            virtual_stages=v,
            schedule="interleaved_1f1b" if v > 1 else "1f1b",
            recompute=recompute,
            first_stage_layers=ends,
            last_stage_layers=ends,
        )

    assert [at(v).layer_split(126)[:2] for v in (1, 2, 4)] == [(7, 8), (3, 4), (1, 2)]
    assert lighter_ends(126, 128) is None
    mfu = {v: estimate_step(LLAMA_405B, at(v), H100).mfu for v in (1, 2, 4)}
    assert estimate_step(LLAMA_405B, base, H100).bubble_fraction == pytest.approx(15 / 31)
    assert [round(mfu[v], 2) for v in (1, 2, 4)] == [0.27, 0.35, 0.41]
    assert not memory_per_gpu(LLAMA_405B, base, H100).fits
    assert not memory_per_gpu(LLAMA_405B, at(4, "selective"), H100).fits
    full = {v: estimate_step(LLAMA_405B, at(v, "full"), H100).mfu for v in (1, 4)}
    assert memory_per_gpu(LLAMA_405B, at(4, "full"), H100).fits
    assert [round(full[v], 2) for v in (1, 4)] == [0.20, 0.31]


def test_405b_dry_run_prints_the_plan(tmp_path: Path) -> None:
    """The command line on 2048 nodes of 8 H100s, with the layout parallel=auto finds (below)."""
    proc = run_hpctrain(
        *GPUS_405B,
        "parallel.tp=8",
        "parallel.sequence_parallel=true",
        "parallel.recompute=full",
        "zero=stage3",
        "dry_run=true",
        f"run.root={tmp_path}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for words in (
        "llama3_405b (llama)",
        "128 heads (8 key/value)",
        "MLP 53248",
        "405,853,388,800 (405.85B)",
        "128256 -> 128512 rows (multiple of 64 x TP 8): +8,388,608 params",
        "the output head on the last",
        "DP 2048 x TP 8 x PP 1",
        "per-GPU memory",
        "MFU",
    ):
        assert words in out, words


def test_405b_parallel_auto_finds_a_layout_on_16384_gpus(compose_cfg, capsys) -> None:
    """The search cuts 126 layers into pp x v chunks evenly or with the first and the last chunk one layer lighter
    (Llama 3's cut, Grattafiori et al. 2024, sec. 3.3.2), interleaved too: it picks PP 8 with 8 chunks a rank
    (1 + 62 x 2 + 1), ZeRO-1 over DP 256 and full recomputation, the only recomputation that fits hpctrain's stack
    (docs/planner.md, "Llama 3 405B"), faster than ZeRO-3 over DP 2048 without PP, its choice before it tried
    uneven interleaved cuts. The speed auto announces is the plan's (both reduce gradients in
    precision.reduce_dtype)."""
    assert run(compose_cfg(*GPUS_405B, "parallel=auto", "dry_run=true", "plan.format=json")).code == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    announced = re.search(r"parallel=auto chose: .*?; ([\d,]+) tok/s", captured.err)
    assert announced and int(announced.group(1).replace(",", "")) == round(plan["est_tokens_per_s"])
    lay = plan["layout"]
    assert (lay["dp"], lay["tp"], lay["pp"], lay["virtual_stages"], lay["zero_stage"]) == (256, 8, 8, 8, 1)
    assert (lay["first_stage_layers"], lay["last_stage_layers"]) == (1, 1) and "rc=full" in captured.err
    assert lay["micro_batch"] * lay["grad_accum"] * lay["dp"] == 2048
    assert plan["memory_per_gpu_bytes"]["fits"] and plan["params_total"] == PUBLISHED["llama3_405b"]
    assert 0.15 < plan["est_mfu"] < 0.4


def test_the_8b_experiment_is_what_its_comment_says(compose_cfg) -> None:
    """conf/experiment/llama3_8b_4node.yaml: TP 2 x DP 16, no recomputation, fits at 58.6 GiB, within 3% of the
    fastest layout the search finds (PP 2 x DP 16, no recomputation: 2.6% faster; SP's re-gathers in backward cost
    TP 2 a quarter more traffic); FSDP over 32 GPUs fits without
    recomputation since loss parallelism (it needed selective before) and is 1.6x slower."""
    from hpctrain.checks.runner import check_config
    from hpctrain.plan.search import cheapest_fitting

    est = check_config(compose_cfg("+experiment=llama3_8b_4node", "dry_run=true")).estimates
    lay = est.layout
    assert (lay.dp, lay.tp, lay.pp, lay.zero_stage, lay.recompute) == (16, 2, 1, 1, "none")
    # 70.3 before loss parallelism, 60.6 before SP kept its gathered inputs as shards
    assert round(est.memory.total / 2**30, 1) == 58.6 and est.memory.fits
    best = search_layouts(est.model, 32, est.hw, 512, top_k=1)[0]
    assert est.step.tokens_per_s > best.tokens_per_s / 1.03
    fsdp = cheapest_fitting(
        est.model, replace(lay, dp=32, tp=1, grad_accum=16, zero_stage=3, sequence_parallel=False), est.hw
    )
    assert fsdp is not None and fsdp.layout.recompute == "none"
    assert round(est.step.tokens_per_s / fsdp.tokens_per_s, 1) == 1.6


def test_search_keeps_whole_key_value_heads_per_tp_rank() -> None:
    """TP may not split a key/value head: with 2 of them, TP 4 and 8 are no candidates."""
    tiny = shape("llama", 4, 128, 8, 256, 256, ffn_hidden=352, kv_heads=2)
    tps = {c.layout.tp for c in search_layouts(tiny, 8, H100, global_batch=16)}
    assert tps == {1, 2}
