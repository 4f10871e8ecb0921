"""The GPU types hpctrain knows: peak FLOP/s, memory and link bandwidths, from the vendors' datasheets, and the
host side of their usual node (host memory, PCIe, node-local NVMe, the CPU's Adam rate) for offload planning.

Pure data, shared by the planner (hpctrain.plan) and the task side's MFU (hpctrain.parallel.metrics), which
must not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

GB = 10**9  # decimal gigabyte, used by the ZeRO paper and by network/NVLink datasheets
GiB = 2**30  # binary gibibyte: what nvidia-smi and torch.cuda report as "GB" of device memory


@dataclass(frozen=True)
class Hardware:
    """One GPU type in its usual node. Bandwidths are per GPU, one direction, in bytes/s.

    peak_flops is dense bf16/fp16 tensor-core throughput; `fp8_flops` the dense FP8 tensor-core throughput (0: the
    GPU has no FP8 tensor cores, i.e. compute capability below 8.9, and precision.fp8 is refused on it);
    `efficiency` is the fraction of either that large matmuls achieve in practice (Megatron reached 44-52% of
    peak end to end on A100, including everything; single large GEMMs reach ~70-80%). 0.6 is a middle guess for
    the compute part alone.

    Host side (ZeRO offload, hpctrain.plan.offload), per node unless said otherwise: `host_mem_bytes` of DRAM,
    `pcie_bw` between one GPU and the host (one direction, what pinned-memory copies reach), node-local NVMe
    `nvme_bytes` of capacity read at `nvme_read_bw` and written at `nvme_write_bw` (all drives together), and
    torch.optim.AdamW's CPU step: `cpu_adam_rate` parameters updated per second by the whole node (its memory
    bandwidth is the limit), `cpu_adam_core_rate` by one thread, on `cpu_cores` cores. The defaults are the
    "cpu" entry's placeholders, so a Hardware built with the GPU figures alone still constructs.

    `hbm_bw` is the GPU memory's bandwidth: what memory-bound element-wise kernels are timed by (selective
    recomputation's rerun, hpctrain.plan.step_time).

    `nvlink_domain` is how many GPUs one NVLink (or Infinity Fabric) fabric joins at `intra_node_bw` when that
    is more than a node's (GB200 NVL72: 72 GPUs in 18 trays of 4); 0: the node's GPUs. `overridden` names the
    config keys whose values replaced the datasheet's (hpctrain.config.cluster), so the plan can say which
    figures are whose.
    """

    name: str
    gpus_per_node: int
    gpu_mem_bytes: int
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    efficiency: float = 0.6
    host_mem_bytes: float = 16 * 2**30
    pcie_bw: float = 5e9
    nvme_bytes: float = 100e9
    nvme_read_bw: float = 1e9
    nvme_write_bw: float = 0.5e9
    cpu_cores: int = 2
    cpu_adam_rate: float = 0.24e9
    cpu_adam_core_rate: float = 0.12e9
    fp8_flops: float = 0.0
    hbm_bw: float = 20e9
    nvlink_domain: int = 0
    overridden: tuple[str, ...] = ()

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell)."""
        return self.fp8_flops > 0

    @property
    def nvlink_gpus(self) -> int:
        """The GPUs a group may span and still talk at `intra_node_bw`."""
        return max(self.nvlink_domain, self.gpus_per_node)

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError("efficiency must be in (0, 1]")
        if self.gpus_per_node < 1 or self.gpu_mem_bytes <= 0 or self.peak_flops <= 0:
            raise ValueError("gpus_per_node, gpu_mem_bytes and peak_flops must be positive")
        if self.intra_node_bw <= 0 or self.inter_node_bw <= 0:
            raise ValueError("bandwidths must be positive")
        for name in (
            "host_mem_bytes",
            "pcie_bw",
            "nvme_bytes",
            "nvme_read_bw",
            "nvme_write_bw",
            "cpu_cores",
            "cpu_adam_rate",
            "cpu_adam_core_rate",
            "hbm_bw",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.fp8_flops < 0:
            raise ValueError("fp8_flops must be >= 0 (0: no FP8 tensor cores)")
        if self.nvlink_domain < 0:
            raise ValueError("nvlink_domain must be >= 0 (0: the node's GPUs)")

    def adam_rate_per_gpu(self, threads_per_rank: int | None = None) -> float:
        """Parameters per second one rank's CPU AdamW step updates while every GPU of the node steps at once:
        the node's rate shared by its GPUs, or less when each rank runs only `threads_per_rank` threads
        (None: enough threads to reach the node's share)."""
        share = self.cpu_adam_rate / self.gpus_per_node
        return share if threads_per_rank is None else min(share, max(threads_per_rank, 1) * self.cpu_adam_core_rate)


# Sources:
#  A100: NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s dense BF16/FP16; third-generation NVLink
#        600 GB/s total per GPU = 300 GB/s each direction; 40 GB HBM2 / 80 GB HBM2e.
#        DGX A100 user guide: 8x 200 Gb/s HDR InfiniBand compute NICs per node = 25 GB/s per GPU.
#  H100: NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOP/s dense BF16 (1979 with sparsity);
#        fourth-generation NVLink 900 GB/s total = 450 GB/s each direction; 80 GB HBM3.
#        DGX H100: 8x 400 Gb/s ConnectX-7 NDR = 50 GB/s per GPU.
#  H200: NVIDIA H200 datasheet (SXM): same compute and NVLink as H100, 141 GB HBM3e;
#        DGX H200: 8x 400 Gb/s ConnectX-7 = 50 GB/s per GPU.
#  H800: NVIDIA H800 SXM5 (the export variant of H100 SXM: the same die, compute and 80 GB HBM3 at 3.35 TB/s)
#        with NVLink cut to 400 GB/s total = 200 GB/s each direction. DeepSeek-V3 technical report (2024) sec.
#        3.1 / 3.2.2: 8 GPUs a node on NVLink/NVSwitch, InfiniBand across nodes at 50 GB/s per GPU (their NVLink
#        reaches ~160 GB/s in practice).
#  B200: NVIDIA DGX B200 datasheet: 8 GPUs, 1,440 GB HBM3e (180 GB each) at 64 TB/s (8 TB/s each), 72 PFLOP/s FP8
#        training "with sparsity" = 4.5 PFLOP/s dense FP8 per GPU, BF16 half that (2.25 PFLOP/s dense; the HGX
#        B200 figures at 1,000 W); fifth-generation NVLink 1.8 TB/s total per GPU = 900 GB/s each direction
#        (14.4 TB/s for the 8); 8x 400 Gb/s ConnectX-7 = 50 GB/s per GPU.
#  GB200: NVIDIA GB200 NVL72 specifications: 72 Blackwell GPUs (1,200 W) and 36 Grace CPUs in one NVLink domain
#        (130 TB/s = 1.8 TB/s per GPU, 900 GB/s each direction); per GPU 5 PFLOP/s dense FP8, 2.5 dense BF16 (the
#        table's 10 and 5 are with sparsity); 13.4 TB HBM3e for 72 = 186 GB each, 576 TB/s = 8 TB/s each. A Slurm
#        node is a compute tray: 4 GPUs and 2 Grace CPUs. ConnectX-7 400 Gb/s per GPU across racks = 50 GB/s.
#        The checks keep TP inside the tray (cluster.gpus_per_node); the plan times DP/PP/EP/CP groups that stay
#        inside the 72-GPU domain at NVLink bandwidth (nvlink_domain).
#  MI300X: AMD Instinct MI300X data sheet: 1,307.4 TFLOP/s dense BF16, 2,614.9 dense FP8; 192 GB HBM3 at 5.3 TB/s;
#        seven Infinity Fabric links of 128 GB/s bidirectional to the other 7 GPUs of the platform's fully
#        connected 8 = 448 GB/s each direction in all (a ring uses a fraction of it: RCCL's all-reduce across
#        the 8 spreads over every link). ASSUMED: 8x 400 Gb/s NICs per node (as in Azure ND MI300X v5) = 50 GB/s
#        per GPU.
#  FP8 (fp8_flops, dense): H100 SXM datasheet "FP8 Tensor Core 3,958 teraFLOPS*" (* with sparsity) = 1979 dense,
#        twice its BF16; H200 SXM datasheet: the same 3,958* = 1979 dense. A100 (compute capability 8.0) has no
#        FP8 tensor cores (its datasheet lists none; FP8 GEMMs need 8.9+), so 0. The "cpu" entry: 0, torchao only
#        emulates FP8 there (no speed-up).
#  HBM bandwidth (hbm_bw): A100 datasheet 1,555 GB/s (40GB HBM2) and 2,039 GB/s (80GB HBM2e SXM); H100 SXM datasheet
#        3.35 TB/s; H200 datasheet 4.8 TB/s. cpu: a placeholder, ~20 GB/s of DRAM for two cores.
#  Memory: the datasheet "GB" of HBM is what nvidia-smi reports in MiB (A100-80GB: 81920 MiB), so it is
#        taken as GiB; the CUDA context, NCCL buffers and fragmentation are left to memory.py's reserve.
#  cpu:  one process per core: ~150 GFLOP/s fp32 peak for an AVX-512 core (2 FMA units x 16 lanes x 2 x
#        ~2.4 GHz); the bandwidths are placeholders for the local gloo runs; only
#        relative comparisons between layouts mean anything there.
#
# Host side (the node each GPU type usually comes in; a cluster of other servers should override these):
#  Host memory: DGX A100 user guide / datasheet: 1 TB DDR4 in the 320 GB (A100-40GB) system, 2 TB in the
#        640 GB (A100-80GB) one; DGX H100 and DGX H200: 2 TB DDR5 (32 DIMMs). Taken as 2^40 / 2^41 bytes; the
#        OS, page cache, data loaders and the ranks' own CUDA/NCCL host buffers take part of it (the planner
#        reports the need, the check compares it with the whole: see checks.py for the margin).
#  CPUs: DGX A100: 2x AMD EPYC 7742, 128 cores, 8 channels DDR4-3200 each = 410 GB/s peak; DGX H100/H200:
#        2x Intel Xeon Platinum 8480C, 112 cores, 8 channels DDR5-4800 each = 614 GB/s peak.
#  PCIe: A100 SXM: PCIe Gen4 x16 (16 GT/s x 16 lanes, 128b/130b) = 31.5 GB/s each direction; H100/H200 SXM:
#        Gen5 x16 = 63 GB/s (MLPerf's DGX H200 system description: 504 GB/s GPU-PCIe for 8 GPUs).
#        ASSUMED: pinned cudaMemcpy reaches ~80% of that (bandwidthTest-style figures, ~25 and ~50 GB/s).
#        Not modelled: DGX A100 puts two GPUs behind one PCIe switch with one x16 uplink to the CPU, so when all
#        GPUs copy at once (they do: FSDP2 gathers the same layer on every rank) each may get about half.
#  NVMe: the internal data drives, Gen4 U.2, 3.84 TB each: DGX A100 320 GB: 4 (15 TB); DGX A100 640 GB, DGX
#        H100 and DGX H200: 8 (30 TB), in RAID-0 at /raid. Datasheets of such drives (Samsung PM1733, KIOXIA
#        CM6) give ~6.5-7 GB/s sequential read and ~3.5-4 GB/s write each. ASSUMED: about half of that sum
#        through the RAID-0 filesystem with large O_DIRECT chunks: 3.5 GB/s read and 2 GB/s write per drive.
#  CPU Adam: torch.optim.AdamW on CPU tensors (hpctrain's offload: single-tensor kernels, fp32) makes about 10
#        elementwise passes over the parameter, gradient and moments: ~90 bytes of memory traffic per parameter.
#        MEASURED (torch 2.13, this repository's development machine, one thread of a Xeon core): 0.12e9
#        parameters/s per thread, i.e. ~11 GB/s, the single-core copy bandwidth measured there: memory-bound.
#        ASSUMED for a whole node: half of the peak DRAM bandwidth reached by all ranks together, / 90 bytes:
#        DGX A100 0.5 x 410e9 / 90 = 2.3e9 params/s, DGX H100/H200 0.5 x 614e9 / 90 = 3.4e9 params/s. For scale:
#        the ZeRO-Offload paper (Ren et al. 2021, Table 3) measured 2020's PyTorch CPU Adam at 1.39 s per 1B
#        parameters on a DGX-2 host (0.7e9/s) and DeepSpeed's fused CPU-Adam ~6x faster. Each rank reaches its
#        share only with enough threads (train.threads_per_rank; Hardware.adam_rate_per_gpu).
#  DGX B200: 2x Intel Xeon Platinum 8570 (112 cores), 2 TB DDR5 (8 channels DDR5-5600 a socket = 717 GB/s
#        peak: 0.5 x 717e9 / 90 = 4.0e9 Adam params/s), PCIe Gen5 as DGX H100, 8x 3.84 TB NVMe U.2.
#  GB200 tray: 2 Grace CPUs (144 Arm cores), 2 x 480 GB LPDDR5X at up to 512 GB/s each (0.5 x 1024e9 / 90 =
#        5.7e9 params/s; ASSUMED: the per-thread rate measured on x86); each Grace reaches its 2 GPUs over
#        NVLink-C2C, 900 GB/s bidirectional: ASSUMED split evenly, 225 GB/s per GPU each direction (in pcie_bw's
#        place); NVMe ASSUMED 4x 3.84 TB E1.S.
#  MI300X platform: ASSUMED (OEM servers differ): 2x AMD EPYC 9654 (192 cores), 12 channels DDR5-4800 a socket
#        = 922 GB/s peak (0.5 x 922e9 / 90 = 5.1e9 params/s), 2 TiB, PCIe Gen5 x16 per GPU, 8x 3.84 TB NVMe.
#  cpu:  placeholders: 16 GiB host memory, 2 cores at the measured per-thread rate, a 100 GB disk.
class _HostCpu(TypedDict):
    """Host-side fields of Hardware that the entries of one node model share: PCIe and the CPU's Adam."""

    pcie_bw: float
    cpu_cores: int
    cpu_adam_rate: float
    cpu_adam_core_rate: float


class _Host(_HostCpu):
    """All the host-side fields of Hardware, for a node model whose GPU types share its memory and NVMe too."""

    host_mem_bytes: float
    nvme_bytes: float
    nvme_read_bw: float
    nvme_write_bw: float


_DGX_A100_HOST = _HostCpu(pcie_bw=25 * GB, cpu_cores=128, cpu_adam_rate=2.3e9, cpu_adam_core_rate=0.12e9)
_DGX_H100_HOST = _Host(
    host_mem_bytes=2 * 2**40,
    pcie_bw=50 * GB,
    nvme_bytes=8 * 3.84e12,
    nvme_read_bw=8 * 3.5 * GB,
    nvme_write_bw=8 * 2 * GB,
    cpu_cores=112,
    cpu_adam_rate=3.4e9,
    cpu_adam_core_rate=0.12e9,
)
_DGX_B200_HOST = _Host(
    host_mem_bytes=2 * 2**40,
    pcie_bw=50 * GB,
    nvme_bytes=8 * 3.84e12,
    nvme_read_bw=8 * 3.5 * GB,
    nvme_write_bw=8 * 2 * GB,
    cpu_cores=112,
    cpu_adam_rate=4.0e9,
    cpu_adam_core_rate=0.12e9,
)
_GB200_TRAY_HOST = _Host(
    host_mem_bytes=960 * GB,
    pcie_bw=225 * GB,
    nvme_bytes=4 * 3.84e12,
    nvme_read_bw=4 * 3.5 * GB,
    nvme_write_bw=4 * 2 * GB,
    cpu_cores=144,
    cpu_adam_rate=5.7e9,
    cpu_adam_core_rate=0.12e9,
)
_MI300X_HOST = _Host(
    host_mem_bytes=2 * 2**40,
    pcie_bw=50 * GB,
    nvme_bytes=8 * 3.84e12,
    nvme_read_bw=8 * 3.5 * GB,
    nvme_write_bw=8 * 2 * GB,
    cpu_cores=192,
    cpu_adam_rate=5.1e9,
    cpu_adam_core_rate=0.12e9,
)
KNOWN_HARDWARE: dict[str, Hardware] = {
    "a100_40gb": Hardware(
        "a100_40gb",
        8,
        40 * GiB,
        312e12,
        300 * GB,
        25 * GB,
        host_mem_bytes=2**40,
        hbm_bw=1555 * GB,
        nvme_bytes=4 * 3.84e12,
        nvme_read_bw=4 * 3.5 * GB,
        nvme_write_bw=4 * 2 * GB,
        **_DGX_A100_HOST,
    ),
    "a100_80gb": Hardware(
        "a100_80gb",
        8,
        80 * GiB,
        312e12,
        300 * GB,
        25 * GB,
        host_mem_bytes=2 * 2**40,
        hbm_bw=2039 * GB,
        nvme_bytes=8 * 3.84e12,
        nvme_read_bw=8 * 3.5 * GB,
        nvme_write_bw=8 * 2 * GB,
        **_DGX_A100_HOST,
    ),
    "h100_80gb": Hardware(
        "h100_80gb", 8, 80 * GiB, 989e12, 450 * GB, 50 * GB, fp8_flops=1979e12, hbm_bw=3350 * GB, **_DGX_H100_HOST
    ),
    "h200": Hardware(
        "h200", 8, 141 * GiB, 989e12, 450 * GB, 50 * GB, fp8_flops=1979e12, hbm_bw=4800 * GB, **_DGX_H100_HOST
    ),
    "h800": Hardware(
        "h800", 8, 80 * GiB, 989e12, 200 * GB, 50 * GB, fp8_flops=1979e12, hbm_bw=3350 * GB, **_DGX_H100_HOST
    ),
    "b200": Hardware(
        "b200", 8, 180 * GiB, 2250e12, 900 * GB, 50 * GB, fp8_flops=4500e12, hbm_bw=8000 * GB, **_DGX_B200_HOST
    ),
    "gb200": Hardware(
        "gb200",
        4,
        186 * GiB,
        2500e12,
        900 * GB,
        50 * GB,
        fp8_flops=5000e12,
        hbm_bw=8000 * GB,
        nvlink_domain=72,
        **_GB200_TRAY_HOST,
    ),
    "mi300x": Hardware(
        "mi300x", 8, 192 * GiB, 1307.4e12, 448 * GB, 50 * GB, fp8_flops=2614.9e12, hbm_bw=5300 * GB, **_MI300X_HOST
    ),
    "cpu": Hardware("cpu", 2, 8 * GiB, 150e9, 5 * GB, 1.25 * GB, efficiency=0.5),
}


def hardware(name: str) -> Hardware:
    """Look up a GPU type by the names conf/cluster uses (gpu_type)."""
    try:
        return KNOWN_HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown gpu type {name!r}; known: {sorted(KNOWN_HARDWARE)}") from None


def format_bytes(n: float) -> str:
    """A size in the largest binary unit that keeps it >= 1 (bytes, KiB, MiB, GiB, TiB): 0.00 GiB never shows."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} bytes"
