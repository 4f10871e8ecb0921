"""Per-GPU memory of a layout as hpctrain runs it: model states plus activations, on the most loaded GPU.

Model states: states.py (the ZeRO paper's accounting, Rajbhandari et al. 2020, and what torch's DDP and
FSDP2 hold for hpctrain: fp32 master parameters, autocast or FSDP2 working copies, sharded or unsharded
accumulated gradients; under torch's interleaved 1F1B, the chunks it keeps unsharded at once:
`interleaved_held_params`); the collectives' staging buffers (all-gather output, reduce-scatter input) are a column
of their own, `buffers`, residual state as the ZeRO paper and torch's FSDPMemTracker count them (states.py,
"Columns"). Activations: activations.py (Korthikanti et al. 2022, adapted to what hpctrain's model saves:
SDPA flash attention, dropout masks only with dropout > 0, DTensor sequence parallelism, the selective-recompute
policy of hpctrain.parallel.recompute).

In-flight micro-batches multiply a stage's layer activations (activations.inflight_microbatches; interleaved 1F1B
chunk by chunk, pipeline.held_chunks, as its chunks may hold different layers). The first stage adds the embedding
dropout mask (s b h bytes per micro-batch of its first chunk in flight, when dropout > 0; the embedding sum stays
replicated over TP). The last stage adds the final norm's saved input (/t with SP), the output head's
input (gathered, whole on each TP rank) and the logits and loss (activations.logits_bytes: each TP rank's
vocabulary shard and its gradient, one fp32 chunk of the loss: loss parallelism).

The layout's weights live where it puts them: layers split evenly over pipeline stages and their matrices over
TP ranks (biases of row-parallel layers and the norms are replicated: the family's `tp_dims`); the
word embedding, with its rows padded for TP (ModelShape.vocab_rows), is vocab-parallel on the first stage and
the output head on the last: tied (GPT), a copy of the embedding (Megatron) when there is more than one stage;
untied (Llama), a vocab-parallel matrix of its own. We evaluate the first and the last stage and report the more
loaded GPU.

Mixture of Experts (a family with `Family.moe`): expert parallelism keeps n_experts / ep of each layer's experts on
a GPU (the family's `ep_dims`), whole over TP; FSDP2 shards them over the dp_shard / ep ranks an EP group leaves
(Layout.dp_shard_mod_ep) and everything else over dp_shard, so a rank's fp32 shards hold dense / dp_shard +
(experts / ep) / (dp_shard / ep) = all / dp_shard parameters, as without EP: EP shrinks what is unsharded (the
working bf16 copies, gathered units, accumulated gradients), not the shards. The MoE layer's activations are
activations.py's (whole on every TP rank; the busiest EP rank's experts run EXPERT_IMBALANCE x the mean rows).

Context parallelism (Layout.cp): every activation above is of the GPU's s / cp tokens (`local_seq_len`), the
attention adding the whole sequence's gathered keys and values (activations.py); the model states are sharded over
dp_shard x cp ranks (Layout.zero_shard: CP ranks share FSDP's sharding with DP, as in torchtitan).

Headroom: CUDA context, NCCL buffers and allocator fragmentation take memory the formulas don't see;
`reserve_fraction` (10% by default) of the GPU is set aside for them and `fits` compares against the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from hpctrain import schedules
from hpctrain.config.layout import data_parallel_kind
from hpctrain.models.family import Family
from hpctrain.models.params import stage_holds
from hpctrain.plan.activations import (
    EXPERT_IMBALANCE,
    activation_bytes_per_layer,
    inflight_microbatches,
    korthikanti_bytes_per_layer,
    logits_bytes,
    logits_inflight,
)
from hpctrain.plan.pipeline import held_chunks
from hpctrain.plan.states import (
    FP32_BYTES,
    MASTER,
    MIXED_PRECISION_BYTES,
    ModelStates,
    Part,
    accumulates_unsharded,
    bytes_per_param,
    hpctrain_state_parts,
    split_units,
    zero_model_states,
)
from hpctrain.plan.types import Hardware, Layout, ModelShape

__all__ = [
    "FP32_BYTES",
    "MIXED_PRECISION_BYTES",
    "MemoryBreakdown",
    "ModelStates",
    "Part",
    "activation_bytes_per_layer",
    "bytes_per_param",
    "inflight_microbatches",
    "korthikanti_bytes_per_layer",
    "layer_activation_bytes",
    "layer_params_per_gpu",
    "layers_on_stage",
    "memory_per_gpu",
    "shard_params_per_gpu",
    "stage_activation_bytes",
    "stage_activation_parts",
    "stage_expert_params_per_gpu",
    "stage_params_per_gpu",
    "zero_model_states",
]


# ---------------------------------------------------------------- where the parameters live


def _per_rank(shapes: dict[str, tuple[int, ...]], tp: int, family: Family) -> float:
    """Elements on one TP rank: what the family's `tp_dims` split, divided by tp, plus the replicated rest (the
    parameters outside the blocks; a block's, experts included: `_block_split`)."""
    split = sum(math.prod(shape) for name, shape in shapes.items() if family.sharded_dim(name) is not None)
    return split / tp + sum(math.prod(shape) for name, shape in shapes.items() if family.sharded_dim(name) is None)


@cache
def _block_split(model: ModelShape, prefix: str = "") -> tuple[int, int, int]:
    """(elements TP splits, elements EP splits, replicated elements) of the block's parameters under `prefix`: the
    family's `tp_dims` and `ep_dims` (experts are whole over TP), summed once per model (the layout search asks for
    thousands of layouts)."""
    family, out = model.family, [0, 0, 0]
    for name, shape in model.block_shapes().items():
        if name.startswith(prefix):
            cls = 1 if family.expert_dim(name) is not None else 0 if family.sharded_dim(name) is not None else 2
            out[cls] += math.prod(shape)
    return out[0], out[1], out[2]


def _block_per_rank(model: ModelShape, tp: int, ep: int, prefix: str = "") -> float:
    by_tp, by_ep, whole = _block_split(model, prefix)
    return by_tp / tp + by_ep / ep + whole


def layer_params_per_gpu(model: ModelShape, tp: int, ep: int = 1) -> float:
    """One layer's parameters on one TP (and EP) rank: matrices and column-parallel biases split, the experts
    split over ep, the rest replicated (GPT: the row-parallel biases and 2 LayerNorms, 6 h; Llama: the 2 RMSNorm
    weights, 2 h; an MoE block: also the router, E h)."""
    return _block_per_rank(model, tp, ep)


def fsdp_unit_params_per_gpu(model: ModelShape, layout: Layout) -> float:
    """The largest FSDP unit's parameters on one TP (and EP) rank: a block, or its MLP where attention and MLP
    are units of their own (states.split_units)."""
    if not split_units(layout):
        return _block_per_rank(model, layout.tp, layout.ep)
    return max(_block_per_rank(model, layout.tp, layout.ep, prefix) for prefix in ("attn.", "mlp."))


def largest_param_per_gpu(model: ModelShape, layout: Layout) -> float:
    """The largest single parameter on one GPU, TP and EP splitting theirs (the embedding, or a block's widest
    matrix): the fresh gradient backward holds where each is added into the buffer as it is made."""
    family = model.family

    def on_gpu(name: str, shape: tuple[int, ...]) -> float:
        split = (
            layout.ep
            if family.expert_dim(name) is not None
            else layout.tp
            if family.sharded_dim(name) is not None
            else 1
        )
        return math.prod(shape) / split

    return max(on_gpu(name, shape) for name, shape in {**model.block_shapes(), **model.top_shapes(layout.tp)}.items())


def layers_on_stage(model: ModelShape, layout: Layout, stage: int | None = None) -> int:
    """Layers one GPU of pipeline stage (rank) `stage` holds over its model chunks, uneven stages included; None:
    the most any pipeline rank holds (the one that sets the pipeline's pace)."""
    if stage is None:
        return max(layout.layers_on(model.dims.n_layers, r) for r in range(layout.pp))
    return layout.layers_on(model.dims.n_layers, stage)


@cache
def chunk_params_per_gpu(model: ModelShape, layout: Layout, stage: int) -> tuple[float, ...]:
    """Parameters one GPU of pipeline stage (rank) `stage` holds in each of its model chunks, in the rank's order
    (its TP shard, its EP rank's experts), padding rows of the embedding included."""
    split, layer = layout.layer_split(model.dims.n_layers), layer_params_per_gpu(model, layout.tp, layout.ep)
    out = []
    for chunk in layout.stages_of(stage):
        held = {
            name: shape
            for name, shape in model.top_shapes(layout.tp).items()
            if stage_holds(model.family, name.split(".")[0], chunk, split)
        }
        out.append(split[chunk] * layer + _per_rank(held, layout.tp, model.family))
    return tuple(out)


def stage_params_per_gpu(model: ModelShape, layout: Layout, stage: int) -> float:
    """Parameters one GPU of pipeline stage (rank) `stage` holds over its model chunks."""
    return sum(chunk_params_per_gpu(model, layout, stage))


def stage_expert_params_per_gpu(model: ModelShape, layout: Layout, stage: int) -> float:
    """The expert weights among `stage_params_per_gpu`: the stage's layers' experts / ep (0 for a dense model)."""
    return layers_on_stage(model, layout, stage) * model.expert_layer_params / layout.ep


def shard_params_per_gpu(model: ModelShape, layout: Layout, stage: int) -> float:
    """Parameters in one GPU's FSDP2 shards: the dense ones over dp_shard ranks, its EP rank's experts over the
    dp_shard / ep ranks an EP group leaves (module docstring: as many as without EP)."""
    n = stage_params_per_gpu(model, layout, stage)
    experts = stage_expert_params_per_gpu(model, layout, stage)
    return (n - experts) / layout.zero_shard + experts / layout.dp_shard_mod_ep


# ---------------------------------------------------------------- activations


def autocast_forward(layout: Layout) -> bool:
    """Forward runs under torch.autocast (no FSDP2 mixed-precision policy): 16-bit compute without FSDP2."""
    return layout.compute_bytes < 4 and data_parallel_kind(layout) in ("none", "ddp")


def layer_activation_bytes(model: ModelShape, layout: Layout, recompute: str | None = None) -> float:
    """One layer's stored activations for one micro-batch of `layout` (activations.py), in its dtype."""
    scale = layout.compute_bytes / 2
    return scale * activation_bytes_per_layer(
        model.family,
        model.dims,
        local_seq_len(model, layout),
        layout.micro_batch,
        layout.tp,
        layout.sequence_parallel,
        recompute or layout.recompute,
        dropout=model.dropout > 0,
        sp_keeps_gathered=not layout.sp_keeps_shards,
        fp32_residual=autocast_forward(layout),
        expert_load=EXPERT_IMBALANCE if layout.ep > 1 else 1.0,  # the busiest EP rank's experts (activations.py)
        cp=layout.cp,
    )


def local_seq_len(model: ModelShape, layout: Layout) -> int:
    """Tokens of each sequence one GPU holds: s / cp under context parallelism (two chunks of s / 2cp)."""
    return model.seq_len // layout.cp


def recompute_transient_bytes(model: ModelShape, layout: Layout) -> float:
    """Extra memory while one layer is recomputed in backward: what it regenerates (nothing without recompute)."""
    if layout.recompute == "none":
        return 0.0
    return max(layer_activation_bytes(model, layout, "none") - layer_activation_bytes(model, layout), 0.0)


def _head_bytes(model: ModelShape, layout: Layout) -> float:
    """Last stage: final norm's saved input (RMSNorm: + its fp32 copy), the head's gathered input, logits and loss
    (activations.logits_bytes)."""
    s, b, h, c = local_seq_len(model, layout), layout.micro_batch, model.dims.d_model, layout.compute_bytes
    held = logits_inflight(layout.pp, layout.microbatches, layout.schedule)
    norm_in = (4 if autocast_forward(layout) else c) + (4 if model.family.activations.norm_fp32_copy else 0)
    hidden = s * b * h * (norm_in / (layout.tp if layout.sequence_parallel else 1) + c) * held
    return hidden + logits_bytes(b, s, model.vocab_rows(layout.tp), c, held, tp=layout.tp)


def held_layer_microbatches(model: ModelShape, layout: Layout, stage: int) -> tuple[float, float]:
    """(layer activations held at the peak, in layers x micro-batches; micro-batches of the rank's first chunk
    held then) on pipeline rank `stage`. Interleaved 1F1B replays torch's order chunk by chunk (pipeline.py: its
    chunks may differ in layers); the other schedules hold whole-stage units (schedules.py)."""
    if layout.pp > 1 and schedules.get(layout.schedule).name == "interleaved_1f1b":
        split = layout.layer_split(model.dims.n_layers)
        layers = tuple(split[c] for c in layout.stages_of(stage))
        held = held_chunks(layout.pp, layout.microbatches, layout.virtual_stages, stage, layers)
        return float(sum(n * layer for n, layer in zip(held, layers, strict=True))), float(held[0])
    inflight = inflight_microbatches(layout.pp, layout.microbatches, layout.virtual_stages, layout.schedule, stage)
    return layers_on_stage(model, layout, stage) * inflight, inflight


def stage_activation_parts(model: ModelShape, layout: Layout, stage: int) -> list[Part]:
    """Peak activation bytes on one GPU of pipeline stage `stage`, by part."""
    held, inflight = held_layer_microbatches(model, layout, stage)
    n_layers = layers_on_stage(model, layout, stage)
    name = f"{n_layers} layers, {held:g} layer-micro-batches in flight, recompute {layout.recompute}"
    parts = [Part("activations", name, layer_activation_bytes(model, layout) * held)]
    if stage == 0 and model.dropout > 0:
        parts.append(
            Part(
                "activations",
                "embedding dropout mask",
                local_seq_len(model, layout) * layout.micro_batch * model.dims.d_model * inflight,
            )
        )
    if stage == layout.pp - 1:
        rows = model.vocab_rows(layout.tp)
        parts.append(
            Part(
                "activations",
                f"output head + logits ({-(-rows // layout.tp)} of {rows} columns a TP rank) + the loss's fp32 chunk",
                _head_bytes(model, layout),
            )
        )
    if stage == 0 and layout.tp > 1 and layout.sequence_parallel and layout.recompute == "full":
        # the first block's checkpoint saves its input before SP slices it (the slicing hook runs inside)
        parts.append(
            Part(
                "activations",
                "first block's checkpointed input: the embedding output, whole sequence",
                local_seq_len(model, layout)
                * layout.micro_batch
                * model.dims.d_model
                * _residual_bytes(layout)
                * (1 - 1 / layout.tp)
                * inflight,
            )
        )
    if stage == 0 and layout.tp > 1 and accumulates_unsharded(layout):
        parts.append(
            Part(
                "activations",
                "token embedding backward's working copies ("
                f"{layout.reduce_dtype or layout.dtype} and {layout.dtype}, whole table)",
                _embedding_elements(model, layout.tp) * (layout.reduce_bytes + layout.compute_bytes),
            )
        )
    transient = recompute_transient_bytes(model, layout)
    if transient:
        parts.append(Part("activations", "one layer recomputed in backward", transient))
    return parts


def _residual_bytes(layout: Layout) -> int:
    """Bytes of a residual-stream element: fp32 under autocast (the embedding's output is not cast)."""
    return 4 if autocast_forward(layout) else layout.compute_bytes


def _embedding_elements(model: ModelShape, tp: int) -> int:
    return model.vocab_rows(tp) * model.dims.d_model


def embedding_grad_parts(model: ModelShape, layout: Layout, stage: int) -> list[Part]:
    """The token embedding's gradient on the stage that looks tokens up, with TP: whole on every TP rank.

    The weight is vocabulary-parallel (Shard(0)), but DTensor's embedding backward (torch 2.13,
    torch/distributed/tensor/_ops/_embedding_ops.py `embedding_dense_backward_strategy`) has no rule that keeps
    the gradient's rows sharded (only Shard(1) or Partial): it comes back whole, and it is held whole where
    gradients are kept: the fp32 gradient of a plain module, FSDP2's accumulated gradient in the reduce dtype
    (or, without accumulation, its unsharded gradient until the reduce-scatter). Counted here: the other
    (tp - 1)/tp of it (the shard is in the model states). Found by dry_run=simulate (docs/planner.md)."""
    if stage != 0 or layout.tp == 1:
        return []
    kind = data_parallel_kind(layout)
    dtype_bytes = (
        MASTER
        if kind in ("none", "ddp")
        else layout.reduce_bytes
        if accumulates_unsharded(layout)
        else layout.compute_bytes
    )
    whole = _embedding_elements(model, layout.tp)
    parts = [
        Part(
            "grads",
            f"token embedding's gradient, whole on every TP rank (the other {layout.tp - 1}/{layout.tp})",
            whole * dtype_bytes * (1 - 1 / layout.tp),
        )
    ]
    if accumulates_unsharded(layout):
        # while it is added in, its fresh gradient (whole, compute dtype) is the backward's largest transient
        beyond = whole * layout.compute_bytes - (layout.compute_bytes + layout.reduce_bytes) * fsdp_unit_params_per_gpu(
            model, layout
        )
        if beyond > 0:
            parts.append(
                Part(
                    "grads",
                    f"token embedding's fresh {layout.dtype} gradient while it is accumulated, beyond one unit's",
                    beyond,
                )
            )
    return parts


def stage_activation_bytes(model: ModelShape, layout: Layout, stage: int) -> float:
    """Peak activation bytes on one GPU of pipeline stage `stage`, including embeddings/logits and recompute."""
    return sum(p.bytes for p in stage_activation_parts(model, layout, stage))


# ---------------------------------------------------------------- the breakdown


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the most loaded GPU; cpu_offload_bytes is host memory per GPU and nvme_bytes node-local NVMe per
    GPU (multiply either by GPUs per node: hpctrain.plan.offload)."""

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
    parts: tuple[Part, ...] = ()  # what makes up each column (GPU, host and NVMe)
    nvme_bytes: float = 0.0
    buffers: float = 0.0  # collectives' staging (all-gather output, reduce-scatter input): residual, not model state


# torch 2.13's runtime schedules keep at most this many of a rank's chunks unsharded at once
# (torch/distributed/pipelining/schedules.py `_add_unshard_reshard`, max_active_stages=3)
ACTIVE_CHUNKS = 3


def interleaved_held_params(model: ModelShape, layout: Layout, stage: int) -> tuple[float, float] | None:
    """(parameters whose unsharded working copies, parameters whose unsharded accumulated gradients) one GPU of rank
    `stage` holds at once under FSDP2 and torch's interleaved 1F1B; None where the whole stage's are (states.py).

    torch 2.13 lowers ScheduleInterleaved1F1B with UNSHARD/RESHARD actions that keep at most ACTIVE_CHUNKS chunks
    gathered (`_add_unshard_reshard`) and a REDUCE_GRAD after each chunk's last backward (`_add_reduce_grad`:
    `perform_reduce_grad` reduce-scatters and frees that chunk's unsharded gradients). With one round of
    micro-batches (m <= 2p - 1: torch's `number_of_rounds` = m // p is 1) each chunk runs all its backwards before the
    next chunk's first (pipeline.held_chunks' order), so one chunk's gradients are held at a time; with more rounds
    every chunk's accumulate until the last. Measured by dry_run=simulate on llama3_405b's rank 0 (docs/planner.md)."""
    if layout.pp == 1 or layout.virtual_stages == 1 or data_parallel_kind(layout) != "fsdp":
        return None
    if schedules.get(layout.schedule).name != "interleaved_1f1b":
        return None
    chunks = chunk_params_per_gpu(model, layout, stage)
    params = sum(sorted(chunks, reverse=True)[:ACTIVE_CHUNKS])
    grads = max(chunks) if layout.microbatches // layout.pp <= 1 else sum(chunks)
    return params, grads


def state_parts(model: ModelShape, layout: Layout, stage: int) -> list[Part]:
    """Model states and collective buffers of one GPU of a stage (states.py), with the parameters and gradients an
    interleaved schedule holds unsharded at once (interleaved_held_params) in place of the whole stage's."""
    n = stage_params_per_gpu(model, layout, stage)
    layer = layer_params_per_gpu(model, layout.tp, layout.ep)
    unit = fsdp_unit_params_per_gpu(model, layout)
    root = n - layers_on_stage(model, layout, stage) * layer
    sharded, largest = shard_params_per_gpu(model, layout, stage), largest_param_per_gpu(model, layout)
    parts = hpctrain_state_parts(n, layer, layout, unit, root, sharded, largest)
    held = interleaved_held_params(model, layout, stage)
    if held is None:
        return parts
    by_kind = {
        kind: hpctrain_state_parts(k, layer, layout, unit, root, sharded, largest)
        for kind, k in zip(("params", "grads"), held, strict=True)
    }
    v, active = layout.virtual_stages, min(ACTIVE_CHUNKS, layout.virtual_stages)
    names = {
        "params": f"{layout.dtype} unsharded parameters of the {active} largest of the rank's {v} chunks (torch's "
        f"interleaved schedule gathers at most {ACTIVE_CHUNKS} at once)",
        "grads": f"unsharded {layout.reduce_dtype or layout.dtype} gradients of the rank's largest chunk (torch "
        "reduce-scatters each chunk's after its last backward, one round of micro-batches)",
    }
    adjusted = [by_kind[p.kind][i] if p.kind in by_kind else p for i, p in enumerate(parts)]
    return [replace(q, name=names[q.kind]) if q.bytes != p.bytes else q for p, q in zip(parts, adjusted, strict=True)]


def stage_parts(model: ModelShape, layout: Layout, stage: int) -> list[Part]:
    """Everything one GPU of a stage holds: model states (states.py) and activations."""
    return (
        state_parts(model, layout, stage)
        + embedding_grad_parts(model, layout, stage)
        + stage_activation_parts(model, layout, stage)
    )


def _column(parts: list[Part], kind: str) -> float:
    return sum(p.bytes for p in parts if p.kind == kind and p.on_gpu)


def memory_per_gpu(model: ModelShape, layout: Layout, hw: Hardware, reserve_fraction: float = 0.10) -> MemoryBreakdown:
    """Memory of the most loaded GPU of `layout` (first or last pipeline stage) against `hw`'s memory."""
    best: tuple[float, int, list[Part]] | None = None
    for stage in sorted({0, layout.pp - 1}):
        parts = stage_parts(model, layout, stage)
        total = sum(p.bytes for p in parts if p.on_gpu)
        if best is None or total > best[0]:
            best = (total, stage, parts)
    assert best is not None
    total, stage, parts = best
    usable = hw.gpu_mem_bytes * (1.0 - reserve_fraction)
    return MemoryBreakdown(
        params=_column(parts, "params"),
        grads=_column(parts, "grads"),
        optimizer=_column(parts, "optimizer"),
        activations=_column(parts, "activations"),
        total=total,
        cpu_offload_bytes=sum(p.bytes for p in parts if p.cpu),
        buffers=_column(parts, "buffers"),
        fits=total <= usable,
        headroom=usable - total,
        usable=usable,
        stage=stage,
        parts=tuple(parts),
        nvme_bytes=sum(p.bytes for p in parts if p.nvme),
    )
