"""The GPU types hpctrain knows: peak FLOP/s, memory and link bandwidths, from the vendors' datasheets.

Pure data, shared by the planner (hpctrain.plan) and the task side's MFU (hpctrain.parallel.metrics), which
must not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9  # decimal gigabyte, used by the ZeRO paper and by network/NVLink datasheets
GiB = 2**30  # binary gibibyte: what nvidia-smi and torch.cuda report as "GB" of device memory


@dataclass(frozen=True)
class Hardware:
    """One GPU type in its usual node. Bandwidths are per GPU, one direction, in bytes/s.

    peak_flops is dense bf16/fp16 tensor-core throughput; `efficiency` is the fraction of it that large
    matmuls achieve in practice (Megatron reached 44-52% of peak end to end on A100, including
    everything; single large GEMMs reach ~70-80%). 0.6 is a middle guess for the compute part alone.
    """

    name: str
    gpus_per_node: int
    gpu_mem_bytes: int
    peak_flops: float
    intra_node_bw: float
    inter_node_bw: float
    efficiency: float = 0.6

    def __post_init__(self) -> None:
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError("efficiency must be in (0, 1]")
        if self.gpus_per_node < 1 or self.gpu_mem_bytes <= 0 or self.peak_flops <= 0:
            raise ValueError("gpus_per_node, gpu_mem_bytes and peak_flops must be positive")
        if self.intra_node_bw <= 0 or self.inter_node_bw <= 0:
            raise ValueError("bandwidths must be positive")


# Sources:
#  A100: NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s dense BF16/FP16; third-generation NVLink
#        600 GB/s total per GPU = 300 GB/s each direction; 40 GB HBM2 / 80 GB HBM2e.
#        DGX A100 user guide: 8x 200 Gb/s HDR InfiniBand compute NICs per node = 25 GB/s per GPU.
#  H100: NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOP/s dense BF16 (1979 with sparsity);
#        fourth-generation NVLink 900 GB/s total = 450 GB/s each direction; 80 GB HBM3.
#        DGX H100: 8x 400 Gb/s ConnectX-7 NDR = 50 GB/s per GPU.
#  H200: NVIDIA H200 datasheet (SXM): same compute and NVLink as H100, 141 GB HBM3e;
#        DGX H200: 8x 400 Gb/s ConnectX-7 = 50 GB/s per GPU.
#  Memory: the datasheet "GB" of HBM is what nvidia-smi reports in MiB (A100-80GB: 81920 MiB), so it is
#        taken as GiB; the CUDA context, NCCL buffers and fragmentation are left to memory.py's reserve.
#  cpu:  one process per core: ~150 GFLOP/s fp32 peak for an AVX-512 core (2 FMA units x 16 lanes x 2 x
#        ~2.4 GHz); the bandwidths are placeholders for the local gloo runs; only
#        relative comparisons between layouts mean anything there.
KNOWN_HARDWARE: dict[str, Hardware] = {
    "a100_40gb": Hardware("a100_40gb", 8, 40 * GiB, 312e12, 300 * GB, 25 * GB),
    "a100_80gb": Hardware("a100_80gb", 8, 80 * GiB, 312e12, 300 * GB, 25 * GB),
    "h100_80gb": Hardware("h100_80gb", 8, 80 * GiB, 989e12, 450 * GB, 50 * GB),
    "h200": Hardware("h200", 8, 141 * GiB, 989e12, 450 * GB, 50 * GB),
    "cpu": Hardware("cpu", 2, 8 * GiB, 150e9, 5 * GB, 1.25 * GB, efficiency=0.5),
}


def hardware(name: str) -> Hardware:
    """Look up a GPU type by the names conf/cluster uses (gpu_type)."""
    try:
        return KNOWN_HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown gpu type {name!r}; known: {sorted(KNOWN_HARDWARE)}") from None
