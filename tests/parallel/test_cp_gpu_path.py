"""Context parallelism's GPU path, checked on CPU: the attention kernel a GPU runs for CP's chunks
(`gpu_chunk_kernel`, torch 2.13's `CausalBias._dispatch`), and that selective recomputation saves that kernel's
output on the path fp32 takes there (`_efficient_attention_forward`, which the CPU build has no kernel for: the
test registers a reference one, so `CausalBias._dispatch`'s own GPU branch runs on gloo ranks)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from hpctrain.models.common import attention
from hpctrain.parallel import context_parallel as cpmod
from tests.distributed_harness import run_distributed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,kernel",
    [
        (BF16, 16, 1, 128, "flash"),  # Llama 3 405B at TP 8: one KV head a rank, grouped heads kept
        (BF16, 4, 2, 16, "flash"),  # the layout suite's tiny Llama (fake CUDA's cp2)
        (FP16, 8, 8, 64, "flash"),
        (BF16, 32, 8, 36, "flash"),  # CausalBias pads the head to a multiple of 8 itself
        (FP32, 4, 2, 16, "efficient"),  # heads repeated by grouped_kv, then the kernel's lower-right variant
        (FP32, 8, 8, 64, "efficient"),
        (BF16, 8, 2, 512, "efficient"),  # past flash's 256: repeated, then efficient
        (FP32, 8, 8, 6, "math"),  # fp32 efficient needs head_dim % 4 == 0
        (torch.float64, 8, 2, 64, "math"),
    ],
)
def test_cp_chunks_run_a_fused_kernel_on_gpus(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, kernel: str
) -> None:
    assert cpmod.gpu_chunk_kernel(dtype, heads, kv_heads, head_dim) == kernel


def _lower_right_mask(m: int, n: int, mask_type: int) -> torch.Tensor | None:
    """The efficient kernel's custom_mask_type as a boolean [m, n] (True: attend): 0 none, 1 top-left causal,
    2 bottom-right causal."""
    if mask_type == 0:
        return None
    rows, cols = torch.arange(m).unsqueeze(1), torch.arange(n).unsqueeze(0)
    return cols <= rows + (n - m if mask_type == 2 else 0)


def _reference_efficient(calls: list[str]) -> torch.library.Library:
    """CPU kernels for aten::_efficient_attention_forward/_backward (the CUDA memory-efficient kernel's ops, in its
    [B, M, H, K] layout), computed exactly in float64; each call is appended to `calls`."""
    lib = torch.library.Library("aten", "IMPL")

    def scores(query, key, mask_type, scale):  # noqa: ANN001, ANN202
        q, k = query.double().transpose(1, 2), key.double().transpose(1, 2)  # [B, H, M, K]
        s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        mask = _lower_right_mask(s.shape[-2], s.shape[-1], mask_type)
        return s if mask is None else s.masked_fill(~mask, float("-inf"))

    def forward(
        query,
        key,
        value,
        bias,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        mask_type,  # noqa: ANN001, ANN202
        compute_log_sumexp=False,
        *,
        scale=None,
        seqlen_k=None,
        window_size=None,
    ):
        calls.append("forward")
        s = scores(query, key, mask_type, scale)
        out = torch.softmax(s, -1) @ value.double().transpose(1, 2)
        lse = torch.logsumexp(s, -1)
        zero = torch.zeros((), dtype=torch.int64)
        return (
            out.transpose(1, 2).to(query.dtype).contiguous(),
            lse.float(),
            zero,
            zero.clone(),
            query.shape[1],
            key.shape[1],
        )

    def backward(
        grad_out,
        query,
        key,
        value,
        bias,
        out,
        cu_q,
        cu_k,
        max_q,
        max_k,
        lse,  # noqa: ANN001, ANN202
        dropout_p,
        seed,
        offset,
        mask_type,
        bias_requires_grad,
        *,
        scale=None,
        num_splits_key=None,
        window_size=None,
        shared_storage_dqdkdv=False,
    ):
        calls.append("backward")
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        p = torch.softmax(scores(query, key, mask_type, scale), -1)
        q, k, v = (t.double().transpose(1, 2) for t in (query, key, value))
        do, o = grad_out.double().transpose(1, 2), out.double().transpose(1, 2)
        dv = p.transpose(-1, -2) @ do
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq, dk = ds @ k * scale, ds.transpose(-1, -2) @ q * scale
        return (*(g.transpose(1, 2).to(query.dtype).contiguous() for g in (dq, dk, dv)), torch.empty(0))

    lib.impl("_efficient_attention_forward", forward, "CPU")
    lib.impl("_efficient_attention_backward", backward, "CPU")
    return lib


class _AttentionCalls:
    """A dispatch mode counting the attention kernels' forward ops (any op named *attention* but not *backward*)
    dispatched while it is entered: on CPU, backward and its recomputation run on this thread."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                name = func._overloadpacket.__name__
                if "attention" in name and "backward" not in name:
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts, self.mode = counts, Count()


def _attention_calls(rank: int, world: int, mode: str) -> tuple[dict[str, int], dict[str, int], float]:
    """A 2-layer CP Llama in fp32 (GQA 4/2) on the path an sm80+ GPU takes (heads repeated by `grouped_kv`,
    `CausalBias._dispatch`'s memory-efficient branch for a chunk with fewer queries than keys, SDPA's own kernel
    for a square one), under recomputation `mode`: the attention kernels' forward calls in forward and again in
    backward, and the largest difference of the loss and gradients from the same model without recomputation
    (and of that loss from CPU's own kernel path)."""
    import torch.nn.attention.bias as bias_module

    from hpctrain.models.llama.model import Llama, LlamaArgs
    from hpctrain.parallel.recompute import apply_recompute

    tokens = cpmod.shard_sequence(
        torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1)), world, rank
    )

    def cp_model(recompute: str) -> torch.nn.Module:
        model = Llama(LlamaArgs(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=50, ffn_hidden=64))
        model.init_weights(seed=0)
        cpmod.apply_context_parallel(model, dist.group.WORLD)
        apply_recompute(model, recompute)
        return model

    cpu_loss = cp_model("none")(tokens).float().mean().detach()  # CPU's own path: the emulated kernels' reference
    calls: list[str] = []
    lib = _reference_efficient(calls)  # noqa: F841 (registered for the rest of this forked rank)
    attention.sdpa_expands_kv = lambda dtype, device, *rest: dtype == torch.float32  # CUDA's rule, on CPU
    bias_module.can_use_flash_attention = lambda params, debug=False: False  # fp32: flash refuses the dtype
    bias_module.can_use_efficient_attention = lambda params, debug=False: True

    results = []
    for recompute in ("none", mode):
        model = cp_model(recompute)
        forward, backward = _AttentionCalls(), _AttentionCalls()
        with forward.mode:
            loss = model(tokens).float().mean()
        with backward.mode:
            loss.backward()
        results.append((forward.counts, backward.counts, loss.detach(), [p.grad for p in model.parameters()]))
    assert "backward" in calls  # the registered kernels ran, backward included
    (_, _, ref_loss, ref_grads), (forward_counts, backward_counts, loss, grads) = results
    diff = max(
        [float((loss - ref_loss).abs()), float((ref_loss - cpu_loss).abs())]
        + [float((g - r).abs().max()) for g, r in zip(grads, ref_grads)]
    )
    return forward_counts, backward_counts, diff


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_selective_recomputation_keeps_cp_fp32_attention(mode: str) -> None:
    """fp32 CP on a GPU runs `_efficient_attention_forward` (CausalBias's branch) for a chunk with fewer queries than
    keys, not SDPA's `_scaled_dot_product_efficient_attention`: the selective policy must save it too, so backward
    runs no attention forward again. Per layer, rank 0 holds chunks 0 (square: SDPA's own causal kernel) and 3,
    rank 1 chunks 1 and 2. Full recomputation reruns every one of them."""
    out = run_distributed(_attention_calls, 2, mode, timeout=120)
    layers, efficient, square = 2, "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu"
    for rank, (forward, backward, diff) in enumerate(out):
        chunks = cpmod.chunk_ids(2, rank)
        expected = {efficient: layers * sum(c > 0 for c in chunks)} | ({square: layers} if 0 in chunks else {})
        assert forward == expected, (rank, forward)
        assert backward == ({} if mode == "selective" else expected), (rank, backward)
        assert diff < 1e-6, (rank, diff)
