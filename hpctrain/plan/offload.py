"""What ZeRO offload costs per step: host memory, NVMe space and traffic, PCIe copies and the CPU's Adam step.

hpctrain offloads with FSDP2's CPUOffloadPolicy (hpctrain/parallel/data_parallel.py; states.offloads): each rank
keeps its fp32 shards of the parameters (the master weights, 4 n/N bytes), of the gradients (4 n/N) and Adam's two
moments (8 n/N) in host memory, and torch.optim.AdamW steps them on the CPU. n = parameters on the GPU of the
stage with the most of them (memory.stage_params_per_gpu, TP and PP applied), N = the ZeRO shard size
(Layout.zero_shard); the NVMe bytes come from the memory model itself (states.hpctrain_state_parts' NVMe part), the
host bytes tensor by tensor (below: the pinned rounding and the checkpoint staging copies are host memory too).
With zero.offload_optimizer_device=nvme the moments live in a file per rank on node-local NVMe
(hpctrain/parallel/nvme.py), read and written back at every optimizer step; the fp32 parameter and gradient shards
stay in host memory (FSDP2 copies the parameter shard to the GPU for every all-gather, so it must be resident).
G = GPUs per node (hw.gpus_per_node: the job's, see estimate.cluster_hardware); all ranks of a node share its
host memory, CPU and drives. With expert parallelism n/N stands for the rank's shard parameters
(memory.shard_params_per_gpu: its EP rank's experts cut over dp_shard / ep ranks, the rest over dp_shard).

Per node: host memory G x (16 or, with NVMe, 8) n/N + the pinned rounding + T staging copies of 12 n/N each, all
rounded (below); NVMe space G x 8 n/N; NVMe traffic per step G x 8 n/N read and as much written.

Per GPU and step, over PCIe (torch 2.13, fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`: the sharded fp32
tensor is copied `.to(device)` before its all-gather, then cast to the compute dtype on the GPU;
_fsdp_collectives.py `foreach_reduce`: the reduced shard is cast to fp32 and copied to the CPU):
  * host to device: 4 n/N before each parameter all-gather, A of them per step as comm.py counts them
    (comm.param_all_gathers: ZeRO-3 gathers in forward and again in backward of every micro-batch, 2 m);
  * device to host: 4 n/N once per step (hpctrain reduces the gradients after the last micro-batch only:
    states.py, `set_requires_gradient_sync`);
  pcie_s = (A + 1) x 4 n/N / hw.pcie_bw.

Optimizer step on the CPU: cpu_adam_s = n/N / (the rank's share of the node's AdamW rate,
Hardware.adam_rate_per_gpu: memory-bound, ~90 bytes of DRAM traffic per parameter; fewer threads per rank than
the node's cores / G lower it). With NVMe the moments stream through host memory in chunks, three in flight (read
the next, update this one, write the previous), so in steady state a chunk takes the longer of its update and its
transfers; the drives serve the reads and the writes of the step one after the other (the same drives, and a
drive's read and write bandwidth are not additive), so
  nvme_s = G x 8 n/N / nvme_read_bw + G x 8 n/N / nvme_write_bw,   optimizer_s = max(cpu_adam_s, nvme_s)
(one chunk's read before the first update and one write after the last are left out: milliseconds).

Exposed: exposed_s = optimizer_s + pcie_s, all of it on the critical path.
  * The optimizer step: FSDP2 runs no part of it during backward (torch.optim steps after backward returns, and
    the next forward's all-gathers read the parameters it writes), so nothing overlaps it. Without offload the
    GPU's fused AdamW on n/N parameters takes milliseconds and step_time.py leaves it out, so the offloaded step
    is the whole difference.
  * The copies: the host-to-device copy runs on the all-gather's copy-in stream, in front of its all-gather,
    so it lengthens the very chain whose overlap with compute step_time.py already credits to the all-gather
    (DP_EXPOSED); the gradient copy of the last layers comes after the last backward matmul. Counting them whole
    is an upper bound, simple and of the right size: on the large layouts offload is for, PCIe time is a small
    part of the optimizer step (docs/planner.md, 175B).
Not counted: host-memory bandwidth the copies take from the CPU's Adam, DGX A100's two GPUs per PCIe switch
uplink (hardware.py), the NVMe streaming chunks in host memory, the page cache, and the files of a checkpoint
tier kept in RAM (a tmpfs path such as /dev/shm).

Host memory, tensor by tensor (`host_memory`; torch 2.13). The figure is per rank of the most loaded pipeline stage
(its largest shards: rank 0's), times G per node:
  * Every pinned tensor is its own block of torch's caching host allocator, rounded up to the next power of two
    (include/ATen/core/CachingHostAllocator.h `allocate`: PowerOf2Ceil(size) when size <= pinned_max_round_threshold
    and <= pinned_max_cached_size, both SIZE_MAX unless PYTORCH_ALLOC_CONF sets pinned_max_round_threshold_mb /
    pinned_max_cached_size_mb, which hpctrain does not; c10/core/AllocatorConfig.h). The block is the rounded size
    with cudaHostAlloc and with pinned_use_cuda_host_register alike (aten/src/ATen/cuda/CachingHostAllocator.cpp
    allocates the rounded size), and a freed block stays cached, so a tensor reallocated every step costs its
    block once. hpctrain pins only where a GPU exists (torch.cuda.is_available()): not on the "cpu" hardware.
  * FSDP2's shards (fsdp/_fully_shard/_fsdp_param.py, lines 298-315): each parameter's shard is dim 0 of its
    TP-local tensor split in N chunks of ceil(rows / N) rows (torch.chunk; rank 0's is the largest; an expert
    weight's EP-local tensor, n_experts / ep of its experts, in N / ep chunks), fp32, moved to
    the CPU and pinned on its own (CPUOffloadPolicy.pin_memory, hpctrain's data_parallel.py: on GPUs). Its gradient
    shard comes back by `.to("cpu", non_blocking=True)` (_fsdp_collectives.py, lines 711-743: non-blocking when
    pinned and no gradient is there yet, which is always so for hpctrain: zero_grad(set_to_none=True) and one
    reduce-scatter per step), which allocates its output pinned (ATen `_to_copy`: pin_out): a second block per
    parameter. Adam's moments are `torch.zeros_like(p)` (optim/adam.py, lines 178-184): pageable, exact size
    (a tensor's options() carry no pinning, ATen/core/TensorBase.h, lines 585-589). With s_p = 4 x the elements
    of parameter p's shard and B(s) = its pinned block (s when nothing is pinned):
    shards = sum_p (2 s_p + 2 s_p for the moments with CPU offload), pinned_rounding = sum_p 2 (B(s_p) - s_p).
    When every dim 0 divides evenly, shards is the memory model's 16 n/N (8 with NVMe).
  * Checkpoint staging: each tier has its own ReusingStager (hpctrain/checkpoint/manager.py), which keeps for the
    whole run a copy of the rank's Engine.state_dict() made by `_create_cpu_state_dict(..., pin_memory=True)`
    (distributed/_state_dict_utils.py, lines 436-437: `torch.empty(...).pin_memory()` per tensor, the caching
    allocator; the cudaHostRegister path, lines 428-435, is for share_memory only, unused). The state is the fp32
    parameter shard and Adam's exp_avg and exp_avg_sq of the same shape, per parameter (0-dim `step` counters
    are staged unpinned, 4 bytes each, and the RNG states, a few KiB, are left out): staging per tier =
    sum_p 3 B(s_p), for each of T = len(checkpoint.tiers) tiers (none with checkpoint.enabled=false).
  * NVMe offload: a save's state_dict() reads the moments back from the file into pageable tensors
    (hpctrain/parallel/nvme.py `read_moments`), held while the save is staged: sum_p 2 s_p more, once (tiers
    stage one after another), when there is at least one tier.
  host per GPU = shards + pinned_rounding + T x staging per tier (+ the NVMe read-back).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctrain.models.params import stage_holds
from hpctrain.plan.comm import param_all_gathers
from hpctrain.plan.memory import (
    fsdp_unit_params_per_gpu,
    layer_params_per_gpu,
    layers_on_stage,
    shard_params_per_gpu,
    stage_params_per_gpu,
)
from hpctrain.plan.states import ADAM, MASTER, hpctrain_state_parts, moments_on_nvme, offloads
from hpctrain.plan.types import GiB, Hardware, Layout, ModelShape

if TYPE_CHECKING:
    from hpctrain.config.schema import CheckpointConfig
    from hpctrain.models.family import Family

# torch's default pinned_max_round_threshold (c10/core/AllocatorConfig.h: SIZE_MAX): every pinned block is rounded.
PINNED_ROUND_THRESHOLD = 2**64 - 1


def pinned_block(nbytes: int, threshold: int = PINNED_ROUND_THRESHOLD) -> int:
    """Bytes the caching host allocator reserves for a pinned tensor of `nbytes`: the next power of two
    (CachingHostAllocator.h `allocate`, c10::llvm::PowerOf2Ceil), or nbytes itself above `threshold`."""
    if nbytes <= 0:
        return 0
    return 1 << (nbytes - 1).bit_length() if nbytes <= threshold else nbytes


def shard_elements(family: Family, name: str, shape: tuple[int, ...], tp: int, shard: int, ep: int = 1) -> int:
    """Elements of the largest FSDP2 shard (rank 0's) of `family`'s parameter `name`: TP splits its
    `tp_dims` dim (the largest piece: ceil), expert parallelism an expert weight's expert dim (`ep_dims`) into ep,
    FSDP2 dim 0 of the local tensor into `shard` chunks (an expert weight's into shard / ep: the ranks an EP group
    leaves) of ceil(rows / chunks) rows (torch.chunk, _fsdp_param.py `_chunk_with_empty`; Shard(0) is
    fully_shard's default placement)."""
    local = list(shape)
    expert = family.expert_dim(name)
    if expert is not None:
        local[expert] //= ep
        shard //= ep
    dim = family.sharded_dim(name)
    if dim is not None and tp > 1:
        local[dim] = -(-local[dim] // tp)
    return -(-local[0] // shard) * math.prod(local[1:])


def rank_shards(model: ModelShape, layout: Layout, stage: int) -> list[tuple[int, int]]:
    """The parameter shards one GPU of pipeline stage `stage` holds, as (elements, how many): identical layers
    are counted once and multiplied (the same layers and top-level modules as memory.stage_params_per_gpu)."""
    shard, tp, ep = layout.zero_shard, layout.tp, layout.ep
    counts: Counter[int] = Counter()
    layers, split = layers_on_stage(model, layout, stage), layout.layer_split(model.dims.n_layers)
    for name, shape in model.block_shapes().items():
        counts[shard_elements(model.family, name, shape, tp, shard, ep)] += layers
    for name, shape in model.top_shapes(tp).items():
        for chunk in layout.stages_of(stage):
            if stage_holds(model.family, name.split(".")[0], chunk, split):
                counts[shard_elements(model.family, name, shape, tp, shard, ep)] += 1
    return sorted(counts.items())


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of one rank under offload (module docstring), by term."""

    shards: float  # FSDP2's fp32 shards as allocated: parameter and gradient (+ Adam's moments with CPU offload)
    pinned_rounding: float  # what the power-of-two rounding of the pinned parameter and gradient shards adds
    staging_per_tier: float  # one tier's staged copy of the rank's checkpointed state, its rounding included
    staging_rounding_per_tier: float  # of which rounding
    tiers: int  # checkpoint tiers, each with its own staged copy
    save_readback: float  # NVMe: the moments read back into host memory while a save is staged
    pinned: bool = False  # the shards and staging copies are pinned (a GPU node), hence rounded

    @property
    def staging(self) -> float:
        return self.tiers * self.staging_per_tier

    @property
    def total(self) -> float:
        return self.shards + self.pinned_rounding + self.staging + self.save_readback


def host_memory(shards: list[tuple[int, int]], moments_in_host: bool, pinned: bool, tiers: int) -> HostMemory:
    """Host bytes of a rank holding `shards` ((elements, count) per parameter shape, rank_shards): pure arithmetic
    on each tensor's bytes and its pinned block (module docstring)."""
    elements = sum(n * k for n, k in shards)
    exact = MASTER * elements  # one fp32 tensor per parameter
    blocks = sum((pinned_block(MASTER * n) if pinned else MASTER * n) * k for n, k in shards)
    per_moment = ADAM // MASTER  # Adam's moments: exp_avg and exp_avg_sq, fp32, shaped as the parameter
    return HostMemory(
        shards=2 * exact + (ADAM * elements if moments_in_host else 0),
        pinned_rounding=2 * (blocks - exact),
        staging_per_tier=(1 + per_moment) * blocks,
        staging_rounding_per_tier=(1 + per_moment) * (blocks - exact),
        tiers=tiers,
        save_readback=0 if moments_in_host or not tiers else ADAM * elements,
        pinned=pinned,
    )


def checkpoint_tiers(checkpoint: CheckpointConfig | None) -> int:
    """Tiers that stage a copy of the rank's state: checkpoint.tiers, none when checkpointing is off."""
    return len(checkpoint.tiers) if checkpoint is not None and checkpoint.enabled else 0


def pins_host_memory(hw: Hardware) -> bool:
    """hpctrain pins offloaded and staged tensors only where torch.cuda.is_available(): not on the "cpu" entry."""
    return hw.name != "cpu"


@dataclass(frozen=True)
class OffloadCosts:
    """Offload's footprint and time per step (all zero when the layout does not offload). Bytes per node are for
    hw.gpus_per_node ranks; PCIe bytes and all times are per GPU (every GPU of a node does the same at once)."""

    device: str  # "" (no offload), "cpu" or "nvme": where Adam's moments live
    params_per_gpu: float  # n: parameters on the GPU (its TP shard of its pipeline stage, its EP rank's experts)
    shard: int  # N: ranks ZeRO shards over
    shard_params: float  # n / N: the parameters one rank steps on the CPU (experts: over N / ep, see module docstring)
    gpus_per_node: int
    host: HostMemory  # host memory of one rank, by term (module docstring)
    nvme_bytes_per_gpu: float
    all_gathers: int  # parameter all-gathers per step, each preceded by a host-to-device copy
    h2d_bytes: float  # per GPU per step
    d2h_bytes: float  # per GPU per step
    pcie_s: float
    cpu_adam_s: float
    nvme_read_s: float
    nvme_write_s: float

    @property
    def offloaded(self) -> bool:
        return bool(self.device)

    @property
    def host_bytes_per_gpu(self) -> float:
        """Host memory of one rank: FSDP2's shards, their pinned rounding, the checkpoint staging copies."""
        return self.host.total

    @property
    def host_bytes_per_node(self) -> float:
        return self.host_bytes_per_gpu * self.gpus_per_node

    def host_terms(self, unit: float = GiB, name: str = "GiB") -> str:
        """The host figure per node by term, as the plan and the checks print it; 175B, zero=stage3_offload:
        "offloaded shards (...) 6.91 GiB incl. pinned rounding 1.65 GiB, checkpoint staging 6.42 GiB x 3 tiers
        (each incl. pinned rounding 2.48 GiB)"."""
        g, h = self.gpus_per_node, self.host
        what = "fp32 parameter and gradient shards" + ("" if self.device == "nvme" else " and Adam moments")
        text = (
            f"offloaded shards ({what}) {g * (h.shards + h.pinned_rounding) / unit:,.2f} {name} incl. pinned "
            f"rounding {g * h.pinned_rounding / unit:,.2f} {name}, "
        )
        if not h.tiers:
            return text + "no checkpoint staging (no checkpoint tiers)"
        text += (
            f"checkpoint staging {g * h.staging_per_tier / unit:,.2f} {name} x {h.tiers} "
            f"tier{'' if h.tiers == 1 else 's'}"
        )
        if h.staging_rounding_per_tier:
            text += f" (each incl. pinned rounding {g * h.staging_rounding_per_tier / unit:,.2f} {name})"
        if h.save_readback:
            text += f", moments read back from NVMe during a save {g * h.save_readback / unit:,.2f} {name}"
        return text

    @property
    def nvme_bytes_per_node(self) -> float:
        return self.nvme_bytes_per_gpu * self.gpus_per_node

    @property
    def nvme_read_bytes(self) -> float:
        """Bytes read from the node's NVMe per step: every rank's moments, once."""
        return self.nvme_bytes_per_node

    @property
    def nvme_write_bytes(self) -> float:
        return self.nvme_bytes_per_node

    @property
    def pcie_bytes(self) -> float:
        """Bytes one GPU moves over PCIe per step, both directions."""
        return self.h2d_bytes + self.d2h_bytes

    @property
    def nvme_s(self) -> float:
        return self.nvme_read_s + self.nvme_write_s

    @property
    def nvme_bound(self) -> bool:
        """The drives, not the CPU, set the optimizer step's time."""
        return self.nvme_s > self.cpu_adam_s

    @property
    def optimizer_s(self) -> float:
        """The optimizer step on the CPU, the moments streamed from and to NVMe alongside."""
        return max(self.cpu_adam_s, self.nvme_s)

    @property
    def exposed_s(self) -> float:
        """Offload time added to the step (module docstring: none of it overlaps compute)."""
        return self.optimizer_s + self.pcie_s


def offload_costs(
    model: ModelShape,
    layout: Layout,
    hw: Hardware,
    threads_per_rank: int | None = None,
    checkpoint: CheckpointConfig | None = None,
) -> OffloadCosts:
    """What offloading costs `layout` on `hw` per step (module docstring); zeros when it does not offload.
    threads_per_rank: the CPU threads each rank's AdamW runs on (None: enough for the rank's share of the node).
    checkpoint: the run's checkpoint section, for its tiers' staging copies in host memory (None: no staging)."""
    g = hw.gpus_per_node
    if not offloads(layout):
        return OffloadCosts(
            "", 0.0, 1, 0.0, g, HostMemory(0.0, 0.0, 0.0, 0.0, 0, 0.0), 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
        )
    stages = range(layout.pp)  # uneven stages: any rank may hold the most
    stage = max(stages, key=lambda s: stage_params_per_gpu(model, layout, s))
    n = stage_params_per_gpu(model, layout, stage)
    sharded = shard_params_per_gpu(model, layout, stage)
    layer = layer_params_per_gpu(model, layout.tp, layout.ep)
    root = n - layers_on_stage(model, layout, stage) * layer  # as memory.stage_parts: parameters outside blocks
    parts = hpctrain_state_parts(n, layer, layout, fsdp_unit_params_per_gpu(model, layout), root, sharded)
    nvme = sum(p.bytes for p in parts if p.nvme)
    on_nvme, tiers, pinned = moments_on_nvme(layout), checkpoint_tiers(checkpoint), pins_host_memory(hw)
    host = max(
        (host_memory(rank_shards(model, layout, s), not on_nvme, pinned, tiers) for s in stages), key=lambda h: h.total
    )
    fp32_shard = MASTER * sharded
    gathers = param_all_gathers(layout)
    h2d, d2h = gathers * fp32_shard, fp32_shard
    return OffloadCosts(
        device="nvme" if on_nvme else "cpu",
        params_per_gpu=n,
        shard=layout.zero_shard,
        shard_params=sharded,
        gpus_per_node=g,
        host=host,
        nvme_bytes_per_gpu=nvme,
        all_gathers=gathers,
        h2d_bytes=h2d,
        d2h_bytes=d2h,
        pcie_s=(h2d + d2h) / hw.pcie_bw,
        cpu_adam_s=sharded / hw.adam_rate_per_gpu(threads_per_rank),
        nvme_read_s=nvme * g / hw.nvme_read_bw,
        nvme_write_s=nvme * g / hw.nvme_write_bw,
    )
