"""The config schema: Hydra structured configs.

These dataclasses are the single source of truth for which keys exist and their types; the YAML files in
conf/ only hold values. Composition against this schema rejects unknown keys (typos) and wrong types before
any of hpctrain's own checks run. Semantic checks (divisibility, batch arithmetic...) live in `checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from hpctrain.schedules import RUNNABLE


class Executor(str, Enum):
    local = "local"
    slurm = "slurm"


# Pipeline schedules (torch.distributed.pipelining). A plain string: "1f1b" is not a valid enum member name.
SCHEDULES = RUNNABLE  # hpctrain.schedules: one entry per schedule


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class DataKind(str, Enum):
    text_bytes = "text_bytes"
    tokens = "tokens"
    indexed = "indexed"
    synthetic = "synthetic"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class TrackingMode(str, Enum):
    disabled = "disabled"
    offline = "offline"
    online = "online"


class PlanFormat(str, Enum):
    text = "text"
    json = "json"


class SimulateDevice(str, Enum):
    """Where dry_run=simulate runs its rank: fake CUDA (a GPU's attention kernels) where it can be built, or not."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class RopeConfig:
    theta: float = 10000.0  # base of the rotary frequencies (Llama 3: 500000)
    # Llama 3's frequency scaling (HF rope_type "llama3"); 0: none
    scaling_factor: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward (hpctrain.models.common.moe): every block's MLP becomes n_experts SwiGLU experts
    and a router; 0 experts is a dense model. Only the MoE families read it (model.arch=mixtral, qwen3_moe)."""

    n_experts: int = 0  # routed experts per layer (0: dense)
    top_k: int = 2  # experts each token goes through
    expert_hidden: int = 0  # each expert's SwiGLU hidden size (0: model.ffn_hidden)
    n_shared_experts: int = 0  # a SwiGLU of n_shared_experts x expert_hidden every token also goes through
    router: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3, with the bias below)
    norm_topk_prob: bool = True  # renormalise the top_k router weights to sum 1
    n_groups: int = 1  # sigmoid router: expert groups, of which each token may use the best topk_groups
    topk_groups: int = 1
    route_scale: float = 1.0  # combine weights multiplied by it
    capacity_factor: float = 0.0  # 0: dropless; else each expert keeps ceil(cf x tokens x top_k / n_experts)
    balance_coef: float = 0.0  # load-balancing loss coefficient (HF router_aux_loss_coef: Mixtral 0.02, Qwen3 0.001)
    z_loss_coef: float = 0.0  # router z-loss coefficient (ST-MoE: 0.001)
    bias_update_rate: float = 1e-3  # sigmoid router: the auxiliary-loss-free bias's step per optimizer step


@dataclass
class ModelConfig:
    name: str = MISSING
    # a family of hpctrain.models.registry, which config does not import (models reads config): `check_schema`
    # refuses a name it does not hold, naming the known ones; tests/test_families.py holds this default to it
    arch: str = "gpt"
    n_layers: int = MISSING
    d_model: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = 0  # key/value heads of grouped-query attention (0: n_heads)
    head_dim: int = 0  # each attention head's width (0: d_model / n_heads; Qwen3: 128 whatever d_model is)
    vocab_size: int = 50257  # the tokenizer's vocabulary (what the loss and exports use)
    vocab_pad_multiple: int = 64  # embedding rows padded to a multiple of this x TP (<= 1: no padding)
    context: int = 2048  # longest sequence the model is trained on (gpt: the position table's size)
    ffn_mult: int = 4
    ffn_hidden: int = 0  # the MLP's hidden size (0: ffn_mult x d_model)
    norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)  # families with rotary positions
    moe: MoEConfig = field(default_factory=MoEConfig)  # Mixture-of-Experts families
    dropout: float = 0.0
    init_std: float = 0.02
    init_from: str | None = None  # a Hugging Face model directory to start from (continued pretraining)


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: inferred as world_size / (tp * pp * cp)
    dp_replicate: int = 1  # >1: HSDP, ZeRO shards within groups of dp/dp_replicate ranks
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the data-parallel ranks
    # Context parallelism: each sequence split over cp ranks (2 x cp chunks, rank r holding chunk r and its mirror,
    # so the causal mask leaves no rank idle); keys and values are all-gathered over the cp group in each attention.
    # The world is dp x tp x pp x cp; ZeRO/FSDP shards over the dp_shard x cp ranks.
    cp: int = 1
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank
    # Uneven pipeline stages (Llama 3 405B: one layer fewer on the stages holding the embedding and the head). The
    # layers of the first and of the last stage (model chunk); 0: as the others. The stages not set share the rest.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    schedule: str = "1f1b"  # one of SCHEDULES
    # Pipeline microbatches per step. 0: equal to train.grad_accum (Megatron's convention).
    microbatches: int = 0
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.none
    compile: bool = False
    auto: bool = False  # parallel=auto: the planner's search picks the layout (dp/tp/pp/micro-batch/ZeRO/recompute)


@dataclass
class ZeroConfig:
    stage: int = 0  # 0: DDP, 1: optimizer states, 2: + gradients, 3: + parameters (FSDP2)
    # ZeRO-2/3: sum gradients unsharded (reduce dtype) over the step's micro-batches and reduce-scatter once,
    # as ZeRO-1 always does: fewer reduce-scatters for a full-size gradient buffer (the planner prices both).
    accumulate_unsharded: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    # Where offloaded optimizer state lives: "cpu" (host memory) or "nvme" (Adam's moments in files under
    # nvme_path, a node-local NVMe mount, streamed through host memory at each step; hpctrain/parallel/nvme.py).
    offload_optimizer_device: str = "cpu"
    nvme_path: str = ""
    nvme_chunk_mb: float = 64.0  # MiB of each moment streamed at a time (three chunks in flight: read, update, write)
    reduce_bucket_size: int = 25_000_000  # bytes per gradient bucket (DDP bucket_cap_mb / ZeRO reduce)
    allgather_bucket_size: int = 25_000_000


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the decay ends at lr x min_lr_ratio, so sweeping lr needs no second key
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    decay: str = "cosine"  # cosine | linear | constant
    grad_clip: float = 1.0  # global norm; 0 disables


@dataclass
class PrecisionConfig:
    dtype: DType = DType.fp32
    reduce_dtype: DType = DType.fp32
    loss_scaling: bool = False  # dynamic loss scaling, needed for fp16
    initial_scale: float = 65536.0
    loss_scale_window: int = 1000  # clean steps before the scale doubles
    min_scale: float = 1.0
    tf32: bool = True  # on GPUs: fp32 matmuls and convolutions on TF32 tensor cores (no effect on CPU)
    # FP8 GEMMs in the transformer blocks' Linears through torchao (docs/fp8.md): none, or the torchao recipe
    # tensorwise | rowwise | rowwise_with_gw_hp. Needs FP8 tensor cores (H100/H200); emulated on CPU.
    fp8: str = "none"


@dataclass
class PrepareConfig:
    """indexed: make the dataset on the login node before the job starts, if it is not there yet."""

    inputs: list[str] = field(default_factory=list)  # text/jsonl files, dirs, a datasets dir, or "stdlib"
    tokenizer: str | None = None  # a tokenizers tokenizer.json; None: a byte-level BPE trained on the inputs
    vocab_size: int = 8192  # of the trained BPE
    workers: int = 2
    text_key: str = "text"  # the field of a JSON line that holds the text


@dataclass
class DataConfig:
    kind: DataKind = DataKind.text_bytes
    path: str | None = None  # tokens: a .bin file; text_bytes: where the token file is cached
    token_dtype: str = "uint16"  # tokens: uint16 | uint32
    vocab_size: int = 256  # vocabulary the data is encoded in
    max_bytes: int = 16_000_000  # text_bytes: cap on corpus size
    # indexed: Megatron-LM datasets (PREFIX.bin + PREFIX.idx), blended Megatron's way: "0.3 /d/a 0.7 /d/b", or
    # one prefix alone
    blend: str | None = None
    valid_blend: str | None = None  # indexed: validation prefixes of their own (else valid_fraction)
    # Held out for validation: the last fraction of each prefix's documents (indexed) or of the tokens (flat)
    valid_fraction: float = 0.0
    prefetch: int = 1  # steps of batches read ahead in a background thread (0: read on the training thread)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


def parse_blend(text: str) -> list[tuple[float, str]]:
    """Megatron's blend syntax: "W1 PREFIX1 W2 PREFIX2 ..." or a single "PREFIX" (weight 1). Raises ValueError
    with what is wrong, for the config check to report."""
    words = text.split()
    if len(words) == 1:
        return [(1.0, words[0])]
    if not words or len(words) % 2:
        raise ValueError(f"{text!r} is not weight/prefix pairs")
    pairs = []
    for weight, prefix in zip(words[::2], words[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(
                f"{weight!r} is not a weight (pairs of a weight and a prefix: 0.3 /data/a 0.7 /data/b)"
            ) from None
        if not w > 0:
            raise ValueError(f"the weight of {prefix} must be > 0, got {weight}")
        pairs.append((w, prefix))
    return pairs


@dataclass
class TierConfig:
    name: str = MISSING
    path: str = MISSING
    interval_steps: int = 0  # 0: no step interval
    interval_minutes: float = 0.0
    keep_last: int = 2
    # Re-derive interval_minutes after every save from the measured blocking cost and the job's MTBF
    # (Daly's optimum; cluster.failure_rate_per_gpu_day); the configured interval is the first one.
    auto: bool = False


@dataclass
class CheckpointConfig:
    enabled: bool = True
    tiers: list[TierConfig] = field(default_factory=list)
    save_final: bool = True
    # Resume even if the data order, batch or sequence length would differ from the saved run (not exact).
    force_resume: bool = False
    # A tier's save still running at its next interval: "skip" that interval (training never waits) or
    # "wait" for it (every interval saved, training may block).
    when_busy: str = "skip"
    write_threads: int = 2  # files each rank writes in parallel (DCP FileSystemWriter thread_count)
    # Check each record's CRC32C as a resume reads it (a damaged checkpoint is skipped, the next one loaded).
    verify_on_load: bool = True


@dataclass
class NcclConfig:
    """NCCL settings; unset ones are derived on each node (active HCAs, nearest HCA first, RoCE GID)."""

    socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME; default: NCCL's own choice (skips lo, docker*)
    ib_hca: str | None = None  # NCCL_IB_HCA verbatim; default: the node's compute HCAs, exact names
    exclude_hca: str | None = None  # HCAs never given to NCCL, e.g. storage NICs: "mlx5_4,mlx5_5"
    ib_gid_index: int | None = None  # default: 3 (RoCEv2) when every selected HCA is RoCE, else unset
    topo_file: str | None = None  # NCCL_TOPO_FILE (an environment variable: torch has no argument)
    debug: str | None = None  # NCCL_DEBUG, e.g. INFO for tools/nccl_log.py
    debug_subsys: str | None = None  # NCCL_DEBUG_SUBSYS, e.g. INIT,NET


class ContainerRuntime(str, Enum):
    none = "none"
    pyxis = "pyxis"  # NVIDIA pyxis/enroot: srun --container-image=...
    apptainer = "apptainer"  # srun apptainer exec IMAGE python ...


@dataclass
class ContainerConfig:
    """The image the job's tasks run in (docs/containers.md). The one srun step holds every process of the job but
    the supervisor: agents, workers, spares and the pre-flight all start inside it, so they share this setting."""

    runtime: ContainerRuntime = ContainerRuntime.none
    # pyxis: an enroot image reference (nvcr.io#nvidia/pytorch:24.05-py3) or an absolute .sqsh path;
    # apptainer: an absolute .sif path (or a docker://, oras://, library:// URI)
    image: str | None = None
    # host:container[:flags] bind mounts; the run directory is mounted at its own path without being listed
    mounts: list[str] = field(default_factory=list)
    workdir: str | None = None  # working directory inside the container (default: the runtime's)
    # Names of host variables whose values override the image's (pyxis --container-env, APPTAINERENV_NAME)
    env: list[str] = field(default_factory=list)
    python: str = "python"  # the interpreter inside the image, with hpctrain and submitit importable
    args: list[str] = field(default_factory=list)  # more runtime options: srun's for pyxis, apptainer exec's


@dataclass
class ClusterConfig:
    name: str = MISSING
    executor: Executor = Executor.local
    nodes: int = 1
    spare_nodes: int = 0  # hot spares the job also asks for: one takes a dead node's place (launcher.in_allocation)
    gpus_per_node: int = 2  # tasks per node; on CPU these are processes
    gpu_type: str = "cpu"
    # The plan's figures for gpu_type come from the vendors' datasheets (hpctrain/hardware.py); a cluster whose
    # GPUs run capped or whose links measure otherwise says so here (0: the datasheet's). The dense BF16 peak in
    # TFLOP/s per GPU (the FP8 peak scales with it: a clock or power cap slows both) is also what MFU is
    # reported against; the bandwidths are GB/s per GPU in each direction, inside the NVLink domain and across.
    gpu_peak_tflops: float = 0.0
    intra_node_gb_s: float = 0.0
    inter_node_gb_s: float = 0.0
    cpus_per_task: int = 1
    mem_gb: int = 0  # 0: scheduler default
    time_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    exclude: str | None = None
    signal_delay_s: int = 120  # USR2 this long before the time limit
    failure_rate_per_gpu_day: float = 0.001  # for automatic checkpoint intervals (0.1%-1% at scale)
    requeue: bool = True
    max_num_timeout: int = 20  # requeues after preemption/time limit
    sbatch_extra: dict[str, Any] = field(default_factory=dict)  # more #SBATCH key: value lines
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load, venv)
    srun_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every task
    nccl: NcclConfig = field(default_factory=NcclConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)


# hpctrain's hang limits must end this much before the collective timeout: a poll, the dumps, the record.
TIMEOUT_MARGIN_S = 120.0


@dataclass
class LauncherConfig:
    # One elastic agent per node restarts every worker in the allocation when one fails (a rank raises or
    # dies, a collective times out, the hang watchdog fires): seconds instead of a trip through the queue.
    # false: one task per rank, and a failed job leaves the allocation (the supervisor resubmits it).
    in_allocation: bool = True
    # Restarts inside the allocation, and resubmissions of a failed job (excluding the failed node(s)):
    # each bounded by this. Requeues after preemption or the time limit do not count (cluster.max_num_timeout).
    max_restarts: int = 3
    # How long the agents wait for each other in a rendezvous (all nodes must come back after a restart).
    rendezvous_timeout_s: int = 600
    # A collective that waits longer raises (NCCL's own watchdog). Longer than health.hang_timeout_s and
    # health.startup_timeout_s, so that hpctrain's watchdog fires first and leaves stacks and a record.
    collective_timeout_s: int = 1800


@dataclass
class ElasticConfig:
    # A node lost inside the allocation (launcher.in_allocation) with no spare: go on with at least this many
    # nodes, DP smaller and gradient accumulation larger so the global batch and the sample order stay the
    # same. 0: never shrink (the job is requeued by Slurm, NODE_FAIL, and runs on all cluster.nodes again).
    min_nodes: int = 0


@dataclass
class RecoveryConfig:
    # How a failure is survived (docs/replicas.md). restart: every rank of the job restarts (in the allocation,
    # launcher.in_allocation) and resumes from the newest checkpoint. replicas: the job's nodes form
    # `groups` replica groups, each a whole copy of the layout (FSDP/TP/PP inside); a step's gradients are
    # averaged across the groups by torchft, a quorum per step: a group that fails is left out of the next
    # steps while the others go on, and rejoins, healed from a live peer over the network. diloco: the same
    # groups, synchronised every `sync_every` steps (DiLoCo's outer step) instead of every step: for slow links.
    mode: str = "restart"  # restart | replicas | diloco
    groups: int = 2  # replica groups (replicas, diloco): cluster.nodes is divided among them
    min_replicas: int = 1  # a step commits only with at least this many groups in its quorum
    heartbeat_timeout_ms: int = 1000  # the lighthouse drops a group whose manager stopped beating this long
    join_timeout_ms: int = 1000  # a quorum waits this long for groups of the last quorum that are not in yet
    quorum_timeout_s: float = 120.0  # one step's quorum (and a heal) waits this long, then the step fails
    sync_every: int = 20  # diloco: inner steps between two outer synchronisations
    outer_lr: float = 0.7  # diloco: the outer optimizer's (Nesterov SGD) learning rate
    outer_momentum: float = 0.9  # diloco: its momentum


RECOVERY_MODES = ("restart", "replicas", "diloco")


@dataclass
class HealthConfig:
    preflight: str = "warn"  # off | warn | exclude (resubmit without bad nodes) | drain (also drain them)
    allreduce_mb: int = 16  # size of the pre-flight all-reduce bandwidth test
    outlier_threshold: float = 3.5  # robust z-score (median/MAD) above which a node or rank is an outlier
    min_slowdown: float = 0.2  # ... and at least this much slower than the median (relative)
    hang_timeout_s: float = 600.0  # no step completed for this long: dump stacks and exit (0 disables)
    hang_factor: float = 20.0  # or this many times the median recent step time, if longer
    startup_timeout_s: float = 1200.0  # before the first step (imports, checkpoint load, compilation)
    straggler_every: int = 100  # steps between straggler probes (0 disables)
    straggler_factor: float = 1.3  # a straggler is at least this much slower than the median rank
    straggler_patience: int = 3  # ... in this many probes in a row
    memory_window: int = 200  # steps over which memory growth is fitted (0 disables)
    leak_mb: float = 256.0  # growth per window reported as a leak


@dataclass
class TrackingConfig:
    mode: TrackingMode = TrackingMode.disabled
    project: str = "hpctrain"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    max_steps: int = 100
    seed: int = 1234
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 8  # sequences per forward/backward on one DP rank
    grad_accum: int = -1  # -1: inferred as global_batch / (micro_batch * dp)
    seq_len: int = 128
    log_every: int = 1
    eval_every: int = 0  # steps between validation losses (0: none); also at the last step
    eval_batches: int = 4  # global batches of validation samples, the same ones every time
    threads_per_rank: int = 1  # torch intra-op threads per task (CPU)


@dataclass
class RunConfig:
    name: str = "default"  # run directories go to <root>/<name>/<id>
    root: str = "outputs"
    id: str | None = None  # set by the launcher; a fixed id makes a rerun land in the same directory
    resume: str | None = None  # a run id or a run directory to continue
    lease_check_s: float = 1.0  # rank 0 re-reads the run's lease this often, off the step's path (docs/recovery.md)


@dataclass
class PlanConfig:
    format: PlanFormat = PlanFormat.text
    search: int = 0  # >0: the dry-run plan ranks the top N layouts and explains where the configured one stands
    png: str | None = None  # also write the memory / step-time chart here (needs matplotlib)
    simulate_rank: int | None = None  # dry_run=simulate builds this rank (default: the planner's most loaded)
    simulate_device: SimulateDevice = SimulateDevice.auto  # fake CUDA where g++ can build it (auto), or cpu


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    dry_run: Any = False  # true: print the plan; simulate: also build one rank on fake tensors (DRY_RUNS)


SIMULATE = "simulate"
DRY_RUNS = (False, True, SIMULATE)


def simulating(cfg: Config) -> bool:
    """dry_run=simulate: the plan, and one rank of the job built and stepped on fake tensors (hpctrain.simulate)."""
    return bool(cfg.dry_run == SIMULATE)


def as_config(node: DictConfig | ListConfig) -> Config:
    """A config node made from this schema (Hydra's composition, `OmegaConf.structured(Config)`, a merge onto it)
    as the schema's type: it reads like the dataclass, which is how the code types a config (Hydra's structured
    configs). Said to the type checker here, in one place; a node that is no mapping at all is a TypeError."""
    if not isinstance(node, DictConfig):
        raise TypeError(f"a config is a mapping of sections, not {type(node).__name__}")
    return cast(Config, node)


def as_node(cfg: Config) -> DictConfig:
    """The OmegaConf node a config is at run time, for OmegaConf's own functions (`open_dict`, `OmegaConf.update`,
    `in`); the reverse of `as_config`. A plain Config dataclass has no such node: TypeError."""
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"a composed config (an OmegaConf DictConfig) is needed here, not {type(cfg).__name__}")
    return cfg


def to_plain(cfg: Config) -> dict[str, Any]:
    """The config as plain data, interpolations resolved: what a task rebuilds its config from, what W&B records."""
    plain = OmegaConf.to_container(as_node(cfg), resolve=True)
    assert isinstance(plain, dict)  # a DictConfig's container
    return cast(dict[str, Any], plain)


def register() -> None:
    """Register the schema so conf/config.yaml can put it first in its defaults list."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="hpctrain_schema", node=Config)
