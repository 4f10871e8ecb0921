"""Bytes each GPU sends per training step, per parallelism, and the link that carries them.

Volumes are for ring collectives over n ranks and a buffer of S bytes: all-reduce sends 2 (n-1)/n S
per GPU, reduce-scatter and all-gather (n-1)/n S each (Patarasuk & Yuan 2009; NCCL's "bus bandwidth").

Data parallelism (G = this GPU's gradient shard after TP/PP, in `reduce_dtype`; W = its weights):
  * ZeRO-0: one all-reduce of G per step: 2 (n-1)/n G.
  * ZeRO-1: gradients accumulated whole, one reduce-scatter of G + one all-gather of the updated W a step:
    the same volume (ZeRO paper sec. 7.2.1; Megatron's distributed optimizer).
  * ZeRO-2: gradients are not kept whole, so they are reduce-scattered after every micro-batch
    (DeepSpeed's behaviour): m reduce-scatters + one all-gather (parameters stay gathered all step).
  * ZeRO-3: each micro-batch all-gathers W in forward and again in backward and reduce-scatters G:
    3 (n-1)/n per micro-batch, 1.5x ZeRO-0 when m = 1 (ZeRO paper sec. 7.2.2) and far more with
    gradient accumulation, which is why ZeRO-3 pairs badly with many pipeline micro-batches.
  * zero.accumulate_unsharded (ZeRO-2/3) and every stage under PP (torch's schedules reduce once, after the
    last backward: states.py) reduce-scatter G once a step (states.gradient_reductions), for whole
    reduce-dtype gradients in memory.
  * HSDP (dp_replicate r > 1): ZeRO inside groups of dp/r ranks, then an all-reduce of the shards across
    the r groups.
Tensor parallelism (Megatron, Shoeybi et al. 2019): 2 all-reduces in forward and 2 in backward per
layer per micro-batch, each of s b h activations (2 more with full recomputation, which reruns the
forward). Sequence parallelism replaces each all-reduce by a reduce-scatter + all-gather: same bytes
(Korthikanti 2022 sec. 4.2.2). Llama's grouped-query attention changes none of this: the reduced tensors are
the outputs of the attention projection and the MLP (s b h, whatever the K/V width), and the inputs TP/SP
gathers are the block's; the MLP's width and its gate only change the GEMMs.
Pipeline parallelism: per micro-batch and model chunk, a point-to-point send of s b h activations
forward and of their gradient backward, divided by t with Megatron's scatter/gather optimisation
(Narayanan 2021 sec. 4.1; with SP the tensor is already split). Interleaving multiplies it by v.

Links: ranks are ordered TP innermost, then DP, then PP (Megatron's default). A group uses NVLink when
all its ranks fit in one node and the network (per-GPU NIC bandwidth) otherwise. Ignored: latency
terms, the tied-embedding all-reduce between first and last stage (GPT; Llama's head is untied and has
none), vocab-parallel loss reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.memory import layers_on_stage, stage_params_per_gpu
from hpctrain.plan.states import gradient_reductions
from hpctrain.plan.types import Hardware, Layout, ModelShape

NVLINK = "nvlink"
NETWORK = "network"


@dataclass(frozen=True)
class CommItem:
    """One kind of traffic: bytes one GPU sends per step, over which link, and whether it can hide behind compute."""

    name: str
    kind: str  # "dp", "tp" or "pp"
    bytes: float
    link: str
    bandwidth: float
    overlap: str  # "backward" (DP gradient reduction), "compute" (ZeRO-3 prefetch) or "none"

    @property
    def time_s(self) -> float:
        return self.bytes / self.bandwidth if self.bytes else 0.0


@dataclass(frozen=True)
class CommBreakdown:
    items: tuple[CommItem, ...]

    def bytes_of(self, kind: str) -> float:
        return sum(i.bytes for i in self.items if i.kind == kind)

    def time_of(self, kind: str) -> float:
        return sum(i.time_s for i in self.items if i.kind == kind)

    @property
    def dp_bytes(self) -> float:
        return self.bytes_of("dp")

    @property
    def tp_bytes(self) -> float:
        return self.bytes_of("tp")

    @property
    def pp_bytes(self) -> float:
        return self.bytes_of("pp")

    @property
    def total_bytes(self) -> float:
        return sum(i.bytes for i in self.items)


def all_reduce_bytes(n: int, size: float) -> float:
    """Bytes one rank sends in a ring all-reduce of `size` bytes over n ranks."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def all_gather_bytes(n: int, size: float) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of a `size`-byte full buffer."""
    return (n - 1) / n * size if n > 1 else 0.0


def _link(span: int, hw: Hardware) -> tuple[str, float]:
    """A group whose ranks span `span` consecutive ranks stays in one node when span <= gpus_per_node."""
    return (NVLINK, hw.intra_node_bw) if span <= hw.gpus_per_node else (NETWORK, hw.inter_node_bw)


def param_all_gathers(layout: Layout) -> int:
    """Parameter all-gathers per step as `dp_items` counts them: none without DP or at ZeRO-0, one at ZeRO-1/2,
    one in forward and one in backward of every micro-batch at ZeRO-3 (offload.py copies the fp32 shard to the
    GPU before each)."""
    if layout.dp == 1 or layout.zero_stage == 0:
        return 0
    return 2 * layout.microbatches if layout.zero_stage >= 3 else 1


def dp_items(model: ModelShape, layout: Layout, hw: Hardware) -> list[CommItem]:
    """Data-parallel / ZeRO traffic of the GPU with the most parameters."""
    if layout.dp == 1:
        return []
    n_params = max(stage_params_per_gpu(model, layout.tp, layout.pp, s) for s in {0, layout.pp - 1})
    grads = n_params * layout.reduce_bytes
    weights = n_params * layout.compute_bytes
    m, z = layout.microbatches, layout.zero_stage
    shard = layout.zero_shard if z > 0 else layout.dp
    link, bw = _link(layout.tp * shard, hw)
    items: list[CommItem] = []
    reductions = gradient_reductions(layout)
    if z == 0:
        items.append(CommItem("grad all-reduce", "dp", all_reduce_bytes(shard, grads), link, bw, "backward"))
    else:
        name = "grad reduce-scatter" + (" x m" if reductions == m > 1 else "")
        items.append(CommItem(name, "dp", reductions * all_gather_bytes(shard, grads), link, bw, "backward"))
        if z <= 2:
            items.append(CommItem("param all-gather", "dp", all_gather_bytes(shard, weights), link, bw, "none"))
        else:
            items.append(CommItem("param all-gather fwd+bwd x m", "dp",
                                  param_all_gathers(layout) * all_gather_bytes(shard, weights), link, bw, "compute"))
    r = layout.dp_replicate
    if z > 0 and r > 1:
        rlink, rbw = _link(layout.tp * layout.dp, hw)
        items.append(CommItem("HSDP replica all-reduce", "dp", reductions * all_reduce_bytes(r, grads / shard),
                              rlink, rbw, "backward"))
    return items


def tp_items(model: ModelShape, layout: Layout, hw: Hardware) -> list[CommItem]:
    """Megatron tensor-parallel collectives of one GPU of the most loaded stage."""
    t = layout.tp
    if t == 1:
        return []
    sbh = model.seq_len * layout.micro_batch * model.d_model * layout.compute_bytes
    per_layer = 6 if layout.recompute == "full" else 4
    n = layers_on_stage(model, layout.pp) * layout.microbatches * per_layer
    link, bw = _link(t, hw)
    name = "SP all-gather/reduce-scatter" if layout.sequence_parallel else "TP all-reduce"
    return [CommItem(name, "tp", n * all_reduce_bytes(t, sbh), link, bw, "none")]


def pp_items(model: ModelShape, layout: Layout, hw: Hardware, scatter_gather: bool = True) -> list[CommItem]:
    """Point-to-point activation/gradient sends of a middle pipeline stage."""
    if layout.pp == 1:
        return []
    sbh = model.seq_len * layout.micro_batch * model.d_model * layout.compute_bytes
    if scatter_gather or layout.sequence_parallel:
        sbh /= layout.tp
    volume = 2 * layout.microbatches * layout.virtual_stages * sbh
    link, bw = _link(layout.tp * layout.dp * layout.pp, hw)
    return [CommItem("p2p activations fwd+bwd", "pp", volume, link, bw, "none")]


def comm_per_step(model: ModelShape, layout: Layout, hw: Hardware, scatter_gather: bool = True) -> CommBreakdown:
    """All traffic one GPU sends in one step, by kind, with the link it uses."""
    items = dp_items(model, layout, hw) + tp_items(model, layout, hw) + pp_items(model, layout, hw, scatter_gather)
    return CommBreakdown(tuple(items))
