"""What hpctrain's torch wrappers hold per GPU (hpctrain/plan/states.py): DDP and ZeroRedundancyOptimizer with
fp32 master parameters, FSDP2's unsharded working parameters and unsharded accumulated gradients, CPU offload."""

import pytest

from hpctrain.plan.memory import layer_params_per_gpu, memory_per_gpu, stage_params_per_gpu
from hpctrain.plan.states import data_parallel_kind, effective_zero_stage, zero_model_states
from hpctrain.plan.types import GiB, Hardware, Layout, ModelShape

HW = Hardware("test", 8, 80 * GiB, 312e12, 300e9, 25e9)
MODEL = ModelShape(4, 256, 4, 64, 1000)


def _n(lay: Layout, stage: int = 0) -> float:
    return stage_params_per_gpu(MODEL, lay.tp, lay.pp, stage)


def _layer(lay: Layout) -> float:
    return layer_params_per_gpu(MODEL, lay.tp)


def test_which_wrapper_runs():
    """engine.py: DDP for pure DP with ZeRO-0/1, FSDP2 fully_shard for ZeRO >= 2 or any DP with TP/PP (replicate
    for ZeRO-0), nothing without DP."""
    assert data_parallel_kind(Layout(dp=1, tp=2, pp=2, zero_stage=3)) == "none"
    assert data_parallel_kind(Layout(dp=8, tp=1, pp=1, zero_stage=1)) == "ddp"
    assert data_parallel_kind(Layout(dp=8, tp=1, pp=1, zero_stage=2)) == "fsdp"
    assert data_parallel_kind(Layout(dp=4, tp=2, pp=1, zero_stage=0)) == "replicate"
    assert data_parallel_kind(Layout(dp=4, tp=1, pp=2, zero_stage=1)) == "fsdp"


def test_zero1_on_ddp_is_fp32_params_and_grads_plus_sharded_adam():
    """ZeroRedundancyOptimizer shards only the optimizer state; DDP keeps the fp32 parameters (the master weights)
    and their fp32 gradients whole on every rank. The ZeRO paper's P_os (2 + 2 + 12/N) undercounts it."""
    fp32 = Layout(dp=8, tp=1, pp=1, zero_stage=1, dtype="fp32")
    mem, n = memory_per_gpu(MODEL, fp32, HW), _n(fp32)
    assert (mem.params, mem.grads, mem.optimizer) == pytest.approx((4 * n, 4 * n, 8 * n / 8))
    bf16 = Layout(dp=8, tp=1, pp=1, zero_stage=1, dtype="bf16")
    mem = memory_per_gpu(MODEL, bf16, HW)
    # + the bf16 weight copies autocast makes in forward and the matmuls save for backward
    assert (mem.params, mem.grads, mem.optimizer) == pytest.approx((4 * n + 2 * n, 4 * n, 8 * n / 8))
    paper = zero_model_states(n, 8, 1)
    assert mem.params + mem.grads + mem.optimizer > paper.total + 5 * n


def test_ddp_gradients_are_full_fp32_with_or_without_accumulation():
    """no_sync accumulates into the same fp32 .grad DDP reduces (gradient_as_bucket_view=True): nothing extra."""
    one = memory_per_gpu(MODEL, Layout(dp=8, tp=1, pp=1, grad_accum=1), HW)
    eight = memory_per_gpu(MODEL, Layout(dp=8, tp=1, pp=1, grad_accum=8), HW)
    assert one.grads == eight.grads == pytest.approx(4 * _n(Layout(dp=8, tp=1, pp=1)))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_zero1_with_tp_or_pp_is_modelled_as_the_zero2_that_runs(tp, pp):
    """data_parallel.py: with TP or PP, ZeRO-1 is FSDP2 with reshard_after_forward=False, i.e. ZeRO-2."""
    z1 = Layout(dp=4, tp=tp, pp=pp, zero_stage=1, grad_accum=4)
    z2 = Layout(dp=4, tp=tp, pp=pp, zero_stage=2, grad_accum=4)
    assert effective_zero_stage(z1) == 2
    a, b = memory_per_gpu(MODEL, z1, HW), memory_per_gpu(MODEL, z2, HW)
    assert (a.params, a.grads, a.optimizer, a.activations) == (b.params, b.grads, b.optimizer, b.activations)


def test_fsdp_zero2_without_accumulation():
    """fp32 shards of params, grads, Adam + the bf16 unsharded parameters (reshard_after_forward=False) + one
    layer's unsharded bf16 gradient and its fp32 reduce-scatter input."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=2, grad_accum=1, reduce_dtype="fp32")
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.params == pytest.approx(4 * n / 8 + 2 * n)
    assert mem.grads == pytest.approx(4 * n / 8 + (2 + 4) * layer)
    assert mem.optimizer == pytest.approx(8 * n / 8)


@pytest.mark.parametrize("reduce_dtype, r", [("fp32", 4), ("bf16", 2)])
def test_fsdp_accumulation_keeps_unsharded_gradients_in_the_reduce_dtype(reduce_dtype, r):
    """set_requires_gradient_sync(False): post_backward skips the reduce-scatter and
    to_accumulated_grad_if_needed upcasts the unsharded gradient to reduce_dtype (bf16 reduce: it stays .grad)."""
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=2, grad_accum=8, reduce_dtype=reduce_dtype)
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.grads == pytest.approx(max(r * n, 4 * n / 8) + (2 + r) * layer)


def test_zero3_with_accumulation_holds_full_gradients():
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=3, grad_accum=8, reduce_dtype="fp32")
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.params == pytest.approx(4 * n / 8 + 2 * 2 * layer)  # the gathered layer and the prefetched one
    assert mem.grads == pytest.approx(4 * n + 6 * layer)
    no_accum = memory_per_gpu(MODEL, Layout(dp=8, tp=1, pp=1, zero_stage=3, reduce_dtype="fp32"), HW)
    assert no_accum.grads == pytest.approx(4 * n / 8 + 6 * layer)


def test_fsdp_under_pp_keeps_the_stage_unsharded():
    """pipelining/stage.py backward_maybe_with_nosync: reshard_after_backward and gradient sync are off for every
    micro-batch's backward, so even ZeRO-3 holds the whole stage's bf16 parameters and fp32 gradients."""
    lay = Layout(dp=8, tp=1, pp=2, zero_stage=3, grad_accum=4, reduce_dtype="fp32")
    mem = memory_per_gpu(MODEL, lay, HW)
    n, layer = _n(lay, mem.stage), _layer(lay)
    assert mem.params == pytest.approx(4 * n / 8 + 2 * n)
    assert mem.grads == pytest.approx(4 * n + 6 * layer)
    assert mem.optimizer == pytest.approx(8 * n / 8)


def test_replicate_is_ddp_memory_plus_bf16_working_copies():
    """With TP the token embedding's gradient is whole on every TP rank (DTensor's embedding backward keeps no
    vocabulary sharding): the accumulated one, in reduce_dtype, holds the other (t - 1)/t of the rows too."""
    lay = Layout(dp=4, tp=2, pp=1, zero_stage=0, grad_accum=4, reduce_dtype="fp32")
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.params == pytest.approx(4 * n + 2 * n)
    whole_embedding_grad = 1000 * 256 * 4 * (1 - 1 / 2)  # rows x h x fp32 x the other half
    assert mem.grads == pytest.approx(4 * n + 6 * layer + whole_embedding_grad)
    assert mem.optimizer == pytest.approx(8 * n)


def test_cpu_offload_moves_the_fp32_shards_and_adam():
    lay = Layout(dp=4, tp=1, pp=1, zero_stage=3, offload_optimizer=True, offload_params=True)
    mem, n, layer = memory_per_gpu(MODEL, lay, HW), _n(lay), _layer(lay)
    assert mem.optimizer == 0
    assert mem.params == pytest.approx(2 * 2 * layer)
    assert mem.grads == pytest.approx((2 + 2) * layer)
    assert mem.cpu_offload_bytes == pytest.approx((4 + 4 + 8) * n / 4)
    accum = memory_per_gpu(MODEL, Layout(dp=4, tp=1, pp=1, zero_stage=2, offload_optimizer=True, grad_accum=4,
                                         reduce_dtype="fp32"), HW)
    assert accum.grads == pytest.approx(4 * n + 6 * layer)  # the unsharded accumulation stays on the GPU
    assert accum.cpu_offload_bytes == pytest.approx(16 * n / 4)


def test_gpt3_1_3b_zero2_dp8_states():
    """The 1.3B run (ZeRO-2, DP 8, 8 accumulation steps, fp32 reduction): 4 n / 8 + 2 n of parameters, 4 n of
    fp32 accumulated gradients, 8 n / 8 of Adam: 7.5 bytes/param where the ZeRO paper's ZeRO-2 says 3.75."""
    model = ModelShape(24, 2048, 16, 2048, 50257, vocab_pad_multiple=64)
    lay = Layout(dp=8, tp=1, pp=1, zero_stage=2, micro_batch=8, grad_accum=8, reduce_dtype="fp32")
    mem = memory_per_gpu(model, lay, HW)
    n, layer = stage_params_per_gpu(model, 1, 1, 0), layer_params_per_gpu(model, 1)
    assert n == model.params + (50304 - 50257) * 2048
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(7.5 * n + 6 * layer)
    assert zero_model_states(n, 8, 2).total == pytest.approx(3.75 * n)
