"""Plain value types the planner's pure functions share: a model's shape, a parallel layout, a GPU.

They are frozen dataclasses with no torch import, so `--dry-run` can build and compare thousands of
them in well under a second. Validation happens here once, so the math modules can assume sane input.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.models.params import ffn_hidden_size, padded_vocab, param_count

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
# Pipeline schedules: torch.distributed.pipelining's names (as in hpctrain.config.schema.SCHEDULES), plus
# "interleaved" (alias of "interleaved_1f1b") and Qi et al. 2023's "zb_h1"/"zb_h2". bubble.py and memory.py
# say what each costs. MULTI_CHUNK schedules place virtual_stages model chunks on each GPU.
SCHEDULES = (
    "gpipe", "1f1b", "interleaved_1f1b", "interleaved", "looped_bfs", "interleaved_zero_bubble", "zbv",
    "zb_h1", "zb_h2",
)
INTERLEAVED = ("interleaved_1f1b", "interleaved", "interleaved_zero_bubble")
MULTI_CHUNK = INTERLEAVED + ("looped_bfs", "zbv")

GB = 10**9  # decimal gigabyte, used by the ZeRO paper and by network/NVLink datasheets
GiB = 2**30  # binary gibibyte: what nvidia-smi and torch.cuda report as "GB" of device memory


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype name ("bf16", "fp16", "fp32")."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return 4 if dtype == "fp32" else 2


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: what the memory, FLOP and communication formulas need (h = d_model, a = n_heads)."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int | None = None  # None: 4 * d_model
    tied_embeddings: bool = True
    vocab_pad_multiple: int = 1  # embedding rows: vocab_size padded to a multiple of this x TP (<= 1: none)
    dropout: float = 0.0  # > 0: dropout masks are stored for backward (memory.py)

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelShape.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else ffn_hidden_size(self.d_model)

    @property
    def params(self) -> int:
        """The model's own parameter count, with the tokenizer's vocabulary (hpctrain.models.params.param_count).

        Padding rows are left out (see `padding_params`): this is the count papers publish (GPT-3 175B).
        """
        return param_count(
            self.n_layers, self.d_model, self.vocab_size, self.seq_len, self.ffn, self.tied_embeddings
        )

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding (and columns of the logits) as built: the vocabulary padded for TP
        (hpctrain.models.params.padded_vocab, Megatron's make-vocab-size-divisible-by). Memory and FLOPs use it."""
        return padded_vocab(self.vocab_size, self.vocab_pad_multiple, tp)

    def padding_params(self, tp: int = 1) -> int:
        """Parameters the padding rows add: (rows - vocab) x d_model, twice with an untied output head."""
        extra = (self.vocab_rows(tp) - self.vocab_size) * self.d_model
        return extra if self.tied_embeddings else 2 * extra


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over dp * tp * pp GPUs.

    Megatron conventions: the number of pipeline microbatches per step is `grad_accum`, so
    global_batch = micro_batch * grad_accum * dp. Rank order is TP innermost, then DP, then PP.
    ZeRO shards over dp / dp_replicate ranks (dp_replicate > 1 is HSDP: ZeRO inside a shard group,
    plain all-reduce of the shards across the dp_replicate groups).
    `reduce_dtype` is the dtype gradients are reduced in (None: `dtype`); hpctrain's bf16 preset uses fp32.
    """

    dp: int
    tp: int
    pp: int
    virtual_stages: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    offload_optimizer: bool = False
    offload_params: bool = False
    schedule: str = "1f1b"
    dtype: str = "bf16"
    dp_replicate: int = 1
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "virtual_stages", "micro_batch", "grad_accum", "dp_replicate"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        dtype_bytes(self.dtype)
        if self.reduce_dtype is not None:
            dtype_bytes(self.reduce_dtype)
        if self.virtual_stages > 1 and self.schedule not in MULTI_CHUNK:
            raise ValueError(f"virtual_stages > 1 needs a multi-chunk schedule, one of {MULTI_CHUNK}")
        if self.schedule == "zbv" and self.virtual_stages != 2:
            raise ValueError("the zbv schedule places exactly 2 chunks on each GPU: virtual_stages=2")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp {self.dp} is not divisible by dp_replicate {self.dp_replicate}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("offload_params needs zero_stage=3 (parameters must be sharded to be offloaded)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per step (Megatron: one per gradient-accumulation step)."""
        return self.grad_accum

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def zero_shard(self) -> int:
        """Ranks ZeRO shards over: the whole DP group, or one HSDP shard group."""
        return self.dp // self.dp_replicate

    @property
    def compute_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def reduce_bytes(self) -> int:
        return dtype_bytes(self.reduce_dtype or self.dtype)


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
