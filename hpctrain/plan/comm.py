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

Expert parallelism (a Mixture of Experts with Layout.ep > 1): each MoE layer sends every routed row (top_k per
token, d_model wide, in the compute dtype) to the rank holding its expert and back, all_to_all_single over the ep
ranks: per micro-batch forward 1 all-to-all of the rows and 1 of the results, backward 2 (their gradients), 2 more
when recomputation reruns the forward (full or selective: recompute.py's policy keeps no all-to-all output); of each,
a rank keeps the (1/ep) share bound for its own experts. TP leaves the MoE layer whole, so each TP rank dispatches
its full sequence: s b top_k d bytes per all-to-all, x (ep - 1)/ep sent, x EXPERT_IMBALANCE (the busiest rank's
experts receive and return more rows than the mean: an assumption, step_time.py's interval). The all-to-all of the
per-expert counts before each dispatch (n_experts integers) is a latency term, left out. The DP traffic of the
expert weights runs over the dp_shard / ep ranks that hold the same experts (their gradients and weights are 1/ep
of the layers' experts): ZeRO's volumes per group, summed.

Context parallelism (Layout.cp > 1, hpctrain.parallel.context_parallel): every attention layer all-gathers the
keys and values of its s / cp tokens over the cp ranks in forward and reduce-scatters their gradients in backward
(the all-gather's autograd), each a buffer of the whole sequence's K and V on this TP rank, 2 s b k / t elements
(k = n_kv_heads x head_dim: grouped-query attention gathers the few KV heads only) in the compute dtype:
(cp - 1)/cp of it per collective, 2 collectives per layer and micro-batch (3 with full recomputation, whose
forward gathers again). Exposed in full: the gather sits between the QKV projection and attention of the same
layer, and nothing in hpctrain prefetches it (Llama 3 (Grattafiori et al. 2024, sec. 3.3.2) chose all-gather CP
for its simplicity and GQA's small K/V, and exposes it too). TP, PP and EP traffic is per local token (s / cp).
The CP ranks also reduce the gradients with their DP peers: the ZeRO group is dp_shard x cp ranks (Layout.
zero_shard), ZeRO-0's all-reduce dp x cp.

Links: ranks are ordered TP innermost, then CP, then DP, then PP (torchtitan's; Megatron's default without CP);
an EP group is ep consecutive DP ranks (torchtitan's dp_shard_in_ep inside dp_shard), so its all-to-all spans
tp x ep ranks; a CP group spans tp x cp ranks. A group uses NVLink when all its ranks fit in one node and the
network (per-GPU NIC bandwidth) otherwise. Ignored: latency
terms, the tied-embedding all-reduce between first and last stage (GPT; Llama's head is untied and has
none), vocab-parallel loss reductions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hpctrain.plan.activations import EXPERT_IMBALANCE
from hpctrain.plan.memory import layers_on_stage, local_seq_len, stage_expert_params_per_gpu, stage_params_per_gpu
from hpctrain.plan.states import gradient_reductions
from hpctrain.plan.types import Hardware, Layout, ModelShape

NVLINK = "nvlink"
NETWORK = "network"


@dataclass(frozen=True)
class CommItem:
    """One kind of traffic: bytes one GPU sends per step, over which link, and whether it can hide behind compute."""

    name: str
    kind: str  # "dp", "tp", "pp", "ep" or "cp"
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
    def ep_bytes(self) -> float:
        return self.bytes_of("ep")

    @property
    def cp_bytes(self) -> float:
        return self.bytes_of("cp")

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
    """A group whose ranks span `span` consecutive ranks stays on NVLink when span <= the GPUs one NVLink fabric
    joins: the node's, or more (GB200 NVL72: Hardware.nvlink_domain)."""
    return (NVLINK, hw.intra_node_bw) if span <= hw.nvlink_gpus else (NETWORK, hw.inter_node_bw)


def param_all_gathers(layout: Layout) -> int:
    """Parameter all-gathers per step as `dp_items` counts them: none without DP or at ZeRO-0, one at ZeRO-1/2,
    one in forward and one in backward of every micro-batch at ZeRO-3 (offload.py copies the fp32 shard to the
    GPU before each)."""
    if layout.dp * layout.cp == 1 or layout.zero_stage == 0:
        return 0
    return 2 * layout.microbatches if layout.zero_stage >= 3 else 1


def dp_groups(model: ModelShape, layout: Layout) -> list[tuple[float, int]]:
    """(parameters on the GPU with the most, the ranks their gradients are reduced over): all of them over the DP
    group and its CP peers (the ZeRO shard group dp_shard x cp, ZeRO-0: all dp x cp ranks); with expert parallelism
    the experts apart, over the 1/ep of those ranks that hold the same experts."""
    stage = max(range(layout.pp), key=lambda s: stage_params_per_gpu(model, layout, s))
    n = stage_params_per_gpu(model, layout, stage)
    group = layout.zero_shard if layout.zero_stage > 0 else layout.dp * layout.cp
    experts = stage_expert_params_per_gpu(model, layout, stage) if layout.ep > 1 else 0.0
    return [(n - experts, group)] + ([(experts, group // layout.ep)] if experts else [])


def dp_items(model: ModelShape, layout: Layout, hw: Hardware) -> list[CommItem]:
    """Data-parallel / ZeRO traffic of the GPU with the most parameters (with expert parallelism, the dense
    parameters' and the experts' groups summed: `dp_groups`)."""
    if layout.dp * layout.cp == 1:
        return []
    groups = dp_groups(model, layout)
    c, r_bytes = layout.compute_bytes, layout.reduce_bytes

    def ring(volume: Callable[[int, float], float], bytes_per_param: int) -> float:
        return sum(volume(ranks, n * bytes_per_param) for n, ranks in groups)

    m, z = layout.microbatches, layout.zero_stage
    link, bw = _link(layout.tp * groups[0][1], hw)
    items: list[CommItem] = []
    reductions = gradient_reductions(layout)
    if z == 0:
        items.append(CommItem("grad all-reduce", "dp", ring(all_reduce_bytes, r_bytes), link, bw, "backward"))
    else:
        name = "grad reduce-scatter" + (" x m" if reductions == m > 1 else "")
        items.append(CommItem(name, "dp", reductions * ring(all_gather_bytes, r_bytes), link, bw, "backward"))
        if z <= 2:
            items.append(CommItem("param all-gather", "dp", ring(all_gather_bytes, c), link, bw, "none"))
        else:
            items.append(
                CommItem(
                    "param all-gather fwd+bwd x m",
                    "dp",
                    param_all_gathers(layout) * ring(all_gather_bytes, c),
                    link,
                    bw,
                    "compute",
                )
            )
    r = layout.dp_replicate
    if z > 0 and r > 1:
        rlink, rbw = _link(layout.tp * layout.cp * layout.dp, hw)
        shard_grads = sum(n / ranks for n, ranks in groups) * r_bytes
        items.append(
            CommItem(
                "HSDP replica all-reduce", "dp", reductions * all_reduce_bytes(r, shard_grads), rlink, rbw, "backward"
            )
        )
    return items


def ep_items(model: ModelShape, layout: Layout, hw: Hardware, imbalance: float = EXPERT_IMBALANCE) -> list[CommItem]:
    """The MoE layers' token all-to-alls of one GPU of the most loaded stage (module docstring); none without
    expert parallelism."""
    ep = layout.ep
    if ep == 1 or not model.moe:
        return []
    rows = (
        local_seq_len(model, layout) * layout.micro_batch * model.dims.top_k * model.dims.d_model * layout.compute_bytes
    )
    per_layer = 4 if layout.recompute == "none" else 6
    n = layers_on_stage(model, layout) * layout.microbatches * per_layer
    link, bw = _link(layout.tp * ep, hw)
    return [CommItem(f"EP all-to-all x{per_layer}/layer", "ep", n * rows * (ep - 1) / ep * imbalance, link, bw, "none")]


def tp_items(model: ModelShape, layout: Layout, hw: Hardware) -> list[CommItem]:
    """Megatron tensor-parallel collectives of one GPU of the most loaded stage."""
    t = layout.tp
    if t == 1:
        return []
    sbh = local_seq_len(model, layout) * layout.micro_batch * model.dims.d_model * layout.compute_bytes
    per_layer: float = 6 if layout.recompute == "full" else 4
    if layout.sp_keeps_shards:  # backward gathers the attention's (and a dense MLP's) input again: 1/2 each
        per_layer += 0.5 if model.moe else 1
    n = layers_on_stage(model, layout) * layout.microbatches * per_layer
    link, bw = _link(t, hw)
    name = "SP all-gather/reduce-scatter" if layout.sequence_parallel else "TP all-reduce"
    return [CommItem(name, "tp", n * all_reduce_bytes(t, sbh), link, bw, "none")]


def pp_items(model: ModelShape, layout: Layout, hw: Hardware, scatter_gather: bool = True) -> list[CommItem]:
    """Point-to-point activation/gradient sends of a middle pipeline stage."""
    if layout.pp == 1:
        return []
    sbh: float = local_seq_len(model, layout) * layout.micro_batch * model.dims.d_model * layout.compute_bytes
    if scatter_gather or layout.sequence_parallel:
        sbh /= layout.tp
    volume = 2 * layout.microbatches * layout.virtual_stages * sbh
    link, bw = _link(layout.tp * layout.cp * layout.dp * layout.pp, hw)
    return [CommItem("p2p activations fwd+bwd", "pp", volume, link, bw, "none")]


def cp_items(model: ModelShape, layout: Layout, hw: Hardware) -> list[CommItem]:
    """Context parallelism's key/value traffic of one GPU of the most loaded stage (module docstring): per layer
    and micro-batch an all-gather of K and V in forward, a reduce-scatter of their gradients in backward, and the
    forward's gather again under full recomputation (selective keeps the gathered tensors)."""
    cp = layout.cp
    if cp == 1:
        return []
    kv = 2 * model.seq_len * layout.micro_batch * model.dims.kv_dim / layout.tp * layout.compute_bytes
    per_layer = 3 if layout.recompute == "full" else 2
    n = layers_on_stage(model, layout) * layout.microbatches * per_layer
    link, bw = _link(layout.tp * cp, hw)
    return [
        CommItem(
            f"CP K/V all-gather + grad reduce-scatter x{per_layer}/layer",
            "cp",
            n * all_gather_bytes(cp, kv),
            link,
            bw,
            "none",
        )
    ]


def comm_per_step(
    model: ModelShape, layout: Layout, hw: Hardware, scatter_gather: bool = True, imbalance: float = EXPERT_IMBALANCE
) -> CommBreakdown:
    """All traffic one GPU sends in one step, by kind, with the link it uses."""
    items = (
        dp_items(model, layout, hw)
        + tp_items(model, layout, hw)
        + pp_items(model, layout, hw, scatter_gather)
        + ep_items(model, layout, hw, imbalance)
        + cp_items(model, layout, hw)
    )
    return CommBreakdown(tuple(items))
