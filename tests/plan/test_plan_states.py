"""What hpctrain's torch wrappers hold per GPU (hpctrain/plan/states.py): DDP (ZeRO-0) with fp32 master parameters,
FSDP2 (ZeRO-1/2/3) with fp32 master shards, unsharded working parameters, sharded or unsharded accumulated
gradients, CPU offload. tests/parallel/test_zero_memory.py measures the same on real gloo ranks."""

import json

import pytest

from hpctrain.launch.cli import run
from hpctrain.plan.comm import comm_per_step
from hpctrain.plan.memory import (
    embedding_grad_parts,
    fsdp_unit_params_per_gpu,
    largest_param_per_gpu,
    layer_params_per_gpu,
    memory_per_gpu,
    stage_params_per_gpu,
)
from hpctrain.plan.states import data_parallel_kind, fills_buffer, gradient_reductions, zero_model_states
from hpctrain.plan.types import GiB, Hardware, Layout
from tests.plan.shapes import gpt

HW = Hardware("test", 8, 80 * GiB, 312e12, 300e9, 25e9)
MODEL = gpt(4, 256, 4, 64, 1000)


def _n(lay: Layout, stage: int = 0) -> float:
    return stage_params_per_gpu(MODEL, lay, stage)


def _layer(lay: Layout) -> float:
    return layer_params_per_gpu(MODEL, lay.tp)


def _root(lay: Layout, stage: int = 0) -> float:
    """The parameters outside the blocks on the stage: FSDP2's root unit."""
    return _n(lay, stage) - MODEL.dims.n_layers // lay.pp * _layer(lay)


def test_which_wrapper_runs():
    """engine.py: DDP for pure DP at ZeRO-0, FSDP2 fully_shard for ZeRO >= 1, replicate for ZeRO-0 with TP/PP,
    nothing without DP."""
    assert data_parallel_kind(Layout(dp=1, tp=2, pp=2, zero_stage=3)) == "none"
    assert data_parallel_kind(Layout(dp=8, tp=1, pp=1, zero_stage=0)) == "ddp"
    assert data_parallel_kind(Layout(dp=8, tp=1, pp=1, zero_stage=1)) == "fsdp"
    assert data_parallel_kind(Layout(dp=4, tp=2, pp=1, zero_stage=0)) == "replicate"
    assert data_parallel_kind(Layout(dp=4, tp=1, pp=2, zero_stage=1)) == "fsdp"


def test_ddp_gradients_are_full_fp32_with_or_without_accumulation():
    """no_sync accumulates into the same fp32 .grad DDP reduces (gradient_as_bucket_view=True): nothing extra."""
    one = memory_per_gpu(MODEL, Layout(dp=8, tp=1, pp=1, grad_accum=1), HW)
    eight = memory_per_gpu(MODEL, Layout(dp=8, tp=1, pp=1, grad_accum=8), HW)
    assert one.grads == eight.grads == pytest.approx(4 * _n(Layout(dp=8, tp=1, pp=1)))


def test_zero1_is_megatrons_distributed_optimizer():
    """bf16 working parameters, an fp32 gradient buffer each gradient is added into as backward makes it
    (hpctrain/parallel/grad_buffer.py), fp32 master + Adam sharded: 6 + 12/N exactly; the buffers apart: one
    unit's all-gather output, one parameter's fresh bf16 gradient (the largest: an MLP matrix here) and the
    layer's fp32 reduce-scatter input."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=1, grad_accum=8, reduce_dtype="fp32")
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert fills_buffer(lay)
    assert mem.params == pytest.approx(4 * n / 8 + 2 * n)
    assert mem.grads == pytest.approx(4 * n)
    assert mem.optimizer == pytest.approx(8 * n / 8)
    largest = largest_param_per_gpu(MODEL, lay)
    assert largest == 4 * 256 * 256 > MODEL.vocab_rows() * MODEL.dims.d_model  # an MLP matrix beats the embedding
    assert mem.buffers == pytest.approx(2 * layer + 2 * largest + 4 * layer)
    assert gradient_reductions(lay) == 1
    assert (mem.params + mem.grads + mem.optimizer) / n == pytest.approx(6 + 12 / 8)
    paper = zero_model_states(n, 8, 1)  # 2 + 2 + 12/N: the paper's gradients are fp16
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(paper.total + 2 * n)


def test_the_buffer_is_filled_only_where_fsdp2_accumulates_in_a_wider_dtype():
    """One micro-batch, PP (torch's schedules drive FSDP2) or one dtype for compute and reduction: FSDP2's own
    accumulation, with the tied head's gradient held through backward and a unit's fresh gradient."""
    base = dict(dp=8, tp=1, pp=1, zero_stage=1, grad_accum=8, reduce_dtype="fp32")
    assert fills_buffer(Layout(**base))
    assert fills_buffer(Layout(**{**base, "zero_stage": 3, "accumulate_unsharded": True}))
    assert not fills_buffer(Layout(**{**base, "zero_stage": 2}))  # reduce-scattered every micro-batch
    assert not fills_buffer(Layout(**{**base, "grad_accum": 1}))
    assert not fills_buffer(Layout(**{**base, "pp": 2}))
    assert not fills_buffer(Layout(**{**base, "reduce_dtype": "bf16"}))
    assert not fills_buffer(Layout(**{**base, "zero_stage": 0, "tp": 2}))  # replicate
    # under TP too (the tied head's leaf is a DTensor): only the embedding's gradient, whole on every TP rank
    tp = Layout(**{**base, "tp": 2})
    assert fills_buffer(tp)
    assert memory_per_gpu(MODEL, tp, HW).grads == pytest.approx(4 * _n(tp) + _embedding_whole_share(tp))


def _embedding_whole_share(lay: Layout) -> float:
    """embedding_grad_parts: the TP-sharded embedding's gradient comes back whole (the other (tp-1)/tp)."""
    return sum(p.bytes for p in embedding_grad_parts(MODEL, lay, 0) if p.kind == "grads")


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_zero2_reduce_scatters_every_micro_batch_unless_asked_not_to(tp, pp):
    """ZeRO-2 keeps gradient shards between micro-batches (m reduce-scatters); zero.accumulate_unsharded holds
    ZeRO-1's whole fp32 buffer for one. Under PP torch's schedules accumulate unsharded whatever is asked."""
    z2 = Layout(dp=4, tp=tp, pp=pp, zero_stage=2, grad_accum=4, reduce_dtype="fp32")
    acc = Layout(dp=4, tp=tp, pp=pp, zero_stage=2, grad_accum=4, reduce_dtype="fp32", accumulate_unsharded=True)
    z1 = Layout(dp=4, tp=tp, pp=pp, zero_stage=1, grad_accum=4, reduce_dtype="fp32")
    a, b, c = (memory_per_gpu(MODEL, lay, HW) for lay in (z2, acc, z1))
    assert (b.params, b.grads, b.optimizer, b.buffers) == (c.params, c.grads, c.optimizer, c.buffers)
    dp_bytes = [comm_per_step(MODEL, lay, HW).dp_bytes for lay in (z2, acc)]
    if pp == 1:
        assert a.grads < b.grads and dp_bytes[0] > dp_bytes[1]
        assert (gradient_reductions(z2), gradient_reductions(acc)) == (4, 1)
    else:
        assert a.grads == b.grads and dp_bytes[0] == dp_bytes[1] and gradient_reductions(z2) == 1


def test_fsdp_zero2_without_accumulation():
    """fp32 shards of params, grads, Adam + the bf16 unsharded parameters (reshard_after_forward=False) + one
    layer's unsharded bf16 gradient, with the root's gradient held; buffers: one layer's all-gather output and
    its fp32 reduce-scatter input."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=2, grad_accum=1, reduce_dtype="fp32")
    mem, n, layer, root = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay), _root(lay)
    assert 6 * layer > 4 * root  # a layer's reduce-scatter is the backward's peak, not the root's own
    assert mem.params == pytest.approx(4 * n / 8 + 2 * n)
    assert mem.grads == pytest.approx(4 * n / 8 + 2 * root + 2 * layer)
    assert mem.optimizer == pytest.approx(8 * n / 8)
    assert mem.buffers == pytest.approx(2 * layer + 4 * layer)


@pytest.mark.parametrize("reduce_dtype, r", [("fp32", 4), ("bf16", 2)])
def test_fsdp_accumulation_keeps_unsharded_gradients_in_the_reduce_dtype(reduce_dtype, r):
    """set_requires_gradient_sync(False): post_backward skips the reduce-scatter and
    to_accumulated_grad_if_needed upcasts the unsharded gradient to reduce_dtype (bf16 reduce: it stays .grad)."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=1, grad_accum=8, reduce_dtype=reduce_dtype)
    mem, n, layer, root = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay), _root(lay)
    if r == 4:  # the buffer is filled as gradients are made: it alone is the gradients
        assert mem.grads == pytest.approx(r * n)
        return
    # one dtype: FSDP2's own accumulation. The layer's bf16 gradient is added in and freed before its reduce-scatter
    # input is made; the tied head's gradient waits for the embedding's
    assert mem.grads == pytest.approx(max(r * n, 4 * n / 8) + 2 * root + 2 * layer)
    assert mem.buffers == pytest.approx(2 * layer + (r - 2) * layer)


def test_zero3_gathers_a_block_at_a_time_and_keeps_gradients_sharded():
    """ZeRO-3 shards attention and MLP as units of their own: the root and one block gathered, one MLP's
    all-gather output and reduce-scatter input staged; gradient shards between micro-batches unless
    accumulate_unsharded."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=3, grad_accum=8, reduce_dtype="fp32")
    mem, n, layer, root = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay), _root(lay)
    mlp = fsdp_unit_params_per_gpu(MODEL, lay)
    assert mlp == pytest.approx(8 * 256 * 256 + 5 * 256)
    assert 6 * mlp > 4 * root
    assert mem.params == pytest.approx(4 * n / 8 + 2 * (root + layer))
    assert mem.grads == pytest.approx(4 * n / 8 + 2 * root + 2 * mlp)
    assert mem.buffers == pytest.approx(2 * mlp + 4 * mlp)
    acc = memory_per_gpu(
        MODEL, Layout(dp=8, tp=1, pp=1, zero_stage=3, grad_accum=8, reduce_dtype="fp32", accumulate_unsharded=True), HW
    )
    assert acc.grads == pytest.approx(4 * n)  # the buffer filled as gradients are made
    assert acc.buffers == pytest.approx(2 * mlp + 2 * largest_param_per_gpu(MODEL, lay) + 4 * mlp)


def test_fsdp_under_pp_keeps_the_stage_unsharded():
    """pipelining/stage.py backward_maybe_with_nosync: reshard_after_backward and gradient sync are off for every
    micro-batch's backward, so even ZeRO-3 holds the whole stage's bf16 parameters and fp32 gradients."""
    lay = Layout(dp=8, tp=1, pp=2, zero_stage=3, grad_accum=4, reduce_dtype="fp32")
    mem = memory_per_gpu(MODEL, lay, HW)
    n, root, mlp = _n(lay, mem.stage), _root(lay, mem.stage), fsdp_unit_params_per_gpu(MODEL, lay)
    assert mem.params == pytest.approx(4 * n / 8 + 2 * n)
    assert mem.grads == pytest.approx(4 * n + 2 * root + 2 * mlp)
    assert mem.optimizer == pytest.approx(8 * n / 8)
    assert mem.buffers == pytest.approx(2 * mlp + (4 - 2) * mlp)


def test_replicate_is_ddp_memory_plus_bf16_working_copies():
    """With TP the token embedding's gradient is whole on every TP rank (DTensor's embedding backward keeps no
    vocabulary sharding): the accumulated one, in reduce_dtype, holds the other (t - 1)/t of the rows too."""
    lay = Layout(dp=4, tp=2, pp=1, zero_stage=0, grad_accum=4, reduce_dtype="fp32")
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.params == pytest.approx(4 * n + 2 * n)
    whole_embedding_grad = 1000 * 256 * 4 * (1 - 1 / 2)  # rows x h x fp32 x the other half
    assert mem.grads == pytest.approx(4 * n + 2 * layer + whole_embedding_grad)
    assert mem.optimizer == pytest.approx(8 * n)
    assert mem.buffers == pytest.approx(4 * layer)  # one layer's fp32 all-reduce input


def test_cpu_offload_moves_the_fp32_shards_and_adam():
    lay = Layout(dp=4, tp=1, pp=1, zero_stage=3, offload_optimizer=True, offload_params=True)
    mem, n, layer, root = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay), _root(lay)
    mlp = fsdp_unit_params_per_gpu(MODEL, lay)
    assert mem.optimizer == 0
    assert mem.params == pytest.approx(2 * (root + layer))
    assert 4 * mlp > 2 * root
    assert mem.grads == pytest.approx(2 * root + 2 * mlp)  # bf16 reduction: c = r = 2
    assert mem.buffers == pytest.approx(2 * mlp + 2 * mlp)
    assert mem.cpu_offload_bytes == pytest.approx((4 + 4 + 8) * n / 4)
    accum = memory_per_gpu(
        MODEL,
        Layout(
            dp=4,
            tp=1,
            pp=1,
            zero_stage=2,
            offload_optimizer=True,
            grad_accum=4,
            reduce_dtype="fp32",
            accumulate_unsharded=True,
        ),
        HW,
    )
    assert accum.grads == pytest.approx(4 * n)  # the unsharded buffer stays on the GPU
    assert accum.cpu_offload_bytes == pytest.approx(16 * n / 4)


def test_gpt3_1_3b_zero2_dp8_states():
    """The 1.3B run (ZeRO-2, DP 8, 8 accumulation steps, fp32 reduction): 4 n / 8 + 2 n of parameters, fp32
    gradient shards 4 n / 8, 8 n / 8 of Adam, plus the root's (the tied embedding's) gradient held through
    backward: 4 bytes/param plus that, where the ZeRO paper's ZeRO-2 says 3.75 (2 + (2 + 12) / 8: its gradients
    are 16-bit). The buffers apart: one layer's all-gather output, and the root's fp32 reduce-scatter input (the
    backward's last and largest)."""
    model = gpt(24, 2048, 16, 2048, 50257, vocab_pad_multiple=64)
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=2, micro_batch=8, grad_accum=8, reduce_dtype="fp32")
    mem = memory_per_gpu(model, lay, HW)
    n, layer = stage_params_per_gpu(model, Layout(dp=1, tp=1, pp=1), 0), layer_params_per_gpu(model, 1)
    root = n - 24 * layer
    assert n == model.params + (50304 - 50257) * 2048
    assert 4 * root > 6 * layer
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(4 * n + 2 * root)
    assert mem.buffers == pytest.approx(2 * layer + 4 * root)
    assert zero_model_states(n, 8, 2).total == pytest.approx(3.75 * n)


def test_the_search_prices_unsharded_accumulation_against_per_micro_batch_reduce_scatters():
    """parallel=auto may pick zero.accumulate_unsharded: each such candidate moves less DP traffic than the same
    layout reduce-scattering every micro-batch, is no slower, and holds more gradient memory."""
    from dataclasses import replace

    from hpctrain.plan.search import search_layouts

    candidates = {c.layout: c for c in search_layouts(MODEL, 16, HW, 64, zero_stages=(2, 3))}
    pairs = [
        (candidates[replace(lay, accumulate_unsharded=False)], c)
        for lay, c in candidates.items()
        if lay.accumulate_unsharded and replace(lay, accumulate_unsharded=False) in candidates
    ]
    assert pairs
    for per_micro_batch, once in pairs:
        assert once.layout.pp == 1 and once.layout.microbatches > 1 and once.layout.zero_stage >= 2
        assert once.step.comm.dp_bytes < per_micro_batch.step.comm.dp_bytes
        assert once.tokens_per_s >= per_micro_batch.tokens_per_s
        assert once.memory.grads > per_micro_batch.memory.grads


@pytest.mark.parametrize("stage, bound", [(1, 6 + 12 / 64), (2, 1.1 * (2 + 16 / 64)), (3, 2 * 16 / 64)])
def test_gpt3_6_7b_on_64_gpus_meets_zeros_bytes(capsys, compose_cfg, stage: int, bound: float) -> None:
    """Issue 31's table through the dry run's JSON: model states per parameter the GPU holds as built, ZeRO-1 at
    Megatron's 6 + 12/N, ZeRO-2 within 1.1 x the paper's 2 + 16/N (with fp32 gradient shards: 2 + 4/N + 12/N),
    ZeRO-3 within 2 x 16/N."""
    cfg = compose_cfg(
        "+experiment=175b",
        "model=gpt3_6.7b",
        "cluster.nodes=8",
        "parallel.dp=64",
        "parallel.tp=1",
        "parallel.pp=1",
        f"zero.stage={stage}",
        "dry_run=true",
        "plan.format=json",
    )
    assert run(cfg).code == 0
    plan = json.loads(capsys.readouterr().out)
    per_param = plan["model_states_bytes_per_param"]
    assert per_param["params_on_gpu"] == plan["params_total"] + plan["vocab_padding"]["extra_params"]
    assert per_param["total"] <= bound, per_param
    assert per_param["total"] == pytest.approx(per_param["params"] + per_param["grads"] + per_param["optimizer"])
    if stage == 1:
        assert (per_param["params"], per_param["grads"], per_param["optimizer"]) == (2 + 4 / 64, 4.0, 8 / 64)
