"""What ZeRO offload costs per step: host memory, NVMe space and traffic, PCIe copies and the CPU's Adam step.

hpctrain offloads with FSDP2's CPUOffloadPolicy (hpctrain/parallel/data_parallel.py; states.offloads): each rank
keeps its fp32 shards of the parameters (the master weights, 4 n/N bytes), of the gradients (4 n/N) and Adam's two
moments (8 n/N) in host memory, and torch.optim.AdamW steps them on the CPU. n = parameters on the GPU of the
stage with the most of them (memory.stage_params_per_gpu, TP and PP applied), N = the ZeRO shard size
(Layout.zero_shard); the bytes come from the memory model itself (states.hpctrain_state_parts' host and NVMe parts).
With zero.offload_optimizer_device=nvme the moments live in a file per rank on node-local NVMe
(hpctrain/parallel/nvme.py), read and written back at every optimizer step; the fp32 parameter and gradient shards
stay in host memory (FSDP2 copies the parameter shard to the GPU for every all-gather, so it must be resident).
G = GPUs per node (hw.gpus_per_node: the job's, see estimate.cluster_hardware); all ranks of a node share its
host memory, CPU and drives.

Per node: host memory G x (16 or, with NVMe, 8) n/N; NVMe space G x 8 n/N; NVMe traffic per step G x 8 n/N read
and as much written.

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
uplink (hardware.py), the NVMe staging chunks in host memory, and the page cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan.comm import param_all_gathers
from hpctrain.plan.memory import layer_params_per_gpu, stage_params_per_gpu
from hpctrain.plan.states import MASTER, hpctrain_state_parts, moments_on_nvme, offloads
from hpctrain.plan.types import Hardware, Layout, ModelShape


@dataclass(frozen=True)
class OffloadCosts:
    """Offload's footprint and time per step (all zero when the layout does not offload). Bytes per node are for
    hw.gpus_per_node ranks; PCIe bytes and all times are per GPU (every GPU of a node does the same at once)."""

    device: str  # "" (no offload), "cpu" or "nvme": where Adam's moments live
    params_per_gpu: float  # n: parameters on the GPU (its TP shard of its pipeline stage)
    shard: int  # N: ranks ZeRO shards over
    gpus_per_node: int
    host_bytes_per_gpu: float
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
    def shard_params(self) -> float:
        """n / N: the parameters one rank steps on the CPU."""
        return self.params_per_gpu / self.shard

    @property
    def host_bytes_per_node(self) -> float:
        return self.host_bytes_per_gpu * self.gpus_per_node

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


def offload_costs(model: ModelShape, layout: Layout, hw: Hardware, threads_per_rank: int | None = None) -> OffloadCosts:
    """What offloading costs `layout` on `hw` per step (module docstring); zeros when it does not offload.
    threads_per_rank: the CPU threads each rank's AdamW runs on (None: enough for the rank's share of the node)."""
    g = hw.gpus_per_node
    if not offloads(layout):
        return OffloadCosts("", 0.0, 1, g, 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    n = max(stage_params_per_gpu(model, layout.tp, layout.pp, s) for s in {0, layout.pp - 1})
    parts = hpctrain_state_parts(n, layer_params_per_gpu(model, layout.tp), layout)
    host = sum(p.bytes for p in parts if p.cpu)
    nvme = sum(p.bytes for p in parts if p.nvme)
    shard = layout.zero_shard
    fp32_shard = MASTER * n / shard
    gathers = param_all_gathers(layout)
    h2d, d2h = gathers * fp32_shard, fp32_shard
    return OffloadCosts(
        device="nvme" if moments_on_nvme(layout) else "cpu",
        params_per_gpu=n, shard=shard, gpus_per_node=g, host_bytes_per_gpu=host, nvme_bytes_per_gpu=nvme,
        all_gathers=gathers, h2d_bytes=h2d, d2h_bytes=d2h,
        pcie_s=(h2d + d2h) / hw.pcie_bw,
        cpu_adam_s=n / shard / hw.adam_rate_per_gpu(threads_per_rank),
        nvme_read_s=nvme * g / hw.nvme_read_bw,
        nvme_write_s=nvme * g / hw.nvme_write_bw,
    )
