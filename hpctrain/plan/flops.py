"""FLOPs of a training iteration of any model family, and MFU.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 5.1 / appendix) count only matrix multiplications. One layer's forward pass on a
batch of B sequences of length s with hidden size h costs 24 B s h^2 + 4 B s^2 h (QKV 6Bsh^2,
attention scores and their product with V 4Bs^2h, output projection 2Bsh^2, MLP 16Bsh^2), and the
logit layer 2 B s h V. Backward is twice the forward. With full activation recomputation each layer's
forward runs twice, which gives their eq. (3):

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))

Without recomputation the layers cost 3x instead of 4x forward: F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
(the vocabulary term changes too, since the logit layer is never recomputed). Korthikanti et al. 2022's
selective recomputation reruns the attention core, 4 B s^2 h per layer; hpctrain's (hpctrain.parallel.recompute,
for flash attention) saves the attention's and the matmuls' outputs and reruns element-wise work only, except
under TP, where the attention's output projection (a partial sum, not saved: its collective's output is) reruns,
2 B s q h per layer (`recomputed_forward_flops`; q the query width). For an MLP of width f, "24 h^2" is
8 h^2 + 4 h f.

Llama: grouped-query attention makes the K and V projections k = n_kv_heads x head_dim wide, and the SwiGLU MLP
has three h x f matrices (gate, up, down), so "24 h^2" becomes 2 (2 h^2 + 2 h k + 3 h f) = 4 h^2 + 4 h k + 6 h f
(Llama 3 405B: k = h / 16, f = 3.25 h: 23.75 h^2). The attention core is unchanged: each of the a query heads
still forms its s x s scores and their product with V, 4 B s^2 h, GQA only sharing K and V between heads.
Elementwise work (RMSNorm, RoPE, silu, the gate product) is not counted, as LayerNorm and GELU are not.

FP8 (precision.fp8, torchao's Float8Linear): only the transformer blocks' Linear layers run their GEMMs in FP8
(`fp8_flops_per_iteration`: the dense part of every layer pass, recomputed forwards included); the attention
core (Q K^T, scores x V) and the logit layer stay in bf16, so a step takes `compute_seconds` of both rates.

Mixture of Experts (a family with `Family.moe`): a token is multiplied by the router (E x h, every token) and by
top_k of the n_experts SwiGLU experts, so "3 h f" becomes E h + 3 top_k h f_e: the block's active matrices
(ModelShape.block_matmul_params). TP leaves the MoE layer whole (`Family.tp_whole`): each of the t TP ranks runs
it on the full sequence, so the GPUs together execute it t times (ModelShape.whole_matmul_params, counted t times
here, once in MFU). Expert parallelism moves rows, not FLOPs; its cost is in comm.py and step_time.py.

These are "hardware FLOPs" (what the GPUs execute). MFU (Chowdhery et al. 2022, PaLM, appendix B) counts
"model FLOPs" only, no recomputation: 6 N + 12 l s h per token (N the active parameters: a Mixture of Experts
counts top_k of its experts; the attention term counts the full s x s score matrix, as the Megatron formula does).
"""

from __future__ import annotations

from hpctrain.models import params
from hpctrain.plan.types import ModelShape


def layer_forward_flops(
    tokens: float,
    seq_len: int,
    d_model: int,
    ffn_hidden: int | None = None,
    kv_dim: int | None = None,
    gated: bool = False,
) -> float:
    """Matmul FLOPs of one layer's forward pass over `tokens` tokens in sequences of seq_len.

    kv_dim: the width of K and V (grouped-query attention), d_model when None; gated: a SwiGLU MLP (3 matrices)."""
    return linear_forward_flops(tokens, d_model, ffn_hidden, kv_dim, gated) + attention_core_flops(
        tokens, seq_len, d_model
    )


def linear_forward_flops(
    tokens: float, d_model: int, ffn_hidden: int | None = None, kv_dim: int | None = None, gated: bool = False
) -> float:
    """The Linear layers' share of one layer's forward (QKV, output projection, MLP): what FP8 converts."""
    h = d_model
    f = ffn_hidden if ffn_hidden is not None else 4 * h
    k = kv_dim if kv_dim is not None else h
    return 2 * tokens * (h * (h + 2 * k) + h * h + (3 if gated else 2) * h * f)


def attention_core_flops(tokens: float, seq_len: int, q_dim: int) -> float:
    """Q K^T and softmax x V of one layer's forward; q_dim = n_heads x head_dim (d_model unless the head width is
    set apart)."""
    return 4 * tokens * seq_len * q_dim


def recomputed_forward_flops(model: ModelShape, tokens: float, recompute: str, tp: int = 1) -> float:
    """Matmul FLOPs one layer's selective recomputation reruns (all GPUs together): the attention's output
    projection under TP (its output is a partial sum the policy does not save), nothing else."""
    return 2 * tokens * model.dims.q_dim * model.dims.d_model if recompute == "selective" and tp > 1 else 0.0


def flops_per_iteration(model: ModelShape, global_batch: int, recompute: str = "full", tp: int = 1) -> float:
    """Hardware FLOPs of one training iteration (all GPUs together), Narayanan 2021 eq. (3) generalised.

    The logit layer multiplies by the embedding as built: its rows padded for TP (ModelShape.vocab_rows). The
    Linear layers are the family's block matrices (ModelShape.block_matmul_params: `linear_forward_flops` for GPT
    and Llama), the attention core is over the query width n_heads x head_dim.
    """
    tokens = global_batch * model.seq_len
    core = attention_core_flops(tokens, model.seq_len, model.dims.q_dim)
    # layer_forward_flops for the family's block; the modules TP leaves whole run on every TP rank
    layer_fwd = 2 * tokens * (model.block_matmul_params + (tp - 1) * model.whole_matmul_params) + core
    logits_fwd = 2 * tokens * model.dims.d_model * model.vocab_rows(tp)
    layer_passes = forward_passes(recompute) * layer_fwd + recomputed_forward_flops(model, tokens, recompute, tp)
    return model.dims.n_layers * layer_passes + 3.0 * logits_fwd


def forward_passes(recompute: str) -> float:
    """A layer's passes in forward-pass units: forward + backward (2x), and full recomputation's second forward
    (selective recomputation reruns at most the attention's output projection: `recomputed_forward_flops`)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute {recompute!r}")
    return 4.0 if recompute == "full" else 3.0


def expert_flops_per_iteration(model: ModelShape, global_batch: int, recompute: str = "full", tp: int = 1) -> float:
    """The experts' grouped GEMMs in `flops_per_iteration` (all GPUs together, every TP rank running them): the
    work the busiest expert-parallel rank does more of when the routing is uneven (step_time.py). 0 when dense."""
    tokens = global_batch * model.seq_len
    return model.dims.n_layers * forward_passes(recompute) * 2 * tokens * tp * model.expert_matmul_params


def fp8_flops_per_iteration(
    model: ModelShape, global_batch: int, recompute: str = "full", fp8: str = "none", tp: int = 1
) -> float:
    """The part of `flops_per_iteration` that runs as FP8 GEMMs with precision.fp8 on: the blocks' Linears in
    forward, both backward GEMMs (input and weight gradient) and a full recomputation's second forward, under
    both torchao recipes (tensorwise, rowwise), and selective recomputation's rerun output projection (TP).
    0 without FP8. In a Mixture of Experts only the attention's Linears are counted: torchao
    converts nn.Linear, and the experts are stacked parameters run by grouped GEMMs, the router a matmul in fp32;
    shared experts' Linears (none of the configured models has them) would convert, and are counted at bf16."""
    if fp8 == "none":
        return 0.0
    # the modules TP leaves whole (an MoE layer: stacked experts, not Linears; the router, in fp32) stay bf16
    linear_fwd = 2 * global_batch * model.seq_len * (model.block_matmul_params - model.whole_matmul_params)
    tokens = global_batch * model.seq_len
    return model.dims.n_layers * (
        forward_passes(recompute) * linear_fwd + recomputed_forward_flops(model, tokens, recompute, tp)
    )


def compute_seconds(
    flops: float, fp8_flops: float, n_gpus: int, peak_flops: float, fp8_peak_flops: float, efficiency: float
) -> float:
    """Matmul time of an iteration spread over n_gpus: `fp8_flops` of it at the FP8 peak (the bf16 peak on a GPU
    without FP8, fp8_peak_flops = 0: torchao's emulation there is no faster), the rest at the bf16 peak, both at
    the same matmul efficiency. FP8's casts (an amax reduction and a scaled copy per operand, memory-bound) are
    not counted, so this is FP8's best case."""
    if not 0 <= fp8_flops <= flops:
        raise ValueError(f"fp8_flops must be in [0, flops], got {fp8_flops} of {flops}")
    fp8_rate = fp8_peak_flops if fp8_peak_flops > 0 else peak_flops
    return (flops - fp8_flops) / n_gpus / (peak_flops * efficiency) + fp8_flops / n_gpus / (fp8_rate * efficiency)


def narayanan_flops(batch: int, seq_len: int, n_layers: int, d_model: int, vocab_size: int) -> float:
    """Eq. (3) of Narayanan 2021 verbatim (full recomputation, f = 4h), for cross-checking."""
    B, s, L, h, V = batch, seq_len, n_layers, d_model, vocab_size
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def model_flops_per_token(model: ModelShape) -> float:
    """MFU's numerator per token (hpctrain.models.params: 6 N + 12 l s h, h the query width), N the active
    parameters (ModelShape.active_params: the total for a dense model)."""
    return params.model_flops_per_token(model.active_params, model.dims.n_layers, model.seq_len, model.dims.q_dim)


def mfu(tokens_per_s: float, model: ModelShape, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOP/s achieved over the GPUs' combined dense peak."""
    return tokens_per_s * model_flops_per_token(model) / (n_gpus * peak_flops)


def training_time_s(
    model: ModelShape,
    tokens: float,
    global_batch: int,
    n_gpus: int,
    flops_per_gpu: float,
    recompute: str = "full",
    tp: int = 1,
) -> float:
    """End-to-end time for `tokens` at an achieved per-GPU (hardware) FLOP/s (Narayanan 2021 sec. 5.1: ~8TP/(nX))."""
    iterations = tokens / (global_batch * model.seq_len)
    return iterations * flops_per_iteration(model, global_batch, recompute, tp) / (n_gpus * flops_per_gpu)
