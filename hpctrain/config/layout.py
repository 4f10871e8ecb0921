"""Resolve the parallel layout and batch arithmetic from a config.

One small object owns the resolved degrees (inferred dp, gradient accumulation, pipeline microbatches), so
the plan, the checks and every task read the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import Config


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    dp_replicate: int
    virtual_stages: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    zero_stage: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp_shard(self) -> int:
        """Ranks a ZeRO/FSDP shard group spans (all of dp unless HSDP replicates across groups)."""
        return self.dp // self.dp_replicate

    @property
    def microbatches(self) -> int:
        """Microbatches per optimizer step on one DP rank; with PP they all go through the pipeline."""
        return self.grad_accum

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        d.update(world_size=self.world_size, dp_shard=self.dp_shard, microbatches=self.microbatches)
        return d


def resolve_layout(cfg: Config) -> Layout:
    """Infer dp and grad_accum where they are -1; raise ConfigError when the numbers cannot fit together."""
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    problems: list[Problem] = []
    positive = {
        "cluster.nodes": c.nodes,
        "cluster.gpus_per_node": c.gpus_per_node,
        "parallel.tp": p.tp,
        "parallel.pp": p.pp,
        "parallel.dp_replicate": p.dp_replicate,
        "parallel.virtual_stages": p.virtual_stages,
        "train.micro_batch": t.micro_batch,
        "train.global_batch": t.global_batch,
    }
    for key, value in positive.items():
        if value < 1:
            problems.append(Problem(key, f"must be >= 1, got {value}", f"set {key} to a positive integer"))
    if problems:
        raise ConfigError(problems)

    world = c.nodes * c.gpus_per_node
    model_parallel = p.tp * p.pp
    if p.dp == -1:
        if world % model_parallel:
            raise ConfigError([Problem(
                "parallel.dp",
                f"world size {world} (cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node}) "
                f"is not divisible by tp x pp = {p.tp} x {p.pp} = {model_parallel}, so dp cannot be inferred",
                f"choose tp and pp whose product divides {world}, or change cluster.nodes",
            )])
        dp = world // model_parallel
    elif p.dp < 1:
        raise ConfigError([Problem("parallel.dp", f"must be >= 1 or -1 (infer), got {p.dp}",
                                   "set parallel.dp=-1 to infer it from the world size")])
    else:
        dp = p.dp
        if dp * model_parallel != world:
            need_nodes = dp * model_parallel / c.gpus_per_node
            raise ConfigError([Problem(
                "parallel.dp",
                f"dp x tp x pp = {dp} x {p.tp} x {p.pp} = {dp * model_parallel} GPUs, but the job has "
                f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} = {world}",
                f"set parallel.dp={world // model_parallel if world % model_parallel == 0 else -1} "
                f"(or -1 to infer it), or cluster.nodes={need_nodes:g}",
            )])

    per_step = t.micro_batch * dp
    grad_accum = t.grad_accum
    if grad_accum == -1 and p.microbatches > 0:
        grad_accum = p.microbatches
    if grad_accum == -1:
        if t.global_batch % per_step:
            raise ConfigError([Problem(
                "train.global_batch",
                f"{t.global_batch} is not divisible by train.micro_batch x dp = {t.micro_batch} x {dp} = {per_step}, "
                "so gradient accumulation cannot be inferred",
                f"use a multiple of {per_step} (e.g. {max(1, round(t.global_batch / per_step)) * per_step}) "
                "or change train.micro_batch",
            )])
        grad_accum = t.global_batch // per_step
    elif grad_accum < 1:
        raise ConfigError([Problem("train.grad_accum", f"must be >= 1 or -1 (infer), got {grad_accum}",
                                   "set train.grad_accum=-1 to infer it from the global batch")])
    elif per_step * grad_accum != t.global_batch:
        raise ConfigError([Problem(
            "train.global_batch",
            f"global batch {t.global_batch} != micro_batch x grad_accum x dp = "
            f"{t.micro_batch} x {grad_accum} x {dp} = {per_step * grad_accum}",
            f"set train.global_batch={per_step * grad_accum}, or train.grad_accum=-1 to infer it",
        )])
    if p.microbatches > 0 and p.microbatches != grad_accum:
        raise ConfigError([Problem(
            "parallel.microbatches",
            f"{p.microbatches} pipeline microbatches but train.grad_accum={grad_accum}: every accumulation "
            "microbatch goes through the pipeline, so the two are the same number",
            "set only one of them (parallel.microbatches=0 follows train.grad_accum)",
        )])
    return Layout(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        dp_replicate=p.dp_replicate,
        virtual_stages=p.virtual_stages,
        micro_batch=t.micro_batch,
        grad_accum=grad_accum,
        global_batch=t.global_batch,
        zero_stage=cfg.zero.stage,
    )
