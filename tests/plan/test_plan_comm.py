"""Communication volumes per step per GPU on small hand-computed layouts."""

from dataclasses import replace

import pytest

from hpctrain.plan.comm import (
    NETWORK,
    NVLINK,
    all_gather_bytes,
    all_reduce_bytes,
    comm_per_step,
)
from hpctrain.plan.memory import stage_params_per_gpu
from hpctrain.plan.types import Hardware, Layout
from tests.plan.shapes import gpt

HW = Hardware(
    "test", gpus_per_node=8, gpu_mem_bytes=80 * 2**30, peak_flops=312e12, intra_node_bw=300e9, inter_node_bw=25e9
)
MODEL = gpt(n_layers=4, d_model=64, n_heads=4, seq_len=32, vocab_size=100)
SBH_BYTES = 32 * 2 * 64 * 2  # s * micro_batch * h * 2 bytes (bf16)


def test_ring_volumes():
    assert all_reduce_bytes(4, 100.0) == 150.0  # 2 (n-1)/n
    assert all_gather_bytes(4, 100.0) == 75.0
    assert all_reduce_bytes(1, 100.0) == 0.0


def test_3d_layout_hand_case():
    lay = Layout(dp=4, tp=2, pp=2, micro_batch=2, grad_accum=4, dtype="bf16")
    c = comm_per_step(MODEL, lay, HW)
    g = max(stage_params_per_gpu(MODEL, lay, 0), stage_params_per_gpu(MODEL, lay, 1)) * 2
    (dp,) = [i for i in c.items if i.kind == "dp"]
    assert dp.bytes == pytest.approx(2 * 3 / 4 * g)
    assert dp.link == NVLINK  # tp * dp = 8 ranks: one node
    # TP: 2 layers on the stage x 4 microbatches x 4 all-reduces x 2 (t-1)/t x sbh
    (tp,) = [i for i in c.items if i.kind == "tp"]
    assert tp.bytes == pytest.approx(2 * 4 * 4 * 1.0 * SBH_BYTES)
    assert tp.link == NVLINK
    # PP: fwd + bwd x 4 microbatches x sbh / t (scatter/gather), between nodes (16 GPUs)
    (pp,) = [i for i in c.items if i.kind == "pp"]
    assert pp.bytes == pytest.approx(2 * 4 * SBH_BYTES / 2)
    assert pp.link == NETWORK
    assert pp.time_s == pytest.approx(pp.bytes / 25e9)
    assert c.total_bytes == pytest.approx(dp.bytes + tp.bytes + pp.bytes)


def test_full_recompute_adds_two_tp_collectives():
    lay = Layout(dp=4, tp=2, pp=2, micro_batch=2, grad_accum=4, recompute="full")
    assert comm_per_step(MODEL, lay, HW).tp_bytes == pytest.approx(2 * 4 * 6 * SBH_BYTES)


def test_sequence_parallel_moves_the_same_bytes():
    """With recomputation (the block decides what it saves) SP's all-gather + reduce-scatter move an all-reduce's
    bytes; without it, SP keeps the gathered inputs as shards and gathers them again in backward: 5 all-reduces'
    worth a layer instead of 4 (hpctrain.parallel.sequence_parallel; without a pipeline, Layout.sp_keeps_shards)."""
    for recompute in ("selective", "full"):
        a = comm_per_step(MODEL, Layout(dp=4, tp=2, pp=2, micro_batch=2, grad_accum=4, recompute=recompute), HW)
        b = comm_per_step(
            MODEL,
            Layout(dp=4, tp=2, pp=2, micro_batch=2, grad_accum=4, recompute=recompute, sequence_parallel=True),
            HW,
        )
        assert a.tp_bytes == b.tp_bytes and a.pp_bytes == b.pp_bytes
    plain = comm_per_step(MODEL, Layout(dp=8, tp=2, pp=1, micro_batch=2, grad_accum=4), HW)
    shards = comm_per_step(MODEL, Layout(dp=8, tp=2, pp=1, micro_batch=2, grad_accum=4, sequence_parallel=True), HW)
    assert shards.tp_bytes == pytest.approx(plain.tp_bytes * 5 / 4)
    piped = Layout(dp=4, tp=2, pp=2, micro_batch=2, grad_accum=4, sequence_parallel=True)  # not under PP (yet)
    assert not piped.sp_keeps_shards
    assert (
        comm_per_step(MODEL, piped, HW).tp_bytes
        == comm_per_step(MODEL, replace(piped, sequence_parallel=False), HW).tp_bytes
    )


def test_interleaving_multiplies_p2p():
    one = comm_per_step(MODEL, Layout(dp=4, tp=1, pp=2, grad_accum=4), HW).pp_bytes
    two = comm_per_step(
        MODEL, Layout(dp=4, tp=1, pp=2, grad_accum=4, virtual_stages=2, schedule="interleaved_1f1b"), HW
    ).pp_bytes
    assert two == 2 * one


def test_zero_stage_volumes():
    """ZeRO-1 = ZeRO-0; ZeRO-3 = 1.5x with one microbatch (ZeRO paper sec. 7.2); accumulation multiplies 2 and 3."""
    n = MODEL.params

    def dp(z: int, m: int = 1) -> float:
        return comm_per_step(MODEL, Layout(dp=8, tp=1, pp=1, zero_stage=z, grad_accum=m), HW).dp_bytes

    assert dp(0) == pytest.approx(2 * 7 / 8 * 2 * n)
    assert dp(1) == pytest.approx(dp(0))
    assert dp(2) == pytest.approx(dp(0))
    assert dp(3) == pytest.approx(1.5 * dp(0))
    # 4 microbatches: ZeRO-2 reduce-scatters 4x + gathers once; ZeRO-3 does 3 collectives per microbatch
    assert dp(0, 4) == pytest.approx(dp(0))
    assert dp(2, 4) == pytest.approx(5 * 7 / 8 * 2 * n)
    assert dp(3, 4) == pytest.approx(12 * 7 / 8 * 2 * n)


def test_fp32_reduction_doubles_gradient_bytes():
    n = MODEL.params
    c = comm_per_step(MODEL, Layout(dp=8, tp=1, pp=1, zero_stage=1, reduce_dtype="fp32"), HW)
    rs, ag = (i.bytes for i in c.items)
    assert rs == pytest.approx(7 / 8 * 4 * n)
    assert ag == pytest.approx(7 / 8 * 2 * n)


def test_hsdp_and_links():
    n = MODEL.params
    # 32 DP ranks, ZeRO-3 shards inside groups of 8 (one node), replicas all-reduce across nodes
    c = comm_per_step(MODEL, Layout(dp=32, tp=1, pp=1, zero_stage=3, dp_replicate=4), HW)
    shard_items = [i for i in c.items if i.name != "HSDP replica all-reduce"]
    assert all(i.link == NVLINK for i in shard_items)
    (rep,) = [i for i in c.items if i.name == "HSDP replica all-reduce"]
    assert rep.link == NETWORK
    assert rep.bytes == pytest.approx(2 * 3 / 4 * 2 * n / 8)
    # plain DP over 32 ranks leaves the node
    c = comm_per_step(MODEL, Layout(dp=32, tp=1, pp=1), HW)
    assert c.items[0].link == NETWORK


def test_no_parallelism_no_traffic():
    assert comm_per_step(MODEL, Layout(dp=1, tp=1, pp=1, grad_accum=8), HW).total_bytes == 0
