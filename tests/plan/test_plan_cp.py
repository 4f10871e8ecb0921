"""The planner under context parallelism (parallel.cp): what a CP rank's block keeps for backward, measured on a real
2-rank CP group against the formula; the keys' and values' traffic; compute per rank; where `parallel=auto` tries CP;
the check that names the CP degree a sequence needs; and Llama 3 405B's long-context plan (Table 4, third row)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from hpctrain.checks.runner import run_checks
from hpctrain.config.layout import lighter_ends
from hpctrain.launch.cli import run
from hpctrain.models.params import built_dims
from hpctrain.plan.activations import activation_bytes_per_layer
from hpctrain.plan.auto import context_for_fit
from hpctrain.plan.comm import NETWORK, NVLINK, comm_per_step
from hpctrain.plan.estimate import estimate
from hpctrain.plan.memory import layer_activation_bytes, memory_per_gpu, shard_params_per_gpu, stage_activation_parts
from hpctrain.plan.search import CP_MIN_SEQ_LEN, search_layouts
from hpctrain.plan.step_time import estimate_step
from hpctrain.plan.types import GiB, Layout, hardware
from tests.distributed_harness import run_distributed
from tests.plan.saved import saved_bytes
from tests.plan.shapes import LLAMA, dims, shape
from tests.plan.test_plan_llama import LLAMA_405B

D, A, G, F, S, B = 256, 8, 2, 704, 512, 2
BLOCKS = {"gpt": "model=tiny", "llama": "model=llama_tiny"}
H100 = hardware("h100_80gb")
LLAMA_8B = shape("llama", 32, 4096, 32, 8192, 128256, ffn_hidden=14336, kv_heads=8)


def _cfg(compose_cfg: Any, arch: str) -> Any:
    extra = [f"model.n_kv_heads={G}", f"model.ffn_hidden={F}"] if arch == "llama" else []
    return compose_cfg(BLOCKS[arch], f"model.d_model={D}", f"model.n_heads={A}", "model.n_layers=1", *extra).model


def _cp_block(rank: int, world: int, model_cfg: Any) -> dict[str, int]:
    """Per recompute mode, the bytes layer 0 keeps on this CP rank (its S / world tokens)."""
    import torch.distributed as dist

    from hpctrain.models import create_model
    from hpctrain.parallel.context_parallel import apply_context_parallel

    out = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        block = create_model(model_cfg).to(torch.bfloat16).layers["0"]
        apply_context_parallel(block, dist.group.WORLD)
        x = torch.randn(B, S // world, D, dtype=torch.bfloat16, requires_grad=True)
        out[mode] = saved_bytes(block, x, mode)
    return out


def _extras(arch: str, rank: int, cp: int) -> int:
    """What the run keeps beyond the formula, a few s-sized tensors the planner leaves out: the lower-right causal
    mask the CPU's SDPA materialises (bool, as bf16) for each chunk that sees more keys than queries (a chunk at the
    diagonal takes is_causal), the int64 order the gathers are put back with, the norms' per-token statistics (GPT:
    two LayerNorms' bf16 mean and rstd; Llama: two RMSNorms' fp32 1/rms) and Llama's index-selected RoPE tables
    (cos and sin, bf16)."""
    c, local = S // (2 * cp), S // cp
    masks = sum(2 * c * (chunk + 1) * c for chunk in (rank, 2 * cp - 1 - rank) if chunk > 0)
    norms = 2 * (4 if arch == "llama" else 2 * 2) * B * local
    rope = 2 * 2 * local * (D // A) if arch == "llama" else 0
    return masks + 8 * S + norms + rope


@pytest.mark.parametrize("arch", list(BLOCKS))
def test_cp_block_keeps_what_the_formula_counts(compose_cfg: Any, arch: str) -> None:
    """CP 2 on gloo: each rank's block keeps the formula's bytes at S / 2 tokens with cp=2 (the gathered K and V of
    the whole sequence, each chunk's attention output, no QKV output kept through V's view, Llama: no local rotated
    K), byte for byte beside a few s-sized extras; the selective policy the formula's bytes exactly (it keeps the
    gathers' outputs, and none of the extras: masks, orders and statistics are rerun); full recomputation the local
    block input. Without the CP terms the formula would miss: it is not the cp=1 formula at S / 2."""
    model_cfg = _cfg(compose_cfg, arch)
    ranks = run_distributed(_cp_block, 2, model_cfg, timeout=300)
    family, d = built_dims(model_cfg)
    local = S // 2
    for rank, got in enumerate(ranks):
        formula = activation_bytes_per_layer(family, d, local, B, cp=2)
        assert got["none"] == formula + _extras(arch, rank, 2)
        selective = activation_bytes_per_layer(family, d, local, B, recompute="selective", cp=2)
        assert got["selective"] == selective < formula
        assert (
            got["full"] == activation_bytes_per_layer(family, d, local, B, recompute="full", cp=2) == 2 * local * B * D
        )
        assert formula != activation_bytes_per_layer(family, d, local, B)


def test_cp_activations_are_per_local_token_plus_the_gathered_keys_and_values() -> None:
    """At cp the layer keeps the cp=1 formula at s / cp, with Llama's attention terms replaced: the rotated Q 2q,
    the gathered K and V 4 k cp / h, the chunks' outputs 2q besides the projection's input; under TP all of it / t.
    Full recomputation keeps 1/cp of the block input; the head's logits are 1/cp too."""
    s, b, h, a, g, t = 131072, 1, 16384, 128, 8, 8
    hd, f = h // a, 53248
    kv, q = g * hd / h, 1.0
    for cp in (2, 16):
        sbh = s // cp * b * h
        llama = dims(h, a, ffn_hidden=f, kv_heads=g)
        base = activation_bytes_per_layer(LLAMA, llama, s // cp, b, t, True)
        got = activation_bytes_per_layer(LLAMA, llama, s // cp, b, t, True, cp=cp)
        was = (2 * q + 4 * kv) + 2 * (q + kv)  # the QKV output (V's view) and the rotated Q and K
        now = 2 * q + 4 * kv * cp + 2 * q
        assert got - base == pytest.approx(sbh * (now - was) / t)
    lay = Layout(
        dp=8,
        tp=8,
        pp=16,
        cp=16,
        grad_accum=16,
        zero_stage=1,
        sequence_parallel=True,
        recompute="full",
        gpus_per_node=8,
        first_stage_layers=7,
        last_stage_layers=7,
    )
    long = replace(LLAMA_405B, seq_len=131072)
    assert layer_activation_bytes(long, lay) == 2 * 131072 // 16 * 16384 / 8
    head = [p.bytes for p in stage_activation_parts(long, lay, 15) if p.name.startswith("output head")]
    head1 = [
        p.bytes
        for p in stage_activation_parts(replace(long, seq_len=8192), replace(lay, cp=1), 15)
        if p.name.startswith("output head")
    ]
    assert head == head1  # 131072 / 16 = 8192 tokens per rank: the 8K stage's head


def test_zero_shards_over_dp_and_cp() -> None:
    """ZeRO/FSDP shards over dp_shard x cp ranks (Layout.zero_shard); the gradient traffic runs over that group."""
    lay = Layout(
        dp=8,
        tp=8,
        pp=16,
        cp=16,
        grad_accum=16,
        zero_stage=1,
        sequence_parallel=True,
        recompute="full",
        gpus_per_node=8,
        first_stage_layers=7,
        last_stage_layers=7,
    )
    long = replace(LLAMA_405B, seq_len=131072)
    plain = replace(lay, cp=1, dp=128)
    assert shard_params_per_gpu(long, lay, 0) == shard_params_per_gpu(long, plain, 0)
    assert comm_per_step(long, lay, H100).dp_bytes == comm_per_step(long, plain, H100).dp_bytes
    ddp = Layout(dp=1, tp=1, pp=1, cp=2)  # no DP, but two CP ranks: an all-reduce of the gradients
    assert comm_per_step(LLAMA_8B, ddp, H100).dp_bytes == 2 * (1 / 2) * 4 * LLAMA_8B.params * 2 / 4


def test_cp_traffic_is_the_keys_and_values_gathered_and_their_gradients_reduced() -> None:
    """Per layer and micro-batch: all-gather K and V (2 s b k / t elements, (cp - 1) / cp of it per rank) and
    reduce-scatter their gradients, a third time under full recomputation; over NVLink while tp x cp fits a node."""
    model = replace(LLAMA_8B, seq_len=65536)
    k = model.dims.kv_dim
    for tp, cp, rc, link in ((2, 4, "none", NVLINK), (8, 4, "full", NETWORK)):
        lay = Layout(
            dp=2, tp=tp, pp=1, cp=cp, grad_accum=3, zero_stage=1, sequence_parallel=True, recompute=rc, gpus_per_node=8
        )
        (item,) = [i for i in comm_per_step(model, lay, H100).items if i.kind == "cp"]
        collectives = 3 if rc == "full" else 2
        assert item.bytes == 32 * 3 * collectives * (cp - 1) / cp * 2 * 65536 * k / tp * 2
        assert item.link == link
    assert not [i for i in comm_per_step(model, Layout(dp=2, tp=2, pp=1), H100).items if i.kind == "cp"]


def test_compute_per_rank_is_a_cp_th_of_the_sequence() -> None:
    """The same global batch on cp x the GPUs (the CP ranks added to a layout): each GPU computes 1/cp of it, the
    attention included (causal load balancing gives every rank the same share); TP's and PP's bytes are per local
    token, and the CP time is on the critical path."""
    model = replace(LLAMA_8B, seq_len=65536)
    base = Layout(
        dp=2, tp=8, pp=2, grad_accum=4, zero_stage=1, sequence_parallel=True, recompute="full", gpus_per_node=8
    )
    split = replace(base, cp=4)
    one, four = estimate_step(model, base, H100), estimate_step(model, split, H100)
    assert four.compute_s == pytest.approx(one.compute_s / 4)
    assert four.comm.tp_bytes == pytest.approx(one.comm.tp_bytes / 4)
    assert four.comm.pp_bytes == pytest.approx(one.comm.pp_bytes / 4)
    assert four.cp_s > 0 and four.comm_s == pytest.approx(four.tp_s + four.pp_s + four.cp_s + four.dp_exposed_s)


def test_search_tries_cp_only_for_long_sequences_or_when_nothing_fits() -> None:
    """Short sequences keep their candidates (no cp > 1: the search's speed); long ones add CP layouts; a short one
    that fits nowhere without CP finds them; every CP candidate obeys the sequence's rule and has no EP."""
    short = search_layouts(LLAMA_8B, 64, H100, 64)
    assert short and all(c.layout.cp == 1 for c in short)
    long = search_layouts(LLAMA_8B, 64, H100, 8, seq_len=CP_MIN_SEQ_LEN * 2, zero_stages=(1,))
    cps = {c.layout.cp for c in long}
    assert 1 in cps and max(cps) > 1
    assert all((CP_MIN_SEQ_LEN * 2) % (2 * c.layout.cp) == 0 and c.layout.ep == 1 for c in long)
    tight = replace(LLAMA_8B, seq_len=8192 + 4096)  # under the threshold; one sequence per GPU, 8 GPUs
    small = hardware("h100_80gb")
    # 23 GiB: loss parallelism's logits (bf16 and their gradient on each TP rank's vocabulary shard, not 12 bytes
    # of the whole vocabulary) fit TP 8 without CP into 24 GiB
    found = search_layouts(tight, 8, replace(small, gpu_mem_bytes=23 * GiB), 1, zero_stages=(3,), max_micro_batch=1)
    assert found and all(c.layout.cp > 1 for c in found)
    assert not search_layouts(
        tight, 8, replace(small, gpu_mem_bytes=23 * GiB), 1, zero_stages=(3,), max_micro_batch=1, max_context_parallel=1
    )


def test_the_check_names_the_cp_degree_that_fits(compose_cfg: Any) -> None:
    """Llama 3 8B at 131,072 tokens on 4 nodes, TP 2, ZeRO-3, full recomputation: the activations do not fit at
    cp=1; the warning names the smallest CP degree that does (its GPUs taken from DP), under parallel.cp. (At TP 8
    it fits since loss parallelism: each TP rank holds its vocabulary shard of the logits, 4 bytes each.)"""
    cfg = compose_cfg(
        "model=llama3_8b",
        "cluster=slurm",
        "cluster.nodes=4",
        "cluster.gpus_per_node=8",
        "cluster.gpu_type=h100_80gb",
        "precision=bf16",
        "data=synthetic",
        "data.vocab_size=128256",
        "model.context=131072",
        "train.seq_len=131072",
        "train.global_batch=16",
        "train.micro_batch=1",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.recompute=full",
        "zero=stage3",
    )
    report = run_checks(cfg)
    (warning,) = [w for w in report.warnings if w.key == "parallel.cp"]
    wider, mem = context_for_fit(report.estimates.model, report.layout, report.estimates.hw)
    assert mem.fits and not report.estimates.memory.fits
    assert wider.cp > 1 and wider.n_gpus == 32 and wider.global_batch == 16
    smaller = replace(wider, cp=wider.cp // 2, dp=wider.dp * 2, grad_accum=wider.grad_accum // 2)
    assert wider.cp == 2 or not memory_per_gpu(report.estimates.model, smaller, report.estimates.hw).fits
    assert f"parallel.cp={wider.cp}" in warning.fix and f"parallel.dp={wider.dp}" in warning.fix


# Llama 3 405B's long-context row (Table 4: 16,384 GPUs, TP 8 x CP 16 x PP 16 x DP 8, 131,072 tokens, 16M tokens a
# step, 380 TFLOP/s per GPU). The planner's TFLOP/s per GPU (MFU x 989) per schedule and recomputation, as
# docs/planner.md's table: (virtual stages, recompute) -> band.
LONG_BANDS = {(1, "full"): (180, 230), (4, "full"): (290, 350), (4, "selective"): (390, 450), (4, "none"): (395, 455)}


def test_the_papers_long_context_plan(compose_cfg: Any) -> None:
    """+experiment=llama3_405b_long is the paper's layout and fits 80 GB with full recomputation (1F1B or 4
    interleaved chunks); without it or with selective it does not. TFLOP/s per GPU in the docs' bands."""
    cfg = compose_cfg("+experiment=llama3_405b_long")
    est = estimate(cfg, run_checks(cfg).layout)
    lay = est.layout
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.global_batch, lay.microbatches) == (8, 16, 16, 8, 128, 16)
    assert est.model.seq_len == 131072 and lay.n_gpus == 16384 and est.memory.fits
    for (v, rc), (low, high) in LONG_BANDS.items():
        ends = lighter_ends(126, 16 * v)
        trial = replace(
            lay,
            recompute=rc,
            virtual_stages=v,
            schedule="interleaved_1f1b" if v > 1 else "1f1b",
            first_stage_layers=ends,
            last_stage_layers=ends,
        )
        tflops = estimate_step(est.model, trial, est.hw).mfu * est.hw.peak_flops / 1e12
        assert low <= tflops <= high, (v, rc, tflops)
        assert memory_per_gpu(est.model, trial, est.hw).fits == (rc == "full")
    cp_item = [i for i in est.step.comm.items if i.kind == "cp"]
    assert cp_item[0].link == NETWORK and math.isclose(est.step.cp_s, cp_item[0].time_s)


def test_long_context_dry_run_shows_cp(capsys: Any, compose_cfg: Any) -> None:
    """The dry run passes the checks and shows CP in the layout and the step."""
    assert run(compose_cfg("+experiment=llama3_405b_long", "dry_run=true", "plan.format=json")).code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["cp"] == 16
