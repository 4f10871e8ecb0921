"""The parallel layout of a run, and resolving it (with the batch arithmetic) from a config.

One small frozen object owns the degrees, the schedule, sequence parallelism, recomputation, micro-batch and
accumulation, so the checks, the plan, the launcher and every task read the same numbers, validated once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, cast

from hpctrain import schedules
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.rules import (
    Finding,
    Workload,
    context_rules,
    expert_rules,
    fp8_rules,
    key_of,
    layer_split,
    microbatch_rules,
    moe_context_rule,
    schedule_rules,
    simulation_rules,
    stage_rules,
    tensor_rules,
    zero_rules,
)
from hpctrain.config.schema import Config, RecoveryConfig

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
OFFLOAD_DEVICES = ("cpu", "nvme")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype name ("bf16", "fp16", "fp32")."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return 4 if dtype == "fp32" else 2


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over dp x tp x pp x cp GPUs: the one layout object of a run.

    Resolved once on the login node from the config (`resolve_layout`), validated here, shipped with the task;
    the planner builds and compares thousands of them (no torch import), `ParallelDims` only builds the mesh.
    Megatron conventions: the number of pipeline microbatches per step is `grad_accum`, so
    global_batch = micro_batch x grad_accum x dp. Rank order is TP innermost, then CP, then DP, then PP (torchtitan's).
    ZeRO shards over dp / dp_replicate x cp ranks (dp_replicate > 1 is HSDP; CP ranks read the same samples, so
    they share the parameter sharding with DP, as in torchtitan). `reduce_dtype` is the dtype gradients are reduced in
    (None: `dtype`).
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
    offload_device: str = "cpu"  # zero.offload_optimizer_device: "cpu" or "nvme" (the optimizer's moments)
    accumulate_unsharded: bool = False  # zero.accumulate_unsharded: ZeRO-2/3 reduce-scatter once a step
    schedule: str = "1f1b"
    dtype: str = "bf16"
    dp_replicate: int = 1
    reduce_dtype: str | None = None
    gpus_per_node: int = 1  # what the job asks for per node (TP must fit in it)
    fp8: str = "none"  # precision.fp8: the torchao recipe of the blocks' Linears (the planner times them at FP8 peak)
    ep: int = 1  # expert parallelism: MoE experts split over ep ranks of each FSDP shard group (dp_shard)
    first_stage_layers: int = 0  # parallel.first_stage_layers: layers of the first stage (0: as the others)
    last_stage_layers: int = 0  # parallel.last_stage_layers: layers of the last stage (0: as the others)
    cp: int = 1  # parallel.cp: context parallelism, each sequence split over cp ranks
    # recovery.groups under recovery=replicas|diloco: copies of this layout (each its own world) whose gradients
    # torchft averages; every other field, nodes and global_batch included, describes one group
    replicas: int = 1

    def __post_init__(self) -> None:
        problems = layout_problems(self)
        if problems:
            raise ValueError("; ".join(f"{key}: {message}" for key, message, _ in problems))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp_keeps_shards(self) -> bool:
        """Sequence parallelism saves the attention's and the MLP's gathered input as this rank's slice and gathers
        it again in backward (hpctrain.parallel.sequence_parallel), where nothing else decides what a block saves:
        no recomputation, no FP8 (the engine also keeps DTensor's path under torch.compile); and, for now, no
        pipeline: `dry_run=simulate` of a PP 2 layout measured more activations on the slices' path than on
        DTensor's (GPT 1.3B, TP 4, 1F1B: 2.87 GiB against 2.07), not yet understood (docs/recompute.md)."""
        return (
            self.sequence_parallel and self.tp > 1 and self.pp == 1 and self.recompute == "none" and self.fp8 == "none"
        )

    @property
    def n_stages(self) -> int:
        """Pipeline stages (model chunks): pp x virtual_stages."""
        return self.pp * self.virtual_stages

    def layer_split(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each stage, first to last (config.rules.stage_rules holds that the split exists)."""
        split = layer_split(n_layers, self.n_stages, self.first_stage_layers, self.last_stage_layers)
        if split is None:
            raise ValueError(
                f"{n_layers} layers cannot be split into {self.n_stages} stages with first_stage_layers="
                f"{self.first_stage_layers}, last_stage_layers={self.last_stage_layers}"
            )
        return split

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The stages (model chunks) pipeline rank `pp_rank` holds, as its schedule places them."""
        if self.pp == 1:
            return tuple(range(self.n_stages))
        return tuple(schedules.get(self.schedule).stage_ids(pp_rank, self.pp, self.virtual_stages))

    def layers_on(self, n_layers: int, pp_rank: int) -> int:
        """Layers pipeline rank `pp_rank` holds, over its stages."""
        split = self.layer_split(n_layers)
        return sum(split[s] for s in self.stages_of(pp_rank))

    n_gpus = world_size

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    @property
    def job_nodes(self) -> int:
        """Nodes that train, every replica group's (spares not counted)."""
        return self.nodes * self.replicas

    @property
    def job_global_batch(self) -> int:
        """Sequences per optimizer step over every replica group: train.global_batch."""
        return self.global_batch * self.replicas

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per step (Megatron: one per gradient-accumulation step)."""
        return self.grad_accum

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def dp_shard(self) -> int:
        """Ranks ZeRO/FSDP shards over: the whole DP group, or one HSDP shard group."""
        return self.dp // self.dp_replicate

    @property
    def zero_shard(self) -> int:
        """Ranks ZeRO/FSDP shards a (dense) parameter over: a shard group's DP ranks and their CP peers."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ranks FSDP shards an expert's weights over: what an EP group leaves of the shard group
        (torchtitan's dp_shard_mod_ep); dense weights are sharded over all dp_shard ranks."""
        return self.dp_shard // self.ep

    @property
    def compute_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def reduce_bytes(self) -> int:
        return dtype_bytes(self.reduce_dtype or self.dtype)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            world_size=self.world_size,
            nodes=self.nodes,
            dp_shard=self.dp_shard,
            microbatches=self.microbatches,
            global_batch=self.global_batch,
        )
        return d


def lighter_ends(n_layers: int, pp: int) -> int | None:
    """The layers of the first and of the last stage when each holds one fewer than the stages between them (they
    also hold the embedding and the output head: Llama 3 405B's 126 layers on 16 stages as 7 + 14 x 8 + 7); None
    where no such split exists or the layers divide evenly."""
    if pp < 3 or n_layers % pp == 0 or (n_layers - pp + 2) % pp:
        return None
    ends = (n_layers - pp + 2) // pp
    return ends if ends >= 1 else None


def data_parallel_kind(layout: Layout) -> str:
    """The wrapper hpctrain's engine uses: "none", "ddp", "fsdp" or "replicate" (engine.py, data_parallel.uses_fsdp:
    DDP holds no DTensor parameter, TP's or EP's). CP ranks average their gradients as DP ranks do."""
    if layout.dp * layout.cp == 1:
        return "none"
    if layout.zero_stage >= 1:
        return "fsdp"
    return "replicate" if layout.tp > 1 or layout.pp > 1 or layout.ep > 1 else "ddp"


def fills_buffer(layout: Layout) -> bool:
    """The engine adds each gradient into FSDP2's reduce-dtype accumulator as backward makes it, Megatron's main_grad
    (hpctrain/parallel/grad_buffer.py; the planner counts it, hpctrain.plan.states): where FSDP2 accumulates
    unsharded (ZeRO-1, or zero.accumulate_unsharded) over several micro-batches, in a wider dtype than it
    computes in, without PP (whose schedules drive FSDP2's accumulation themselves)."""
    return (
        data_parallel_kind(layout) == "fsdp"
        and layout.pp == 1
        and layout.microbatches > 1
        and (layout.zero_stage == 1 or layout.accumulate_unsharded)
        and layout.reduce_bytes > layout.compute_bytes
    )


def layout_problems(lay: Any) -> list[Finding]:
    """(config key, what is wrong, the fix) for every rule a layout breaks on its own, without a model (those
    against the model, the cluster and the sequence: hpctrain.config.rules, all of them `layout_rules`)."""
    out: list[Finding] = []
    for name in (
        "dp",
        "tp",
        "pp",
        "virtual_stages",
        "micro_batch",
        "grad_accum",
        "dp_replicate",
        "gpus_per_node",
        "ep",
        "cp",
    ):
        if getattr(lay, name, 1) < 1:
            out.append((key_of(name), f"must be >= 1, got {getattr(lay, name)}", "set it to a positive integer"))
    for name in ("first_stage_layers", "last_stage_layers"):
        if getattr(lay, name, 0) < 0:
            out.append(
                (
                    key_of(name),
                    f"must be >= 0 (0: as the other stages), got {getattr(lay, name)}",
                    "set it to the stage's number of layers, or 0",
                )
            )
    if out:
        return out
    if lay.zero_stage not in (0, 1, 2, 3):
        out.append(
            (
                key_of("zero_stage"),
                f"must be 0, 1, 2 or 3, got {lay.zero_stage}",
                "pick zero=stage0|stage1|stage2|stage3 (or their _offload variants)",
            )
        )
    if lay.recompute not in RECOMPUTE:
        out.append(
            (key_of("recompute"), f"must be one of {RECOMPUTE}, got {lay.recompute!r}", "set parallel.recompute=none")
        )
    for name in ("dtype", "reduce_dtype"):
        value = getattr(lay, name)
        if value is not None and value not in DTYPES:
            out.append((key_of(name), f"unknown dtype {value!r}; expected one of {DTYPES}", "use bf16, fp16 or fp32"))
    if lay.schedule not in schedules.SCHEDULES and lay.schedule not in schedules.ALIASES:
        out.append(
            (key_of("schedule"), f"unknown schedule {lay.schedule!r}", f"use one of {', '.join(schedules.RUNNABLE)}")
        )
    else:
        chunk = schedules.get(lay.schedule).chunk_problem(lay.pp, lay.virtual_stages)
        if chunk:
            out.append((key_of(chunk[0]), chunk[1], chunk[2]))
    if lay.dp % lay.dp_replicate:
        out.append(
            (
                key_of("dp_replicate"),
                f"dp={lay.dp} is not divisible by dp_replicate={lay.dp_replicate}",
                f"use a dp_replicate that divides {lay.dp}",
            )
        )
    elif (lay.dp // lay.dp_replicate) % lay.ep:
        shard = lay.dp // lay.dp_replicate
        out.append(
            (
                key_of("ep"),
                f"ep={lay.ep} does not divide the {shard} data-parallel ranks a ZeRO/FSDP shard group has "
                f"(dp / dp_replicate = {lay.dp} / {lay.dp_replicate}): an EP group is made of DP ranks that "
                "exchange tokens",
                f"use an ep that divides {shard}"
                + (", or a smaller parallel.dp_replicate" if lay.dp_replicate > 1 else ""),
            )
        )
    if lay.offload_params and lay.zero_stage != 3:
        out.append(
            (
                key_of("offload_params"),
                f"parameter offload needs ZeRO stage 3 (parameters sharded), got stage {lay.zero_stage}",
                "set zero.stage=3, or zero=stage3_offload",
            )
        )
    if lay.offload_device not in OFFLOAD_DEVICES:
        out.append(
            (
                key_of("offload_device"),
                f"must be one of {OFFLOAD_DEVICES}, got {lay.offload_device!r}",
                "set zero.offload_optimizer_device=cpu (host memory) or nvme (with zero.nvme_path)",
            )
        )
    elif lay.offload_device == "nvme" and not lay.offload_optimizer:
        out.append(
            (
                key_of("offload_device"),
                "NVMe holds offloaded optimizer state, but zero.offload_optimizer=false",
                "set zero.offload_optimizer=true (or zero=stage3_nvme)",
            )
        )
    out += moe_context_rule(getattr(lay, "cp", 1), lay.ep, moe=lay.ep > 1)  # experts to split: an MoE model
    if lay.sequence_parallel and lay.tp == 1:
        out.append(
            (
                key_of("sequence_parallel"),
                "sequence parallelism shards along the TP group, but tp=1",
                "set parallel.tp>1 or parallel.sequence_parallel=false",
            )
        )
    return out


def layout_rules(lay: Layout, w: Workload) -> list[Finding]:
    """Every rule of hpctrain.config.rules that `lay` breaks for `w` (errors; a Layout has passed its own,
    layout_problems, when built): what the layout search holds each layout it returns to, and the checks report."""
    return [
        *expert_rules(lay.ep, w),
        *tensor_rules(lay.tp, w),
        *stage_rules(lay.pp, lay.virtual_stages, lay.first_stage_layers, lay.last_stage_layers, w),
        *context_rules(lay.cp, lay.ep, w),
        *schedule_rules(lay.schedule, lay.pp, lay.dp, lay.zero_stage),
        *microbatch_rules(lay.schedule, lay.pp, lay.virtual_stages, lay.microbatches),
        *zero_rules(lay.zero_stage, lay.dp_replicate, lay.offload_optimizer),
        *fp8_rules(lay.tp, lay.fp8, w),
        *simulation_rules(data_parallel_kind(lay), w),
    ]


def replica_groups(recovery: RecoveryConfig) -> int:
    """How many copies of the layout train side by side (recovery=replicas|diloco), else 1."""
    return int(recovery.groups) if recovery.mode in ("replicas", "diloco") else 1


def group_config(cfg: Config) -> Config:
    """The config one replica group trains: its share of cluster.nodes, train.global_batch and parallel.dp (the
    job's DP degree counts the groups, as HSDP's counts its replicas; the config itself without replica groups).
    ConfigError when they do not divide."""
    groups = replica_groups(cfg.recovery)
    if groups == 1:
        return cfg
    dp = cfg.parallel.dp  # the job's data-parallel degree, the groups' included (-1: inferred per group)
    problems = [
        Problem(key, f"{value} is not divisible by recovery.groups={groups}", f"use a multiple of {groups}")
        for key, value in (
            ("cluster.nodes", cfg.cluster.nodes),
            ("train.global_batch", cfg.train.global_batch),
            ("parallel.dp", dp if dp > 0 else groups),
        )
        if value % groups
    ]
    if problems:
        raise ConfigError(problems)
    group = copy.deepcopy(cfg)
    group.cluster.nodes = cfg.cluster.nodes // groups
    group.train.global_batch = cfg.train.global_batch // groups
    if dp > 0:
        group.parallel.dp = dp // groups
    return group


def resolve_layout(cfg: Config) -> Layout:
    """Infer dp and grad_accum where they are -1; raise ConfigError when the numbers cannot fit together. With
    replica groups, the layout of one group (its `replicas` field counts them)."""
    groups = replica_groups(cfg.recovery)
    cfg = group_config(cfg)
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    _require_positive(cfg)
    dp = _infer_dp(c.nodes, c.gpus_per_node, p.dp, p.tp, p.pp, p.cp, lambda dp: _job_size_for(cfg, dp))
    grad_accum = _infer_grad_accum(cfg, dp)
    values: dict[str, Any] = dict(
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        virtual_stages=p.virtual_stages,
        zero_stage=cfg.zero.stage,
        micro_batch=t.micro_batch,
        grad_accum=grad_accum,
        # Megatron's rule: with tp=1 there is no TP group to shard along, so SP is off (the checks say so)
        sequence_parallel=bool(p.sequence_parallel) and p.tp > 1,
        recompute=_value(p.recompute),
        offload_optimizer=bool(cfg.zero.offload_optimizer),
        offload_params=bool(cfg.zero.offload_params),
        offload_device=str(cfg.zero.offload_optimizer_device),
        accumulate_unsharded=bool(cfg.zero.accumulate_unsharded),
        schedule=p.schedule,
        dtype=_value(cfg.precision.dtype),
        dp_replicate=p.dp_replicate,
        reduce_dtype=_value(cfg.precision.reduce_dtype),
        gpus_per_node=c.gpus_per_node,
        fp8=str(cfg.precision.fp8),
        ep=p.ep,
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
        cp=p.cp,
        replicas=groups,
    )
    broken = layout_problems(SimpleNamespace(**values))  # the layout's own rules, reported with the config's keys
    if broken:
        raise ConfigError([Problem(key, message, fix) for key, message, fix in broken])
    return Layout(**values)


def layout_on_nodes(cfg: Config, nodes: int) -> Layout:
    """The layout of the same run on `nodes` nodes: DP from the world size, gradient accumulation from the
    (unchanged) global batch. What an elastic job runs on after losing nodes (elastic.min_nodes)."""
    layout = next(layouts_on_nodes(cfg, [nodes]))[1]
    if isinstance(layout, ConfigError):
        raise layout
    return layout


def layouts_on_nodes(cfg: Config, counts: Iterable[int]) -> Iterator[tuple[int, Layout | ConfigError]]:
    """`layout_on_nodes` for each node count, lazily, the config copied once (a merge costs 25 resolves: the
    check of every count a run may shrink to walks thousands on a large job)."""
    from omegaconf import OmegaConf

    smaller = cast(Config, OmegaConf.merge(cfg, {"parallel": {"dp": -1}, "train": {"grad_accum": -1}}))
    for nodes in counts:
        smaller.cluster.nodes = nodes
        try:
            yield nodes, resolve_layout(smaller)
        except ConfigError as err:
            yield nodes, err


def _require_positive(cfg: Config) -> None:
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    positive = {
        "cluster.nodes": c.nodes,
        "cluster.gpus_per_node": c.gpus_per_node,
        **{key_of(f): getattr(p, f) for f in ("tp", "pp", "ep", "cp", "dp_replicate", "virtual_stages")},
        "train.micro_batch": t.micro_batch,
        "train.global_batch": t.global_batch,
    }
    problems = [
        Problem(key, f"must be >= 1, got {value}", f"set {key} to a positive integer")
        for key, value in positive.items()
        if value < 1
    ]
    if problems:
        raise ConfigError(problems)


def _job_size_for(cfg: Config, dp: int) -> str:
    """The job size (and batch) that fits dp x tp x pp x cp, as overrides: whole nodes of cluster.gpus_per_node if it
    divides, else nodes of fewer GPUs that TP still fits in (one node on the local executor)."""
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    need = dp * p.tp * p.pp * p.cp
    if need % c.gpus_per_node == 0 and (need // c.gpus_per_node == 1 or _value(c.executor) != "local"):
        size = f"cluster.nodes={need // c.gpus_per_node}"
    elif _value(c.executor) == "local":
        size = f"cluster.gpus_per_node={need}"
    else:
        per_node = (
            max(g for g in range(1, min(need, c.gpus_per_node) + 1) if need % g == 0 and g % p.tp == 0)
            if need % p.tp == 0
            else p.tp
        )
        size = f"cluster.nodes={-(-need // per_node)} cluster.gpus_per_node={per_node}"
    per_step = t.micro_batch * dp
    if t.grad_accum == -1 and p.microbatches <= 0 and per_step > 0 and t.global_batch % per_step:
        size += f" with train.global_batch={max(1, round(t.global_batch / per_step)) * per_step}"
    return size


def _infer_dp(nodes: int, gpus_per_node: int, dp: int, tp: int, pp: int, cp: int = 1, job_size: Any = None) -> int:
    """parallel.dp, or (-1) the world size over tp x pp x cp. `job_size(dp)`: the cluster overrides that fit a dp."""
    world, model_parallel = nodes * gpus_per_node, tp * pp * cp
    names, degrees = ("tp x pp x cp", f"{tp} x {pp} x {cp}") if cp > 1 else ("tp x pp", f"{tp} x {pp}")
    if dp == -1:
        if world % model_parallel:
            raise ConfigError(
                [
                    Problem(
                        "parallel.dp",
                        f"world size {world} (cluster.nodes={nodes} x cluster.gpus_per_node={gpus_per_node}) "
                        f"is not divisible by {names} = {degrees} = {model_parallel}, so dp cannot be inferred",
                        f"choose {'tp, pp and cp' if cp > 1 else 'tp and pp'} whose product divides {world}, or change "
                        "cluster.nodes",
                    )
                ]
            )
        return world // model_parallel
    if dp < 1:
        raise ConfigError(
            [
                Problem(
                    "parallel.dp",
                    f"must be >= 1 or -1 (infer), got {dp}",
                    "set parallel.dp=-1 to infer it from the world size",
                )
            ]
        )
    if dp * model_parallel != world:
        raise ConfigError(
            [
                Problem(
                    "parallel.dp",
                    f"dp x {names} = {dp} x {degrees} = {dp * model_parallel} GPUs, but the job has "
                    f"cluster.nodes x cluster.gpus_per_node = {nodes} x {gpus_per_node} = {world}",
                    f"set parallel.dp={world // model_parallel if world % model_parallel == 0 else -1} "
                    f"(or -1 to infer it), or "
                    + (job_size(dp) if job_size else f"cluster.nodes x cluster.gpus_per_node = {dp * model_parallel}"),
                )
            ]
        )
    return dp


def _infer_grad_accum(cfg: Config, dp: int) -> int:
    """train.grad_accum (or parallel.microbatches), or (-1) the global batch over micro-batch x dp."""
    p, t = cfg.parallel, cfg.train
    per_step = t.micro_batch * dp
    grad_accum = t.grad_accum
    if grad_accum == -1 and p.microbatches > 0:
        grad_accum = p.microbatches
    if grad_accum == -1:
        if t.global_batch % per_step:
            raise ConfigError(
                [
                    Problem(
                        "train.global_batch",
                        f"{t.global_batch} is not divisible by train.micro_batch x dp = {t.micro_batch} x {dp} = "
                        f"{per_step}, so gradient accumulation cannot be inferred",
                        f"use a multiple of {per_step} (e.g. {max(1, round(t.global_batch / per_step)) * per_step}) "
                        "or change train.micro_batch",
                    )
                ]
            )
        grad_accum = t.global_batch // per_step
    elif grad_accum < 1:
        raise ConfigError(
            [
                Problem(
                    "train.grad_accum",
                    f"must be >= 1 or -1 (infer), got {grad_accum}",
                    "set train.grad_accum=-1 to infer it from the global batch",
                )
            ]
        )
    elif per_step * grad_accum != t.global_batch:
        raise ConfigError(
            [
                Problem(
                    "train.global_batch",
                    f"global batch {t.global_batch} != micro_batch x grad_accum x dp = "
                    f"{t.micro_batch} x {grad_accum} x {dp} = {per_step * grad_accum}",
                    f"set train.global_batch={per_step * grad_accum}, or train.grad_accum=-1 to infer it",
                )
            ]
        )
    if p.microbatches > 0 and p.microbatches != grad_accum:
        raise ConfigError(
            [
                Problem(
                    "parallel.microbatches",
                    f"{p.microbatches} pipeline microbatches but train.grad_accum={grad_accum}: every accumulation "
                    "microbatch goes through the pipeline, so the two are the same number",
                    "set only one of them (parallel.microbatches=0 follows train.grad_accum)",
                )
            ]
        )
    return grad_accum


def _value(v: Any) -> str:
    """A config enum's string (OmegaConf gives enums from structured configs, plain strings from dicts)."""
    return v.value if hasattr(v, "value") else str(v)
