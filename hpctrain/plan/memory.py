"""Per-GPU memory of a layout: model states (ZeRO paper) plus activations (Korthikanti et al. 2022).

Model states, Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 3.1): mixed-precision Adam holds 2 bytes/param of fp16/bf16 weights, 2 of gradients and
K = 12 of optimizer state (fp32 master weights, momentum, variance): 16 bytes/param, not the 8 that a
"weights + Adam" shortcut suggests. Pure fp32 training holds 4 + 4 + 8. ZeRO stage 1 shards the
optimizer state over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 also the
weights. (Megatron keeps an extra fp32 main-gradient buffer, 4 more bytes/param: pass grad_bytes=4
to model it.)

Activations, Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4), bytes per transformer layer per micro-batch with 16-bit activations, sequence s,
micro-batch b, hidden h, a heads, tensor-parallel size t:
    no parallelism              s b h (34 + 5 a s / h)
    tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel  s b h / t (34 + 5 a s / h)
    selective recompute (+SP)   34 s b h / t          (attention scores recomputed)
    full recompute              2 s b h  (/t with SP) (only each layer's input is kept)
For an MLP width f other than 4h, "24" becomes 8 + 4 f / h and "34" becomes 18 + 4 f / h.
fp32 activations are approximated by doubling. Recomputation also needs, transiently, what it
recomputes for one layer: all of one layer's activations (full) or its attention scores (selective).

In-flight micro-batches (how many micro-batches' activations a stage holds at its peak):
GPipe holds all m; 1F1B holds min(p - i, m) on stage i, so the first stage holds p; the interleaved
schedule holds p + (p - 1)/v stage-equivalents on the first stage, i.e. the whole model's layers times
(1 + (p - 1)/(p v)) (Korthikanti sec. 4.2.3, from Megatron's warm-up count 2(p - i - 1) + (v - 1) p);
ZB-H2 about 2p - 1; ZB-V p on every stage (its V shape balances memory); looped BFS, like GPipe, all m
(the zero-bubble interleaved schedule is counted like interleaved 1F1B). Embeddings add the embedding dropout mask (s b h bytes per in-flight micro-batch,
/t with SP) on the first stage; the last stage adds 4 s b h / t (1 + V / h): final LayerNorm and output
projection inputs plus fp32 logits.

The layout's weights live where it puts them: layers split evenly over pipeline stages and their
matrices over TP ranks (biases of row-parallel layers and LayerNorms are replicated); the word
embedding is vocab-parallel on the first stage and, tied or not, a copy on the last stage
(Megatron). We evaluate the first and the last stage and report the more loaded GPU.

Headroom: CUDA context, NCCL buffers and allocator fragmentation take memory the formulas don't see;
`reserve_fraction` (10% by default) of the GPU is set aside for them and `fits` compares against the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.models.params import layer_params
from hpctrain.plan.types import Hardware, Layout, ModelShape

MIXED_PRECISION_BYTES = (2, 2, 12)  # (params, grads, optimizer K) per param, ZeRO paper sec. 3.1
FP32_BYTES = (4, 4, 8)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer state on one GPU."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(dtype: str = "bf16", grad_bytes: int | None = None, k: int | None = None) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter for Adam in this dtype."""
    p, g, opt = FP32_BYTES if dtype == "fp32" else MIXED_PRECISION_BYTES
    return p, (g if grad_bytes is None else grad_bytes), (opt if k is None else k)


def zero_model_states(
    n_params: float,
    dp: int,
    zero_stage: int,
    dtype: str = "bf16",
    grad_bytes: int | None = None,
    k: int | None = None,
) -> ModelStates:
    """Model-state bytes per GPU for n_params replicated over dp ranks under a ZeRO stage (ZeRO Fig. 1)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError("zero_stage must be 0..3")
    p, g, opt = bytes_per_param(dtype, grad_bytes, k)
    return ModelStates(
        params=p * n_params / (dp if zero_stage >= 3 else 1),
        grads=g * n_params / (dp if zero_stage >= 2 else 1),
        optimizer=opt * n_params / (dp if zero_stage >= 1 else 1),
    )


# ---------------------------------------------------------------- where the parameters live


def layer_params_per_gpu(model: ModelShape, tp: int) -> float:
    """One layer's parameters on one TP rank: matrices and column-parallel biases split, the rest replicated."""
    h = model.d_model
    replicated = 6 * h  # attention-projection and MLP-output biases (row-parallel) + 2 LayerNorms
    return (layer_params(h, model.ffn) - replicated) / tp + replicated


def layers_on_stage(model: ModelShape, pp: int) -> int:
    """Layers per pipeline stage (the most loaded stage when they do not divide evenly)."""
    return math.ceil(model.n_layers / pp)


def stage_params_per_gpu(model: ModelShape, tp: int, pp: int, stage: int) -> float:
    """Parameters one GPU of pipeline stage `stage` holds (its TP shard)."""
    h, v = model.d_model, model.vocab_size
    n = layers_on_stage(model, pp) * layer_params_per_gpu(model, tp)
    if stage == 0:
        n += v * h / tp + model.seq_len * h  # vocab-parallel word embedding, replicated positions
    if stage == pp - 1:
        n += 2 * h  # final LayerNorm
        if pp > 1 or not model.tied_embeddings:
            n += v * h / tp  # output head: its own matrix, or Megatron's copy of the tied embedding
    return n


# ---------------------------------------------------------------- activations


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    ffn_hidden: int | None = None,
) -> float:
    """Korthikanti et al. 2022 eq. 1-2 and sec. 4: stored activation bytes of one layer, one micro-batch."""
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


def recompute_transient_bytes(model: ModelShape, layout: Layout) -> float:
    """Extra memory while one layer is recomputed in the backward pass (nothing without recompute)."""
    s, b, h, a, t = model.seq_len, layout.micro_batch, model.d_model, model.n_heads, layout.tp
    scale = layout.compute_bytes / 2
    if layout.recompute == "full":
        return scale * activation_bytes_per_layer(s, b, h, a, t, layout.sequence_parallel, "none", model.ffn)
    if layout.recompute == "selective":
        return scale * 5 * a * s * s * b / t
    return 0.0


def inflight_microbatches(pp: int, microbatches: int, virtual_stages: int, schedule: str, stage: int = 0) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of a whole stage's layers."""
    m, p, v = microbatches, pp, virtual_stages
    if p == 1:
        return 1.0  # gradient accumulation runs micro-batches one after another
    if schedule in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule in ("1f1b", "zb_h1"):
        return float(min(p - stage, m))
    if schedule == "zb_h2":
        return float(min(2 * (p - stage) - 1, m))
    if schedule == "zbv":
        return float(min(p, m))
    # interleaved: Megatron warms up 2 (p - i - 1) + (v - 1) p model-chunk micro-batches, plus the one in flight
    chunks = 2 * (p - stage - 1) + (v - 1) * p + 1
    return min(chunks / v, float(m))


def stage_activation_bytes(model: ModelShape, layout: Layout, stage: int) -> float:
    """Peak activation bytes on one GPU of pipeline stage `stage`, including embeddings/logits and recompute."""
    s, b, h, a, t = model.seq_len, layout.micro_batch, model.d_model, model.n_heads, layout.tp
    sp = layout.sequence_parallel
    scale = layout.compute_bytes / 2
    inflight = inflight_microbatches(layout.pp, layout.microbatches, layout.virtual_stages, layout.schedule, stage)
    per_layer = activation_bytes_per_layer(s, b, h, a, t, sp, layout.recompute, model.ffn)
    total = scale * per_layer * layers_on_stage(model, layout.pp) * inflight
    shard = t if sp else 1
    if stage == 0:
        total += s * b * h / shard * inflight  # embedding dropout mask, 1 byte per element
    if stage == layout.pp - 1:
        # final LayerNorm input + output-projection input (16-bit) + fp32 logits, for one micro-batch
        total += scale * 4 * s * b * h / shard + 4 * s * b * model.vocab_size / t
    return total + recompute_transient_bytes(model, layout)


# ---------------------------------------------------------------- the breakdown


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded GPU; cpu_offload_bytes is host memory per GPU (multiply by GPUs per node)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    total: float
    cpu_offload_bytes: float
    fits: bool
    headroom: float  # usable - total; negative when it does not fit
    usable: float  # GPU memory minus the reserve
    stage: int  # pipeline stage of the most loaded GPU


def _stage_memory(
    model: ModelShape, layout: Layout, stage: int, grad_bytes: int | None
) -> tuple[ModelStates, float, float]:
    """(GPU model states, activations, CPU bytes) of one GPU of a stage."""
    n = stage_params_per_gpu(model, layout.tp, layout.pp, stage)
    states = zero_model_states(n, layout.zero_shard, layout.zero_stage, layout.dtype, grad_bytes)
    params, grads, opt, cpu = states.params, states.grads, states.optimizer, 0.0
    if layout.zero_stage == 3:
        # gathered working copies: the layer being computed and the one prefetched, and one layer's full grads
        layer = layer_params_per_gpu(model, layout.tp)
        p_bytes, g_bytes, _ = bytes_per_param(layout.dtype, grad_bytes)
        params += 2 * layer * p_bytes
        grads += layer * g_bytes
    if layout.offload_optimizer:  # ZeRO-Offload: optimizer states, gradients and the step on the CPU
        cpu += states.optimizer + states.grads
        opt = 0.0
        grads -= states.grads
    if layout.offload_params:
        cpu += states.params
        params -= states.params
    acts = stage_activation_bytes(model, layout, stage)
    return ModelStates(params, grads, opt), acts, cpu


def memory_per_gpu(
    model: ModelShape,
    layout: Layout,
    hw: Hardware,
    reserve_fraction: float = 0.10,
    grad_bytes: int | None = None,
) -> MemoryBreakdown:
    """Memory of the most loaded GPU of `layout` (first or last pipeline stage) against `hw`'s memory."""
    stages = sorted({0, layout.pp - 1})
    best: tuple[float, int, ModelStates, float, float] | None = None
    for stage in stages:
        states, acts, cpu = _stage_memory(model, layout, stage, grad_bytes)
        total = states.total + acts
        if best is None or total > best[0]:
            best = (total, stage, states, acts, cpu)
    assert best is not None
    total, stage, states, acts, cpu = best
    usable = hw.gpu_mem_bytes * (1.0 - reserve_fraction)
    return MemoryBreakdown(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts,
        total=total,
        cpu_offload_bytes=cpu,
        fits=total <= usable,
        headroom=usable - total,
        usable=usable,
        stage=stage,
    )
