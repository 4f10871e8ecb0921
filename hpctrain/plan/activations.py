"""Activation memory of one transformer layer and of the output head: the paper's and what hpctrain saves.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4) count the
bytes Megatron-LM saves for backward per layer and micro-batch, with 16-bit activations, sequence s,
micro-batch b, hidden h, a heads, tensor-parallel size t (`korthikanti_bytes_per_layer` gives them verbatim):
    no parallelism              s b h (34 + 5 a s / h)
    tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel  s b h / t (34 + 5 a s / h)
    selective recompute (+SP)   34 s b h / t          (attention core recomputed)
    full recompute              2 s b h  (/t with SP) (only each layer's input is kept)
"34" is: LayerNorm inputs 4, QKV and MLP-in inputs 4, two residual dropout masks 2 (1 byte each), Q K V 6,
attention-output-projection input 2, GELU input and MLP-out input 16 (8 + 4 f / h for an MLP of width f).
"5 a s / h" is the attention matrix: softmax output 2, its dropout mask 1, dropout output 2.

hpctrain's model (`activation_bytes_per_layer`, checked against the tensors autograd saves for
hpctrain.models.gpt.model.Block on CPU: 32 s b h with dropout 0, 20 s b h with t = 2, 18 with t = 2 and SP):
  * Attention is torch.nn.functional.scaled_dot_product_attention. Its flash and memory-efficient kernels
    (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", sec. 3.1:
    backward recomputes the attention matrix from Q, K, V, the output and the softmax statistics; torch's
    SDPA docs, "torch.nn.functional.scaled_dot_product_attention": FlashAttention-2 and memory-efficient
    backends) never store the s x s matrix: the 5 a s / h term is gone. They save Q, K, V and the output
    (already counted) and the log-sum-exp, fp32 [b, a/t, s]: 4 a s b / t bytes. Attention dropout is
    regenerated from the RNG state in backward, so it stores no mask either.
  * Dropout masks (1 byte per element, torch's native_dropout) exist only when model.dropout > 0: with
    dropout 0, nn.Dropout returns its input and "34" becomes 32.
  * Sequence parallelism without recomputation keeps the all-gathered input of the QKV and MLP-in matmuls as this
    rank's slice and gathers it again in backward, as Megatron does (Korthikanti sec. 4.2.2;
    hpctrain.parallel.sequence_parallel, `Layout.sp_keeps_shards`): s b h / t (34), GPT with dropout. With
    recomputation (and FP8, under torch.compile, and under PP for now) the Linears take DTensor's path, which saves
    the gathered input whole on every TP rank (`sp_keeps_gathered`): those 4 s b h are not divided by t, s b h (4 +
    (4 + dropout 2 + 24) / t); an MoE block's own layer always runs on the gathered sequence (2 of the 4). Measured
    on 2 gloo ranks, both ways (tests/plan/test_plan_sp_shards.py), and for Llama 3 8B at TP 2 on fake CUDA
    (docs/recompute.md).
  * Without FSDP2 (no DP, or DDP) forward runs under torch.autocast: LayerNorm autocasts to fp32 and the
    residual stream stays fp32, so the LayerNorm inputs (and a checkpointed block's input) take 4 bytes.
  * Selective recompute is hpctrain.parallel.recompute's policy for flash attention: save the outputs of
    SDPA, of the matmuls and of the TP collectives, except a row-parallel matmul's partial sum (the collective
    after it is saved instead), and recompute the element-wise rest (`_selective_bytes`). Per layer: the block
    input 2 (/t with SP); split by TP, the QKV output 6, the attention output 2 and log-sum-exp 4 a / h, the
    MLP-in output 2 f / h; for the attention's and the MLP's row-parallel matmul each: its output 2 without TP,
    the all-reduce's output 2 with TP, the reduce-scatter's 2 / t with SP; with SP the all-gathered attention
    and MLP inputs 4. GPT (f = 4 h, sbh units, + log-sum-exp): 22 without TP (none: 32), 6 + 16 / t with TP
    (none: 8 + 24 / t), 4 + 22 / t with SP (none: 4 + 28 / t); GPT-3 175B at t = 8 + SP: 6.75 against 7.5
    (full: 0.25; Korthikanti's Megatron selective: 4.25, its SP keeping only the shards). Measured on CPU,
    byte for byte (tests/plan/test_plan_recompute.py).
fp32 activations (precision=fp32) are approximated by doubling.

Context parallelism (cp > 1, hpctrain.parallel.context_parallel: each CP rank holds s / cp tokens as two chunks and
all-gathers K and V over the CP group in every attention layer): everything above is per local token, so it is
counted at s / cp (sbh below: (s / cp) b h), and the attention saves, per TP rank (split by t):
  * the gathered K and V of the whole sequence (index_select's outputs, put back in global order, which each
    chunk's SDPA saves): 2 x 2 k cp / h sbh, i.e. 2 s b k bytes each;
  * each chunk's SDPA output 2 q / h besides their concatenation (the projection's input, counted above);
  * no longer the QKV output through V's view (V is gathered, not viewed), nor the local rotated K; the rotated Q
    stays (Llama), or, without RoPE (GPT), Q's view keeps the whole QKV output as before.
So Llama's 6 + 6 k / h (QKV output 2 + 4 k / h, rotated Q and K 2 + 2 k / h) becomes 2 + 4 k cp / h + 2. Measured
for the GPT and the Llama block on a 2-rank CP group on CPU (tests/plan/test_plan_cp.py), byte for byte beside a
few s-sized tensors left out (the CPU's materialised lower-right causal mask of the later chunks, the int64 gather
order, the norms' per-token statistics, the index-selected RoPE tables). Selective recomputation adds the
all-gather outputs, 4 k cp / h (the policy saves the collectives' outputs), measured byte for byte on the same
blocks (the extras above are rerun, not kept). Full recomputation keeps the block input of the local tokens.

hpctrain's Llama block (hpctrain.models.llama.model; g key/value heads of head_dim, so K and V are k = g h / a wide; a
SwiGLU MLP of width f; no biases), counted the same way from what autograd saves on CPU (sbh units, 16-bit):
  * RMSNorm (Hugging Face's: normalised in fp32) keeps an fp32 copy of its input 4 and the normalised tensor
    for the weight's gradient 2 (4 under autocast), besides its output, the QKV/MLP-in input 2: 2 x 6 + 4 = 16
    where GPT's LayerNorms and matmul inputs keep 8.
  * Attention: V is a view of the QKV output, so SDPA keeps that whole output alive, 2 (h + 2k) / h; RoPE makes
    new Q 2 and K 2 k / h, which SDPA saves (enable_gqa: K and V with their g heads); RoPE's own multiplications
    by constant cos/sin save only the tables (4 s head_dim x 2 bytes per layer, left out). With the output 2 and
    the log-sum-exp 4 a / h: 6 + 6 k / h + 4 a / h, against GPT's 8 + 4 a / h (k = h).
  * SwiGLU: the fused gate/up output 4 f / h (silu's input and the product's other factor are its halves),
    silu's output 2 f / h, the product (the down projection's input) 2 f / h: 8 f / h, against GELU's 4 f / h.
So GPT's 32 becomes 22 + 6 k / h + 8 f / h: 51.5 sbh for Llama 3 8B (k = h / 4, f = 3.5 h), all but the 16
norm and matmul-input bytes split by TP (the norms by SP). Measured on CPU for d 256, 8 heads, 2 key/value
heads, f 704: 45.91 sbh, the formula's 45.63 + the cached RoPE tables 0.25 + the per-token 1/rms 0.03 (tested).
Selective recompute keeps the QKV output
2 (h + 2k) / h, the attention output 2 and the gate/up output 4 f / h per TP rank, + the block input and the
row-parallel outputs (or their collectives'), as GPT's: 2 + (2 + 4 k / h) + 2 + 4 f / h + 4 = 10 + 4 k / h + 4 f / h
sbh without TP (25 for Llama 3 8B against 51.5; measured for the block above: 22.13 against 45.91).

A Mixture-of-Experts block (`BlockActivations.moe`: hpctrain.models.common.moe.MoE in place of the SwiGLU; E experts of
width f_e, top_k = k of them per token) keeps the attention's tensors as above, and for the feed-forward, per token
of the full sequence (TP leaves the layer whole: every TP rank runs it on all s b tokens, SP gathering its input;
nothing here is divided by t), in bytes (`moe_bytes_per_token`):
  * router, computed in fp32: the fp32 copy of its input 4 h (the bf16 norm output itself is not kept: the
    experts' rows are gathered from it, which keeps only the indices), the fp32 logits 4 E (the z-loss's
    logsumexp) and softmax output 4 E, the logsumexp and the top-k weights' sum 8;
  * routing: the top-k indices (int64) 8 k and weights (fp32) 4 k, the sorted order and its token ids (int64)
    16 k, the gathered combine weights (fp32) 4 k;
  * the experts, per routed row (k per token): its input 2 h, the gate and up outputs, silu's output and the
    product 8 f_e (the dense SwiGLU's 8 f per token, k times); under expert parallelism the busiest rank's experts
    run `load` x the mean rows (the imbalance factor, an assumption: EXPERT_IMBALANCE);
  * the combine, in fp32: the experts' output upcast for the weighted sum (saved by the product) and the weighted
    rows (saved by index_add_) 8 h k;
  * shared experts (a SwiGLU of width f_s on every token): its input 2 h and 8 f_s;
and, per layer and micro-batch, the router weight's fp32 copy and the balance loss's per-expert fractions,
4 E (h + 1). So the dense SwiGLU's 2 + 8 f / h sbh becomes (4 + 8 E / h + k (10 + 8 f_e / h)) sbh + 32 k + 8
per token: 108.3 sbh for Qwen3-235B-A22B (k = 8, f_e = 0.375 h), 80.0 for Mixtral-8x7B (k = 2, f_e = 3.5 h), against
30 for a dense SwiGLU of Mixtral's expert width. Measured on CPU for the MoE families' block, byte for byte
(tests/plan/test_plan_moe.py; the expert GEMMs' loop fallback). On a GPU
torch._grouped_mm runs the experts over rows padded to 8 per expert (8 E more rows) and keeps the padded-row
indices (8 k): a few rows more, not counted. Selective recompute keeps matmul outputs: the fp32 logits 4 E and,
per routed row, the gate, up and down outputs 4 f_e + 2 h (the loop's mm calls, or torch._grouped_mm's on a GPU,
over the padded rows); the router weight's fp32 copy and the balance loss's fractions are recomputed. Full
recompute keeps the block input only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpctrain import schedules

if TYPE_CHECKING:
    from hpctrain.models.family import Dims, Family


def korthikanti_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    ffn_hidden: int | None = None,
) -> float:
    """Korthikanti et al. 2022 eq. 1-2 and sec. 4 verbatim: Megatron's stored bytes of one layer, one micro-batch."""
    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    f = ffn_hidden if ffn_hidden is not None else 4 * h
    split = 8 + 4 * f / h  # Q, K, V, projection input, MLP inner activations: split by TP (24 for f = 4h)
    replicated = 10  # LayerNorm inputs, QKV and MLP inputs, dropout masks: split only by SP
    scores = 5 * a * s / h  # attention scores, softmax output, its dropout mask
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        scores = 0.0
    elif recompute != "none":
        raise ValueError(f"unknown recompute {recompute!r}")
    if sequence_parallel:
        return sbh / t * (replicated + split + scores)
    return sbh * (replicated + (split + scores) / t)


def _selective_bytes(sbh: float, t: int, sp: bool, split: float, input_bytes: int, rows: int) -> float:
    """hpctrain.parallel.recompute's selective policy (module docstring): the block input; the QKV, attention
    (output and log-sum-exp) and MLP-in outputs, `split` sbh split by TP; for each of the `rows` row-parallel
    matmuls its output (no TP) or the collective's after it, whole or with SP a 1/t slice; SP's all-gathered
    attention and MLP inputs."""
    shard = t if sp else 1
    return sbh * (input_bytes / shard + split / t + 2 * rows / shard + (4 if sp and t > 1 else 0))


# An assumption, not a measurement: under expert parallelism the busiest EP rank's experts run this many times the
# mean routed rows (top_k x tokens / ep per rank). Dropless routing sends each expert whatever the router picks, and
# a load-balancing loss keeps the load near, not at, the mean; step_time.py shows it with an interval.
EXPERT_IMBALANCE = 1.25

HEAD_NORM_BYTES = 6  # measured, tests/plan/test_plan_llama.py: RMSNorm's fp32 input copy (4) + normalised (2)


def moe_bytes_per_token(dims: Dims, recompute: str = "none", load: float = 1.0) -> float:
    """Bytes the MoE layer of `dims` (its experts, top_k, expert width and shared experts) saves for backward per
    token of the full sequence, 16-bit activations (module docstring); 4 E (h + 1) per layer and micro-batch come on
    top (the router weight's fp32 copy, the balance loss's per-expert fractions). `load`: the rows the busiest
    rank's experts run over the mean, top_k x tokens (under EP: the imbalance, EXPERT_IMBALANCE)."""
    h, e, k, f = dims.d_model, dims.n_experts, dims.top_k, dims.expert_hidden
    fs = dims.n_shared_experts * dims.expert_hidden  # the shared experts' SwiGLU width
    shared = 2 * h + 8 * fs if fs else 0
    if recompute == "full":
        return 0.0
    if recompute == "selective":  # matmul outputs: the logits and each routed row's gate, up and down outputs
        return 4 * e + load * k * (4 * f + 2 * h) + (4 * fs + 2 * h if fs else 0)
    router = 4 * h + 8 * e + 8  # fp32 input copy, logits and softmax output, logsumexp and the weights' sum
    routing = 32 * k  # top-k indices and weights, sorted order and token ids, gathered weights
    combine = 8 * h * k  # the experts' output in fp32 and the weighted rows index_add_ keeps
    experts = load * k * (2 * h + 8 * f)  # each routed row's input, gate/up, silu and product
    return router + routing + combine + experts + shared


def activation_bytes_per_layer(
    family: Family,
    dims: Dims,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    *,
    flash_attention: bool = True,
    dropout: bool = False,
    sp_keeps_gathered: bool = True,
    fp32_residual: bool = False,
    expert_load: float = 1.0,
    cp: int = 1,
) -> float:
    """Bytes the block of `family` at `dims` saves for backward per micro-batch of `seq_len` tokens (16-bit
    activations; the family's `BlockActivations`); see the module docstring. A Mixture-of-Experts block's experts
    are the Dims' (n_experts, top_k, expert_hidden, n_shared_experts), the busiest rank's running `expert_load` x
    the mean rows; cp: context parallelism, seq_len being this rank's s / cp tokens (the gathered keys and values
    of the whole sequence come on top: module docstring, "Context parallelism").

    flash_attention=False, dropout=True, sp_keeps_gathered=False give Korthikanti's no-recompute formula (GPT).
    sp_keeps_gathered: SP saves the gathered QKV and MLP inputs whole (DTensor's path), not as slices
    (`Layout.sp_keeps_shards`).
    """
    s, b, h, a, t = seq_len, micro_batch, dims.d_model, dims.n_heads, tp
    f = dims.ffn_hidden
    sbh, shard = s * b * h, (t if sequence_parallel else 1)
    norm_bytes = 4 if fp32_residual else 2
    block = family.activations
    experts = 0.0  # the MoE layer: whole on every TP rank, over all s b tokens
    if block.moe:
        if not dims.n_experts:
            raise ValueError(f"the {family.name} family's block is a Mixture of Experts: dims.n_experts is 0")
        experts = s * b * moe_bytes_per_token(dims, recompute, expert_load)
        if recompute == "none":  # the router weight's fp32 copy, the balance loss's f_e (recomputed otherwise)
            experts += 4 * dims.n_experts * (h + 1)
    q, kv = dims.q_dim / h, dims.kv_dim / h  # the widths of Q and of K (and V), over h
    qkv_out = 2 * q + 4 * kv  # the fused QKV output (Q, K, V as views of it: 6 without grouped-query attention)
    # the MLP-in output: gate and up fused, or GELU's input (an MoE layer's are counted in `experts`)
    fc_out = 0 if block.moe else (4 if block.gated_mlp else 2) * f / h
    if recompute == "full":
        return norm_bytes * sbh / shard
    lse = 4 * a / h if flash_attention else 0.0  # fp32 log-sum-exp per head and token
    gathered_kv = 4 * kv * cp if cp > 1 else 0.0  # CP: the whole sequence's K and V, over this rank's s / cp
    if recompute == "selective":
        saved = qkv_out + 2 * q + lse + fc_out + gathered_kv  # + the attention output (+ CP's all-gather outputs)
        return _selective_bytes(sbh, t, sequence_parallel, saved, norm_bytes, 1 if block.moe else 2) + experts
    if recompute != "none":
        raise ValueError(f"unknown recompute {recompute!r}")
    norm = 4 + norm_bytes if block.norm_fp32_copy else norm_bytes  # RMSNorm: fp32 input copy + normalised
    by_sp: float = 2 * norm + (2 if dropout else 0)  # the two norms, residual dropout masks
    gathered = 2 if block.moe else 4  # QKV and MLP-in inputs: replicated over TP; DTensor SP saves them gathered
    rope = 2 * (q + kv) if block.rope else 0  # the rotated Q and K SDPA saves (V stays a view of the QKV output)
    # per-head norms: HEAD_NORM_BYTES per element of Q and K, and an fp32 1/rms per head and token
    heads = (HEAD_NORM_BYTES * (q + kv) + 4 * (a + dims.kv_heads) / h) if block.head_norms else 0
    mlp = 0 if block.moe else fc_out + (4 if block.gated_mlp else 2) * f / h  # + silu's output, down's input
    if cp > 1:  # K and V are gathered: no view of the QKV output is saved, nor the local rotated K ...
        qkv_out, rope = (0.0, 2 * q) if block.rope else (qkv_out, 0.0)  # ... but Q (rotated, or a view of it)
        gathered_kv += 2 * q  # each chunk's SDPA output, besides their concatenation (the projection's input)
    split = qkv_out + rope + heads + 2 * q + mlp + gathered_kv  # + the attention output (the projection's input)
    if flash_attention:
        split += lse
    else:
        split += (5 if dropout else 2) * a * s / h  # softmax output (+ its dropout mask and output)
    if sequence_parallel and not sp_keeps_gathered:  # their slices, in the residual stream's dtype
        by_sp += gathered * norm_bytes / 2
        gathered = 0
    return sbh * (by_sp / shard + gathered + split / t) + experts


# The loss's fp32 working copy holds at most this many logits (hpctrain.parallel.tensor_parallel's
# LOSS_CHUNK_ELEMENTS; the planner imports no torch, tests/parallel/test_loss_parallel.py holds the two equal).
LOSS_CHUNK_ELEMENTS = 2**24


def logits_bytes(
    micro_batch: int,
    seq_len: int,
    vocab_rows: int,
    compute_bytes: int,
    stored: float = 1.0,
    tp: int = 1,
) -> float:
    """Peak bytes of the logits and the loss on one rank of the last stage, with `stored` micro-batches held.

    Each TP rank holds its slice of the [b, s, padded vocabulary] logits, ceil(vocab_rows / tp) columns: the
    loss is computed on the shards (hpctrain.parallel.tensor_parallel.vocab_parallel_cross_entropy, loss
    parallelism), which keeps the logits, in the compute dtype c, for its backward and a per-token fp32
    logsumexp, target index and mask (13 bytes a token, left out). Per element:
      forward  logits c;
      backward logits c + their gradient c = 2c;
    plus one chunk's fp32 working copy, 4 x min(elements, LOSS_CHUNK_ELEMENTS), in either. Under PP the
    schedule's kept stage output (torch.distributed.pipelining.stage `fwd_cache`) is the same tensor the loss
    keeps: nothing more. Each further micro-batch held (GPipe's last stage) keeps its logits, c.
    Measured on CPU (live storages through the head's output, the loss and its backward; 4096 tokens x 8192
    columns, two chunks): 6.03 bytes per element in bf16 (this: 6.0), 10.07 in fp32 (10.0).
    """
    c = compute_bytes
    elements = micro_batch * seq_len * -(-vocab_rows // tp)  # the widest shard (torch.chunk's split)
    chunk = 4 * min(elements, LOSS_CHUNK_ELEMENTS)
    return elements * c * (2 + max(stored - 1.0, 0.0)) + chunk


def inflight_microbatches(pp: int, microbatches: int, virtual_stages: int, schedule: str, stage: int = 0) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of a whole stage's layers.

    GPipe holds all m; 1F1B holds min(p - i, m) on stage i, so the first stage holds p; the interleaved
    schedule holds p + (p - 1)/v stage-equivalents on the first stage, i.e. the whole model's layers times
    (1 + (p - 1)/(p v)) (Korthikanti sec. 4.2.3, from Megatron's warm-up count 2(p - i - 1) + (v - 1) p);
    ZB-H2 about 2p - 1; ZB-V p on every stage (its V shape balances memory); looped BFS, like GPipe, all m
    (the zero-bubble interleaved schedule is counted like interleaved 1F1B).
    """
    if pp == 1:
        return 1.0  # gradient accumulation runs micro-batches one after another
    return schedules.get(schedule).inflight(pp, microbatches, virtual_stages, stage)


def logits_inflight(pp: int, microbatches: int, schedule: str) -> float:
    """Micro-batches whose logits the last stage holds: all m when every forward runs before any backward."""
    return float(microbatches) if pp > 1 and schedules.get(schedule).all_forwards_first else 1.0
