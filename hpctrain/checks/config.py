"""Checks that run on the login node before anything is queued: the config's own rules.

Each check names the key at fault and the fix. Errors stop the run before a run directory exists or a job
is submitted; warnings are printed in the plan. The schema already rejected unknown keys and wrong types.
The checks that need the planner's estimates (memory per GPU, the pipeline bubble, offload) are
hpctrain.checks.plan; hpctrain.checks.runner runs them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from hpctrain.checks.cluster import cluster_checks
from hpctrain.checks.files import walk_values
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout, data_parallel_kind
from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.rules import (
    Workload,
    context_rules,
    expert_rules,
    fp8_rules,
    microbatch_rules,
    schedule_rules,
    simulation_rules,
    stage_rules,
    tensor_rules,
    zero_idle_rules,
    zero_rules,
)
from hpctrain.config.schema import (
    DRY_RUNS,
    SCHEDULES,
    Config,
    DataConfig,
    DataKind,
    DType,
    MoEConfig,
    TrainConfig,
    as_node,
    parse_blend,
    simulating,
)
from hpctrain.hardware import KNOWN_HARDWARE, format_bytes
from hpctrain.models.family import Dims
from hpctrain.models.params import padded_vocab
from hpctrain.models.registry import FAMILIES, family_of


def check_schema(cfg: Config) -> None:
    """Keys added with Hydra's `+key=value` bypass the schema during composition: catch them here. And
    model.arch names a registered family (a string in the schema, so that a family registered at run time,
    a site's or a test's, needs no change to it)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(as_node(cfg)))
    except ConfigKeyError as err:
        key = str(err.full_key)
        raise ConfigError([Problem(key, "is not a key of hpctrain's config schema", _suggest(key))]) from None
    arch = merged.model.arch
    if arch not in FAMILIES:
        close = difflib.get_close_matches(arch, list(FAMILIES), n=1)
        raise ConfigError(
            [
                Problem(
                    "model.arch",
                    f"{arch!r} is not a model family",
                    (f"did you mean model.arch={close[0]}? " if close else "")
                    + f"The families: {', '.join(FAMILIES)} (hpctrain.models.registry)",
                )
            ]
        )


def _suggest(key: str) -> str:
    """The same name in another group (train.lr -> optim.lr), else the closest name in this group."""
    schema = OmegaConf.structured(Config)
    parent, _, name = key.rpartition(".")
    elsewhere = [f"{group}.{name}" for group in schema if OmegaConf.is_dict(schema[group]) and name in schema[group]]
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    node = OmegaConf.select(schema, parent) if parent else schema
    known = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"did you mean {parent + '.' if parent else ''}{close[0]}?"
    return f"remove it; the keys of {parent or 'the config'} are: {', '.join(known)}"


# What the layout search reads besides the model (parallel=auto): in their domains before it searches
SEARCH_INPUTS = ("train.global_batch", "train.seq_len", "cluster.nodes", "cluster.gpus_per_node")


def model_shape_checks(cfg: Config, r: CheckReport) -> None:
    """The model's own rules, which need no layout, and the domains of the numbers the layout search reads
    (parallel=auto runs them before its search: a global batch of 2**62 is not searched)."""
    m = cfg.model
    domain_checks(cfg, r, ("model.", *SEARCH_INPUTS))  # in their domains (DOMAINS), before the rules that combine them
    if m.n_heads >= 1 and not m.head_dim and m.d_model % m.n_heads:
        r.error(
            "model.d_model",
            f"d_model {m.d_model} is not divisible by n_heads {m.n_heads}",
            f"use a d_model that is a multiple of {m.n_heads} (e.g. {m.n_heads * max(1, m.d_model // m.n_heads)})",
        )
    rope = m.rope
    if rope.scaling_factor > 0 and not rope.high_freq_factor > rope.low_freq_factor:
        r.error(
            "model.rope.high_freq_factor",
            f"{rope.high_freq_factor:g} must be > model.rope.low_freq_factor="
            f"{rope.low_freq_factor:g} with Llama 3's frequency scaling (scaling_factor={rope.scaling_factor:g}): "
            "the wavelengths between original_context / high and original_context / low are interpolated over "
            "high - low",
            "use Llama 3's model.rope.low_freq_factor=1 model.rope.high_freq_factor=4",
        )
    for key, what, fix in family_of(m).shape_problems(m):  # the family's own rules
        r.error(key, what, fix)
    if m.init_from and not os.path.exists(m.init_from):
        (r.warn if cfg.dry_run else r.error)(
            "model.init_from",
            f"{m.init_from} does not exist on this machine",
            "give a Hugging Face model directory readable from every node",
        )


def workload(cfg: Config, lay: Layout) -> Workload:
    """What the layout rules (hpctrain.config.rules) read of the run: the model's Dims and family, the sequence,
    the job's GPUs per node, torch.compile. The layout search builds the same from its ModelShape."""
    m = cfg.model
    return Workload.of(
        Dims.of(m), family_of(m), cfg.train.seq_len, lay.gpus_per_node, m.dropout, cfg.parallel.compile, simulating(cfg)
    )


def _experts(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """model.moe.* belongs to the Mixture-of-Experts families (their own rules, top_k within the experts and so on,
    are the family's shape_problems; the layout's, experts over parallel.ep and no context parallelism, are
    config.rules'); an MoE model's routing gives data-dependent shapes, which torch.compile is not set up for here."""
    m = cfg.model
    family = family_of(m)
    if not family.moe:
        moe_families = ", ".join(f.name for f in FAMILIES.values() if f.moe)
        for f in dataclasses.fields(MoEConfig):
            value = getattr(m.moe, f.name)
            if value != f.default:
                r.error(
                    f"model.moe.{f.name}",
                    f"set to {value!r}, but model.arch={family.name} is a dense model: "
                    "model.moe configures a Mixture-of-Experts feed-forward, which its blocks do not have",
                    f"remove model.moe.{f.name}, or use an MoE family (model.arch={moe_families}; e.g. "
                    "model=mixtral_8x7b, model=qwen3_30b_a3b)",
                )
        return
    if cfg.parallel.compile:
        r.error(
            "parallel.compile",
            f"model.arch={family.name} routes tokens to experts: the rows each expert "
            "gets (and, with expert parallelism, the all-to-all's split sizes) change every step, "
            "data-dependent shapes that hpctrain's torch.compile setup does not support yet",
            "set parallel.compile=false",
        )


def _model_shape(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """model_shape_checks as one of CHECKS."""
    model_shape_checks(cfg, r)


def _tensor_parallel(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The layout against the model's shape: experts over EP, heads and MLP over TP, layers over stages
    (config.rules, which the layout search obeys too)."""
    if cfg.parallel.sequence_parallel and lay.tp == 1:
        r.warn(
            "parallel.sequence_parallel",
            "ignored with tp=1: sequence parallelism shards along the TP group",
            "set parallel.sequence_parallel=false, or parallel.tp>1 to use it",
        )
    w = workload(cfg, lay)
    for key, message, fix in (
        *expert_rules(lay.ep, w),
        *tensor_rules(lay.tp, w),
        *stage_rules(lay.pp, lay.virtual_stages, lay.first_stage_layers, lay.last_stage_layers, w),
    ):
        r.error(key, message, fix)


def _context_parallel(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The CP degree against the sequence, the model and torch.compile (config.rules.context_rules, which the
    layout search obeys too)."""
    for key, message, fix in context_rules(lay.cp, lay.ep, workload(cfg, lay)):
        r.error(key, message, fix)


def _pipeline(cfg: Config, lay: Layout, r: CheckReport) -> None:
    p = cfg.parallel
    if p.schedule not in SCHEDULES:
        r.error("parallel.schedule", f"unknown schedule {p.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        return
    for key, message, fix in schedule_rules(p.schedule, lay.pp, lay.dp, lay.zero_stage):
        r.error(key, message, fix)
    if r.errors:
        return
    for key, message, fix in microbatch_rules(p.schedule, lay.pp, lay.virtual_stages, lay.microbatches):
        r.error(key, message, fix)


def _zero(cfg: Config, lay: Layout, r: CheckReport) -> None:
    z = cfg.zero
    if z.offload_params and not z.offload_optimizer:
        r.error(
            "zero.offload_optimizer",
            "parameters on the CPU means the optimizer step runs there too",
            "set zero.offload_optimizer=true",
        )
    for key, message, fix in zero_rules(lay.zero_stage, lay.dp_replicate, lay.offload_optimizer):
        r.error(key, message, fix)
    if lay.offload_device == "nvme":  # an unknown device never gets here: resolve_layout reported it, once
        path = None if OmegaConf.is_missing(z, "nvme_path") else z.nvme_path
        if not path:
            r.error(
                "zero.nvme_path",
                "zero.offload_optimizer_device=nvme keeps Adam's moments in files on a "
                "node-local NVMe drive, but no directory is given",
                "set zero.nvme_path to a node-local NVMe "
                "mount, e.g. zero.nvme_path=/raid/$USER/hpctrain (DGX: the RAID-0 of data drives at /raid)",
            )
    for key, message, fix in zero_idle_rules(
        lay.zero_stage, lay.zero_shard, lay.cp, lay.accumulate_unsharded, lay.pp, lay.grad_accum
    ):
        r.warn(key, message, fix)
    for key, value in {
        "zero.reduce_bucket_size": z.reduce_bucket_size,
        "zero.allgather_bucket_size": z.allgather_bucket_size,
    }.items():
        if value < 1_000_000:
            r.error(
                key,
                f"{value} bytes is too small: thousands of tiny collectives per step",
                f"use at least 1e6 bytes (typical: 2.5e7 to 5e8); {key}=25000000",
            )
    if z.stage == 3 and lay.pp > 1:
        r.warn(
            "zero.stage",
            "ZeRO-3 with pipeline parallelism re-gathers each stage's parameters for every "
            "microbatch (DeepSpeed does not allow it; Megatron uses ZeRO-1 with PP)",
            "consider zero=stage1 with pp>1, unless memory needs stage 3",
        )


def _precision(cfg: Config, lay: Layout, r: CheckReport) -> None:
    pr = cfg.precision
    if pr.dtype == DType.fp16 and not pr.loss_scaling:
        r.error(
            "precision.loss_scaling",
            "fp16 without loss scaling: small gradients underflow to zero and training silently stalls",
            "set precision.loss_scaling=true (or precision=fp16), or use precision=bf16",
        )
    if pr.dtype != DType.fp16 and pr.loss_scaling:
        r.warn(
            "precision.loss_scaling",
            f"loss scaling does nothing useful with {pr.dtype.value}",
            "set precision.loss_scaling=false",
        )
    if pr.loss_scaling and pr.initial_scale < pr.min_scale and pr.min_scale > 0:  # each > 0: DOMAINS
        r.error(
            "precision.initial_scale",
            f"initial_scale={pr.initial_scale} must be >= min_scale={pr.min_scale} > 0",
            "use e.g. precision.initial_scale=65536 precision.min_scale=1",
        )
    if pr.reduce_dtype == DType.fp16:
        r.warn(
            "precision.reduce_dtype",
            "fp16 gradient reductions over many ranks overflow or lose precision",
            "set precision.reduce_dtype=fp32",
        )


FP8_RECIPES = ("tensorwise", "rowwise")  # hpctrain.parallel.float8.RECIPES (config imports no torch)


def _fp8(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """precision.fp8 (torchao Float8Linear, docs/fp8.md): a known recipe, a GPU with FP8 tensor cores, bf16 (or
    fp32) around it, and block Linears whose every TP shard FP8 GEMMs can take."""
    recipe, tp = str(cfg.precision.fp8), lay.tp
    if recipe == "none":
        return
    if recipe not in FP8_RECIPES:
        r.error(
            "precision.fp8",
            f"unknown FP8 recipe {recipe!r}",
            f"use precision.fp8=none, or one of {', '.join(FP8_RECIPES)} (tensorwise: fastest; rowwise: more accurate)",
        )
        return
    gpu, hw = cfg.cluster.gpu_type, KNOWN_HARDWARE.get(cfg.cluster.gpu_type)
    if gpu == "cpu":
        r.warn(
            "precision.fp8",
            "gpu_type=cpu: torchao emulates FP8 (the same casts and scales, products in high "
            "precision): numerics only, slower than bf16",
            "use precision.fp8=none for speed on CPU",
        )
        if cfg.parallel.compile:
            r.error(
                "parallel.compile",
                "torchao's FP8 emulation (gpu_type=cpu) does not support torch.compile",
                "set parallel.compile=false, or precision.fp8=none",
            )
    elif hw is not None and not hw.has_fp8:
        fp8_gpus = ", ".join(sorted(name for name, h in KNOWN_HARDWARE.items() if h.has_fp8))
        r.error(
            "precision.fp8",
            f"cluster.gpu_type={gpu} has no FP8 tensor cores (FP8 GEMMs need compute "
            "capability 8.9 or newer: Ada, Hopper, Blackwell)",
            f"set precision.fp8=none (bf16 is this GPU's fastest), or run on {fp8_gpus}",
        )
    elif not cfg.parallel.compile:
        r.warn(
            "parallel.compile",
            f"precision.fp8={recipe} eager: each Float8Linear casts, takes the amax and "
            "scales in kernels of their own, around every GEMM; torchao's own figures show FP8 faster than bf16 "
            "only compiled (fused), and eager it is slower. The plan's step time assumes the compiled speed-up",
            "set parallel.compile=true (tools/gpu_check.py's f8 and fp8x rows measure both on your GPU)",
        )
    dtype = cfg.precision.dtype
    if dtype == DType.fp16:
        r.error(
            "precision.dtype",
            "FP8 with fp16: fp16's loss scaling and FP8's own per-tensor scaling would both "
            "rescale the gradients; torchao's recipes (and torchtitan's) train FP8 around bf16",
            "set precision=bf16 (no loss scaling needed)",
        )
    elif dtype == DType.fp32:
        r.warn(
            "precision.dtype",
            "FP8 with fp32: the Linears run in FP8, everything else (attention, norms, "
            "the head) in fp32, far slower than bf16",
            "set precision=bf16",
        )
    for key, message, fix in fp8_rules(tp, recipe, workload(cfg, lay)):  # the TP shards FP8 GEMMs can take
        r.error(key, message, fix)


def _optim(cfg: Config, lay: Layout, r: CheckReport) -> None:
    o, t = cfg.optim, cfg.train
    if o.name != "adamw":
        r.error("optim.name", f"unknown optimizer {o.name!r}", "use optim.name=adamw")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        r.error("optim.betas", f"must be two numbers in [0, 1), got {list(o.betas)}", "use optim.betas=[0.9,0.95]")
    if o.warmup_steps > t.max_steps >= 1:  # a short trial run of a long config: the lr is still ramping at the end
        r.warn(
            "optim.warmup_steps",
            f"warmup ({o.warmup_steps} steps) is longer than the run (train.max_steps="
            f"{t.max_steps}): the learning rate never reaches optim.lr={o.lr:g}",
            f"use e.g. optim.warmup_steps={max(0, t.max_steps // 10)} for a run this short",
        )
    if o.decay not in ("cosine", "linear", "constant"):
        r.error("optim.decay", f"unknown decay {o.decay!r}", "use cosine, linear or constant")


def _train_and_data(cfg: Config, lay: Layout, r: CheckReport) -> None:
    t, d, m = cfg.train, cfg.data, cfg.model
    if t.max_steps < 1:
        r.error("train.max_steps", f"must be >= 1, got {t.max_steps}", "set train.max_steps to the number of steps")
    elif t.max_steps > MAX_STEPS:
        r.error(
            "train.max_steps",
            f"{t.max_steps} is more than {MAX_STEPS:,} steps: the progress line's time to go "
            "(a datetime.timedelta, at most 999,999,999 days) overflows at the first steps, and no run takes "
            "that many (Llama 3 405B: about 1.2 million)",
            f"set train.max_steps<={MAX_STEPS}, the steps this run is to take",
        )
    if not 0 <= t.seed < MAX_SEED:
        r.error(
            "train.seed",
            f"must be in [0, 2**32), got {t.seed}: the data order's seeds are derived from it "
            "(seed x 1,000,003 + sample) and must stay within 64 bits",
            "use e.g. train.seed=1234",
        )
    if t.seq_len < 1 or t.seq_len > m.context:
        r.error(
            "train.seq_len",
            f"sequence length {t.seq_len} must be in [1, model.context={m.context}]: "
            "positions beyond the context have no embedding",
            f"set train.seq_len<={m.context}",
        )
    if d.vocab_size > m.vocab_size:
        r.error(
            "data.vocab_size",
            f"the data uses {d.vocab_size} token ids but model.vocab_size={m.vocab_size}",
            f"set model.vocab_size>={d.vocab_size} or use data matching the model's tokenizer",
        )
    if d.kind == DataKind.text_bytes and d.vocab_size != 256:
        r.error(
            "data.vocab_size", f"text_bytes data is byte-level (256 ids), got {d.vocab_size}", "set data.vocab_size=256"
        )
    if d.kind == DataKind.tokens:
        if d.token_dtype not in ("uint16", "uint32"):
            r.error(
                "data.token_dtype", f"must be uint16 or uint32, got {d.token_dtype!r}", "set data.token_dtype=uint16"
            )
        elif d.token_dtype == "uint16" and d.vocab_size > 65536:
            r.error("data.token_dtype", f"uint16 cannot hold {d.vocab_size} token ids", "set data.token_dtype=uint32")
        if OmegaConf.is_missing(d, "path") or not d.path:
            r.error(
                "data.path",
                "data=tokens needs the path of a pre-tokenised .bin file",
                "set data.path=/path/to/train.bin",
            )
        elif not os.path.exists(d.path):
            message = f"{d.path} does not exist on this machine"
            fix = "check the path; it must be readable from every node"
            (r.warn if cfg.dry_run else r.error)("data.path", message, fix)
    if d.kind == DataKind.indexed:
        _indexed_data(d, cfg.dry_run, r)
    _validation(t, d, r)


def _indexed_data(d: DataConfig, dry_run: bool, r: CheckReport) -> None:
    """The blend parses and its datasets exist (or data.prepare will make the one it names)."""
    prepare = list(d.prepare.inputs)
    for key in ("blend", "valid_blend"):
        text = getattr(d, key)
        if not text:
            if key == "blend":
                r.error(
                    "data.blend",
                    "data=indexed needs the prefix of a Megatron-format dataset (PREFIX.bin + "
                    "PREFIX.idx), or several with weights",
                    "set data.blend=/data/pile_text_document or "
                    "data.blend='0.3 /data/a 0.7 /data/b' (make one with python -m hpctrain.data.prepare)",
                )
            continue
        try:
            pairs = parse_blend(text)
        except ValueError as exc:
            r.error(f"data.{key}", str(exc), f"set data.{key}='0.3 /data/a_text_document 0.7 /data/b_text_document'")
            continue
        weights = [w for w, _ in pairs]
        if not all(math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
            bad = next(
                (f"the weight of {p} is {w:g}" for w, p in pairs if not math.isfinite(w)),
                f"the weights add up to {sum(weights):g}",
            )
            r.error(
                f"data.{key}",
                f"{bad}: weights must be finite positive numbers (each dataset's share is its weight over their sum)",
                f"set data.{key}='0.3 /data/a_text_document 0.7 /data/b_text_document'",
            )
            continue
        if prepare and key == "blend":
            if len(pairs) != 1:
                r.error(
                    "data.prepare.inputs",
                    f"data.prepare makes one dataset, but data.blend names {len(pairs)}",
                    "set data.blend to the one prefix data.prepare writes, or prepare each with "
                    "python -m hpctrain.data.prepare",
                )
            continue  # made on the login node before the job starts
        for _, prefix in pairs:
            missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.exists(f"{prefix}{ext}")]
            if missing:
                (r.warn if dry_run else r.error)(
                    f"data.{key}",
                    f"{' and '.join(missing)} not found on this machine",
                    "check the prefix (without .bin/.idx); it must be readable from "
                    "every node, or make it with python -m hpctrain.data.prepare",
                )
    for source in prepare:
        wrong = None if source == "stdlib" else _not_a_source(source)
        if wrong:  # missing, or a FIFO or a device the preparation would block on or read without end
            r.error(
                "data.prepare.inputs",
                f"{source} {wrong}",
                "name text or jsonl files, directories, a saved datasets directory, or stdlib",
            )
    if prepare and d.prepare.tokenizer and not os.path.exists(d.prepare.tokenizer):
        r.error(
            "data.prepare.tokenizer",
            f"{d.prepare.tokenizer} does not exist",
            "give a tokenizers tokenizer.json, or leave it unset to train a byte-level BPE on the inputs",
        )
    if d.valid_blend and d.valid_fraction:
        r.error(
            "data.valid_fraction",
            "both data.valid_blend and data.valid_fraction hold out validation data",
            "keep one: data.valid_fraction=0 to validate on data.valid_blend",
        )


def _not_a_source(path: str) -> str | None:
    """What is wrong with a data.prepare input, as the end of a sentence about it; None for a file or directory."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as exc:
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    what = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    return f"is {what}, not a file or directory: the login node would block on it or read it without end"


def _validation(t: TrainConfig, d: DataConfig, r: CheckReport) -> None:
    """Where validation data comes from (the ranges of data.valid_fraction, train.eval_every and eval_batches:
    DOMAINS)."""
    if d.valid_blend and d.kind != DataKind.indexed:
        r.error(
            "data.valid_blend",
            f"validation prefixes are for data=indexed, not {d.kind.value}",
            "use data.valid_fraction to hold out part of this data",
        )
    if t.eval_every > 0 and not d.valid_fraction and not d.valid_blend:
        r.error(
            "train.eval_every",
            f"validation every {t.eval_every} steps, but no validation data is held out",
            "set data.valid_fraction=0.01 (the last 1% of the documents), or data.valid_blend (indexed)",
        )


def _checkpoint(cfg: Config, lay: Layout, r: CheckReport) -> None:
    ck = cfg.checkpoint
    names = [t.name for t in ck.tiers]
    if len(set(names)) != len(names):
        r.error("checkpoint.tiers", f"tier names must be unique, got {names}", "give each tier its own name")
    for i, tier in enumerate(ck.tiers):
        key = f"checkpoint.tiers[{i}]"
        if not os.path.isabs(str(tier.path)) and _leaves(str(tier.path)):
            r.error(
                f"{key}.path",
                f"{tier.path!r} leads out of the run directory (a relative tier path is inside it)",
                f"use a path inside the run directory (e.g. {key}.path=checkpoints), or an absolute one "
                "(the run id is appended to it)",
            )
        if ck.enabled and tier.interval_steps == 0 and tier.interval_minutes == 0 and not ck.save_final:
            r.warn(
                key, f"tier {tier.name!r} has no interval and nothing is saved at the end", f"set {key}.interval_steps"
            )
    if ck.when_busy not in ("skip", "wait"):
        r.error("checkpoint.when_busy", f"must be skip or wait, got {ck.when_busy!r}", "use checkpoint.when_busy=skip")
    if ck.enabled and not ck.tiers:
        r.error(
            "checkpoint.tiers",
            "checkpointing is enabled but no tier is listed",
            "use checkpoint=default, or checkpoint=none",
        )


MAX_STEPS = 10**9  # see _train_and_data
MAX_SEED = 2**32


def _leaves(relative: str) -> bool:
    """A relative path that climbs out of the directory it is joined to (`..`, `a/../..`)."""
    parts: list[str] = []
    for part in relative.replace("\\", "/").split("/"):
        if part == "..":
            if not parts:
                return True
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return False


def _run_paths(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The run directory is run.root/run.name/run.id, and must stay under run.root (run.resume may name any run
    directory by its path: it exists already)."""
    run = cfg.run
    name = "" if run.name is None else str(run.name)
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or os.path.isabs(name) or ".." in parts:
        r.error(
            "run.name",
            f"{name!r} would put the run directory outside run.root={run.root} (run directories are "
            "run.root/run.name/run.id)"
            if parts
            else f"{name!r} names no directory under run.root",
            "use a plain name, e.g. run.name=gpt3_1.3b (a/b makes a subdirectory); change run.root to write elsewhere",
        )
    elif not _inside(run.root, name):
        r.error(
            "run.name",
            f"run.root/{name} resolves outside run.root={run.root} (a symbolic link)",
            "use a run.name whose directory is inside run.root, or change run.root",
        )
    if run.id is None:
        return
    rid = str(run.id)
    if not rid or rid in (".", "..") or "/" in rid or "\\" in rid or os.sep in rid:
        r.error(
            "run.id",
            f"{rid!r} is not a directory name: the run directory is run.root/run.name/run.id, and "
            "an id must be one directory inside it",
            "use a plain id such as run.id=baseline-1 (or leave "
            "it unset for a fresh one; run.resume=PATH continues a run by its path)",
        )
    elif parts and ".." not in parts and not os.path.isabs(name) and not _inside(run.root, name, rid):
        r.error(
            "run.id",
            f"run.root/{name}/{rid} resolves outside run.root={run.root} (a symbolic link)",
            "use another run.id, or change run.root",
        )


def _inside(root: str, *parts: str) -> bool:
    """Whether run.root/parts, symbolic links resolved (what the launcher creates), stays under run.root."""
    try:
        base = Path(root).expanduser().resolve()
        path = base.joinpath(*parts).resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links
        return False
    return path == base or base in path.parents


def _finite_numbers(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """No NaN or infinity anywhere: they pass every range check (nan > 0 is false, so is nan < 0) and fail in the
    job, at an integer conversion or a comparison, or train on NaN."""
    for key, value in walk_values(OmegaConf.to_container(cfg, resolve=False)):
        if isinstance(value, float) and not math.isfinite(value):
            r.error(key, f"must be a finite number, got {value}", f"set {key} to a finite value")


def _dry_run(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """dry_run is true, false or simulate; a simulated rank must exist and run what the simulation can build."""
    if cfg.dry_run not in DRY_RUNS:
        r.error(
            "dry_run",
            f"must be true, false or simulate, got {cfg.dry_run!r}",
            "dry_run=true prints the plan; dry_run=simulate also builds one rank of the job on fake tensors",
        )
        return
    rank = cfg.plan.simulate_rank
    if rank is not None and not 0 <= rank < lay.world_size:
        r.error(
            "plan.simulate_rank",
            f"{rank} is not a rank of this {lay.world_size}-rank job",
            f"set plan.simulate_rank to 0..{lay.world_size - 1}, or leave it out for the planner's most loaded rank",
        )
    if not simulating(cfg):
        return
    for key, message, fix in simulation_rules(data_parallel_kind(lay), workload(cfg, lay)):
        r.error(key, message, fix)
    if lay.offload_device == "nvme" and (lay.offload_optimizer or lay.offload_params):
        r.error(
            "dry_run",
            "simulate cannot run Adam's moments on NVMe: fake tensors have no bytes to write",
            "simulate with zero.offload_optimizer_device=cpu (the GPU side is the same), or use dry_run=true",
        )
    if cfg.parallel.compile:
        r.error(
            "dry_run",
            "simulate runs the model eagerly: torch.compile on fake tensors is not simulated",
            "add parallel.compile=false to the simulation (compilation changes kernels, not what is stored)",
        )


# ---------------------------------------------------------------- the domain of every number (issue 46)

MAX_COUNT = 2**31 - 1  # int32: no tensor dimension, batch, layer, rank or count of anything a run has goes past it
MAX_PER_NODE = 4096  # processes, threads, GPUs or CPUs of one node (the largest nodes have a few hundred cores)
MAX_NODES = 2**20  # nodes of one job: no machine has a million
MAX_SECONDS = 10 * 365 * 86400  # ten years: longer than any job, timeout or wait means
MAX_MINUTES = MAX_SECONDS // 60
MAX_BYTES = 2**40  # a buffer or a cap of one process: 1 TiB, more than any GPU or host holds per process
MAX_MIB = 2**20  # the same in MiB
FP32_MAX = 3.4028234663852886e38  # a loss scale is an fp32 number


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a numeric key may take: [low, high] (a bound left out where there is none, `low_open` /
    `high_open` to exclude it), or one of `also`, values outside the range with a meaning of their own
    (parallel.dp=-1: inferred). `after` follows the bound in the message (a unit, what 0 means), `note` follows
    the value (why the bound), `example` is a value inside it, for the fix. Every number is finite besides
    (`_finite_numbers`)."""

    low: float | None = None
    high: float | None = None
    example: Any = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[tuple[int, str], ...] = ()
    after: str = ""
    note: str = ""
    interval: bool = False  # say "in [low, high)" rather than the one bound the value is past

    def holds(self, value: float) -> bool:
        if any(value == v for v, _ in self.also):
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def problem(self, key: str, value: float, shown: str = "") -> tuple[str, str]:
        """The message and the fix for `value`, which is not in the domain (`shown` in its place: a list)."""
        if self.interval:
            bound = (
                f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}"
            )
        elif self.low is not None and (value <= self.low if self.low_open else value < self.low):
            bound = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            bound = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        also = "".join(f" or {v} ({meaning})" for v, meaning in self.also)
        shown = shown or (f"{value:,}" if isinstance(value, int) and abs(value) >= 10**6 else f"{value}")
        message = f"must be {bound}{self.after}{also}, got {shown}" + (f": {self.note}" if self.note else "")
        return message, f"use e.g. {key}={self.example}"


def _number(x: float | None) -> str:
    if x is None:
        return ""
    if float(x).is_integer() and abs(x) < 2**63:
        return f"{int(x):,}" if abs(x) >= 10**6 else str(int(x))
    return f"{x:g}"


def _count(low: int, example: int, after: str = "", note: str = "", high: int = MAX_COUNT, **kw: Any) -> Domain:
    """An integer count from `low` (the note for a value past MAX_COUNT says why there is a top)."""
    return Domain(low, high, example, after=after, note=note, **kw)


_SECONDS = " seconds"


def _positive(example: Any, note: str = "") -> Domain:
    """A float above 0 (a rate, a scale, a threshold): 0 itself is no value of it."""
    return Domain(0, None, example, low_open=True, note=note)


# One row per numeric key of the schema (hpctrain/config/schema.py; tests/config/test_numeric_domains.py holds
# this table to it, so a new number cannot come without its domain). "checkpoint.tiers[].x" applies to each
# tier. Checked by `domain_checks`, after the checks that say more of a key (those that combine it with other
# keys, a family's shape rules, cluster_checks' timeouts): a key they reported is not reported twice.
DOMAINS: dict[str, Domain] = {
    # the model
    "model.n_layers": _count(1, 32),
    "model.d_model": _count(1, 4096),
    "model.n_heads": _count(1, 32),
    "model.n_kv_heads": _count(0, 8, " (0: model.n_heads)"),
    "model.head_dim": _count(0, 128, " (0: d_model / n_heads)"),
    "model.vocab_size": _count(1, 50257),
    # padded_vocab: any value <= 1 means no padding (the schema's own words), so only the top is a bound
    "model.vocab_pad_multiple": Domain(-MAX_COUNT, MAX_COUNT, 64, after=" (<= 1: no padding)"),
    "model.context": _count(1, 2048),
    "model.ffn_mult": _count(1, 4, " (model.ffn_hidden = ffn_mult x d_model when ffn_hidden is 0)"),
    "model.ffn_hidden": _count(0, 11008, " (0: ffn_mult x d_model)"),
    "model.norm_eps": Domain(0, None, "1e-5"),
    "model.rope.theta": _positive(500000, "the base of the rotary frequencies"),
    "model.rope.scaling_factor": Domain(0, None, 8, after=" (0: no scaling)"),
    "model.rope.low_freq_factor": _positive(1, "original_context is divided by it"),
    "model.rope.high_freq_factor": _positive(4, "original_context is divided by it"),
    "model.rope.original_context": _count(1, 8192),
    "model.moe.n_experts": _count(0, 8, " (0: dense)"),
    "model.moe.top_k": _count(1, 2),
    "model.moe.expert_hidden": _count(0, 1536, " (0: model.ffn_hidden)"),
    "model.moe.n_shared_experts": _count(0, 1),
    "model.moe.n_groups": _count(1, 8),
    "model.moe.topk_groups": _count(1, 4),
    "model.moe.route_scale": _positive(1.0, "the combine weights are multiplied by it"),
    "model.moe.capacity_factor": Domain(0, None, 1.25, after=" (0: dropless)"),
    "model.moe.balance_coef": Domain(0, None, 0.001, note="a loss coefficient"),
    "model.moe.z_loss_coef": Domain(0, None, 0.001, note="a loss coefficient"),
    "model.moe.bias_update_rate": Domain(
        0,
        None,
        0.001,
        after=" (0: the router's bias stays)",
        note="the sigmoid router's bias moves this much per optimizer step, "
        "towards the experts that get too few tokens; a negative rate moves it away",
    ),
    "model.dropout": Domain(0, 1, 0.0, high_open=True, interval=True),
    "model.init_std": Domain(0, None, 0.02, after=" (a standard deviation)"),
    # the layout (also hpctrain.config.layout, which says more of them)
    "parallel.dp": _count(1, -1, also=((-1, "infer it from the world size"),)),
    "parallel.dp_replicate": _count(1, 1),
    "parallel.tp": _count(1, 8),
    "parallel.pp": _count(1, 4),
    "parallel.ep": _count(1, 8),
    "parallel.cp": _count(1, 2),
    "parallel.virtual_stages": _count(1, 2),
    "parallel.first_stage_layers": _count(0, 0, " (0: as the other stages)"),
    "parallel.last_stage_layers": _count(0, 0, " (0: as the other stages)"),
    "parallel.microbatches": _count(0, 0, " (0: train.grad_accum)"),
    "zero.stage": _count(0, 1, high=3),
    "zero.nvme_chunk_mb": Domain(
        1, MAX_MIB, 64, after=" MiB", note="three chunks of each moment are in host memory at a time"
    ),
    "zero.reduce_bucket_size": _count(1_000_000, 25_000_000, " bytes", high=MAX_BYTES),
    "zero.allgather_bucket_size": _count(1_000_000, 25_000_000, " bytes", high=MAX_BYTES),
    # the optimizer
    "optim.lr": _positive("3e-4"),
    "optim.min_lr_ratio": Domain(0, 1, 0.1, after=" (a fraction of optim.lr)", interval=True),
    "optim.betas": Domain(0, 1, "[0.9,0.95]", high_open=True, interval=True),  # each of the two
    "optim.eps": Domain(0, None, "1e-8"),
    "optim.weight_decay": Domain(0, None, 0.1),
    "optim.warmup_steps": _count(0, 100, high=MAX_STEPS),
    "optim.grad_clip": Domain(0, None, 1.0, after=" (0 disables clipping)"),
    "precision.initial_scale": Domain(0, FP32_MAX, 65536, low_open=True, note="a loss scale is an fp32 number"),
    "precision.loss_scale_window": _count(1, 1000, " steps"),
    "precision.min_scale": Domain(0, FP32_MAX, 1, low_open=True, note="a loss scale is an fp32 number"),
    # the data
    "data.vocab_size": _count(1, 50257),
    "data.max_bytes": _count(1, 16_000_000, " bytes", high=MAX_BYTES),
    "data.valid_fraction": Domain(0, 1, 0.01, high_open=True, interval=True),
    "data.prefetch": _count(
        0, 1, " steps (0: no read-ahead)", high=1024, note="each step read ahead is a global batch held in memory"
    ),
    # byte-level BPE: 256 byte tokens and the end-of-document token come first, whatever vocab_size says
    "data.prepare.vocab_size": _count(257, 8192, " (256 byte tokens and <|endoftext|>, then the merges)"),
    "data.prepare.workers": _count(1, 2, " processes", high=MAX_PER_NODE),
    # checkpoints
    "checkpoint.tiers[].interval_steps": _count(0, 200, " (0: no step interval)"),
    "checkpoint.tiers[].interval_minutes": Domain(0, MAX_MINUTES, 30, after=" (0: no time interval)"),
    "checkpoint.tiers[].keep_last": _count(1, 2, note="the newest checkpoint would be deleted"),
    "checkpoint.write_threads": _count(1, 2, high=MAX_PER_NODE),
    # the cluster (cluster_checks says more of most)
    "cluster.nodes": _count(1, 1, high=MAX_NODES),
    "cluster.spare_nodes": _count(0, 0, high=MAX_NODES),
    "cluster.gpus_per_node": _count(1, 8, high=MAX_PER_NODE),
    "cluster.cpus_per_task": _count(1, 1, high=MAX_PER_NODE),
    "cluster.mem_gb": _count(0, 0, " (0: the partition's default memory)"),
    "cluster.time_min": _count(1, 60, " minutes", high=MAX_MINUTES),
    "cluster.signal_delay_s": _count(0, 120, _SECONDS, high=MAX_SECONDS),
    "cluster.failure_rate_per_gpu_day": Domain(0, None, 0.001, note="the share of GPUs that fail per day"),
    "cluster.gpu_peak_tflops": Domain(0, None, 989, after=" TFLOP/s (0: the GPU type's datasheet figure)"),
    "cluster.intra_node_gb_s": Domain(0, None, 450, after=" GB/s (0: the GPU type's datasheet figure)"),
    "cluster.inter_node_gb_s": Domain(0, None, 50, after=" GB/s (0: the GPU type's datasheet figure)"),
    "cluster.max_num_timeout": _count(0, 20, " requeues"),
    # NCCL_IB_GID_INDEX: an index into the port's GID table; -1 is NCCL's own choice (NCCL 2.21 and later)
    "cluster.nccl.ib_gid_index": _count(0, 3, high=65535, also=((-1, "NCCL chooses"),)),
    "launcher.max_restarts": _count(0, 3),
    "launcher.rendezvous_timeout_s": _count(1, 600, _SECONDS, high=MAX_SECONDS),
    "launcher.collective_timeout_s": _count(1, 1800, _SECONDS, high=MAX_SECONDS),
    "elastic.min_nodes": _count(0, 0, " (0: never shrink)", high=MAX_NODES),
    "recovery.groups": _count(1, 2, " replica groups", high=MAX_NODES),
    "recovery.min_replicas": _count(1, 1, " replica groups", high=MAX_NODES),
    "recovery.heartbeat_timeout_ms": _count(1, 1000, " ms"),
    "recovery.join_timeout_ms": _count(0, 1000, " ms"),
    "recovery.quorum_timeout_s": Domain(0, MAX_SECONDS, 120, low_open=True, after=_SECONDS),
    "recovery.sync_every": _count(1, 20, " steps"),
    "recovery.outer_lr": _positive(0.7, "DiLoCo's outer learning rate"),
    "recovery.outer_momentum": Domain(0, 1, 0.9, high_open=True, note="a momentum"),
    # health
    "health.allreduce_mb": _count(1, 16, " MiB", high=MAX_MIB),
    "health.outlier_threshold": _positive(3.5, "a robust z-score"),
    "health.min_slowdown": Domain(0, None, 0.2, note="a relative slowdown"),
    "health.hang_timeout_s": Domain(0, MAX_SECONDS, 600, after=" seconds (0 disables the watchdog)"),
    "health.hang_factor": Domain(1, None, 20, note="a multiple of the median step time"),
    "health.startup_timeout_s": Domain(0, MAX_SECONDS, 1200, low_open=True, after=_SECONDS),
    "health.straggler_every": _count(0, 100, " steps (0 disables the probes)"),
    "health.straggler_factor": Domain(1, None, 1.3, low_open=True, note="a multiple of the median rank's time"),
    "health.straggler_patience": _count(1, 3, " probes"),
    "health.memory_window": _count(0, 200, " steps (0 disables the leak check)"),
    "health.leak_mb": Domain(0, None, 256, after=" MiB"),
    # training
    "train.max_steps": _count(1, 1000, high=MAX_STEPS),
    "train.seed": _count(0, 1234, high=MAX_SEED - 1),
    "train.global_batch": _count(1, 512, " sequences"),
    "train.micro_batch": _count(1, 4, " sequences"),
    "train.grad_accum": _count(1, -1, also=((-1, "infer it from the global batch"),)),
    "train.seq_len": _count(1, 2048, " tokens"),
    "train.log_every": _count(1, 10, " steps"),
    "train.eval_every": _count(0, 100, " steps (0: no validation)"),
    "train.eval_batches": _count(1, 4),
    "train.threads_per_rank": _count(1, 1, high=MAX_PER_NODE),
    "run.lease_check_s": Domain(
        0,
        MAX_SECONDS,
        1,
        low_open=True,
        after=_SECONDS,
        note="rank 0 re-reads the run's lease this often to notice a newer attempt",
    ),
    "plan.search": _count(0, 5, " (0: no search)", high=1000, note="the plan ranks this many layouts"),
    "plan.simulate_rank": _count(0, 0),
}


def _domain_values(cfg: Config, key: str) -> list[tuple[str, Any]]:
    """(the key as reported, the value) for a DOMAINS row: one per tier for checkpoint.tiers[].x, one for a list
    (optim.betas: each element is checked, the key reported)."""
    if "[]." in key:
        head, _, tail = key.partition("[].")
        items = OmegaConf.select(as_node(cfg), head, default=None) or []
        return [(f"{head}[{i}].{tail}", OmegaConf.select(item, tail, default=None)) for i, item in enumerate(items)]
    return [(key, OmegaConf.select(as_node(cfg), key, default=None))]


def domain_checks(cfg: Config, r: CheckReport, prefix: str | tuple[str, ...] = "") -> None:
    """Every number of the config (the DOMAINS whose key starts with `prefix`, or one of them) in its domain,
    unless a check before reported the key already (theirs says more) or it is not finite (`_finite_numbers`)."""
    reported = {p.key for p in r.errors}
    for name, domain in DOMAINS.items():
        if not name.startswith(prefix):
            continue
        for key, value in _domain_values(cfg, name):
            if key in reported:
                continue
            values = list(value) if OmegaConf.is_list(value) or isinstance(value, list) else [value]
            bad = [
                v
                for v in values
                if isinstance(v, (int, float))
                and not isinstance(v, bool)
                and (isinstance(v, int) or math.isfinite(v))
                and not domain.holds(v)
            ]  # an int of 400 digits too
            if bad:
                many = isinstance(value, list) or OmegaConf.is_list(value)
                message, fix = domain.problem(key, bad[0], str(list(values)) if many else "")
                r.error(key, ("each " if many else "") + message, fix)  # a list: the range applies to each
                reported.add(key)


def _domains(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """domain_checks as one of CHECKS: last of the config's own, after the checks that say more of a key."""
    domain_checks(cfg, r)


# ---------------------------------------------------------------- one tensor that no device holds

INT64_MAX = 2**63 - 1  # torch counts a tensor's elements in int64
# The keys a tensor's size comes from: a problem with any of them is reported first, and the sizes are not derived
_SIZE_KEYS = ("model.", "parallel.", "train.micro_batch", "train.seq_len", "cluster.gpu_type")


def _tensor_sizes(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The largest tensors of one rank, each of which must exist whole at some moment (a weight as TP and EP split
    it, with fp32 master copies; one micro-batch's hidden states, MLP activations, routed tokens and logits):
    one with more elements than int64 counts, or more bytes than the device's memory (the GPU's; with
    gpu_type=cpu, the host memory of the largest node hpctrain knows), cannot be allocated at all, whatever the
    layout's other memory. Reported as an error, with the key of its largest factor, even where the memory
    estimate would only warn (gpu_type=cpu)."""
    if any(p.key.startswith(_SIZE_KEYS) for p in r.errors) or cfg.cluster.gpu_type not in KNOWN_HARDWARE:
        return
    gpu = cfg.cluster.gpu_type
    limit = (
        max(h.host_mem_bytes for h in KNOWN_HARDWARE.values()) if gpu == "cpu" else KNOWN_HARDWARE[gpu].gpu_mem_bytes
    )
    where = (
        f"the {format_bytes(limit)} of host memory of the largest node hpctrain knows (gpu_type=cpu)"
        if gpu == "cpu"
        else f"the {format_bytes(limit)} of a {gpu} GPU"
    )
    for what, factors, item_bytes in _largest_tensors(cfg, lay):
        elements = math.prod(v for _, _, v in factors)
        size = elements * item_bytes
        if elements <= INT64_MAX and size <= limit:
            continue
        key = max(factors, key=lambda f: f[2])[1]
        shape = " x ".join(f"{v:,} ({label})" for label, _, v in factors)
        beyond = (
            f"{elements:.3g} elements, more than int64 counts (torch's numel)"
            if elements > INT64_MAX
            else f"{format_bytes(size)}, more than {where}"
        )
        r.error(
            key,
            f"{what} is one tensor of {shape} = {beyond}: it cannot be allocated, whatever the rest of the layout",
            f"lower {key} (or split the tensor: parallel.tp for weights and activations"
            + (", parallel.ep for experts" if "experts" in what else "")
            + (", parallel.cp for a sequence's activations" if "micro-batch" in what else "")
            + ")",
        )
        return  # one is enough: the others share its factors


def _largest_tensors(cfg: Config, lay: Layout) -> list[tuple[str, list[tuple[str, str, int]], int]]:
    """(what, [(label, the key it comes from, factor)], bytes per element) of the tensors `_tensor_sizes` bounds,
    on one rank."""
    m, t = cfg.model, cfg.train
    d = Dims.of(m)
    tp, ep, cp = max(1, lay.tp), max(1, lay.ep), max(1, lay.cp)
    act = 4 if str(getattr(cfg.precision.dtype, "value", cfg.precision.dtype)) == "fp32" else 2
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp)
    ffn_key = "model.ffn_hidden" if m.ffn_hidden else "model.ffn_mult"
    width = ("d_model", "model.d_model", d.d_model)
    vocab = ("vocabulary rows / tp", "model.vocab_size", -(-rows // tp))
    ffn = ("MLP width / tp", ffn_key, -(-d.ffn_hidden // tp))
    tokens = [
        ("micro_batch", "train.micro_batch", t.micro_batch),
        ("seq_len / cp", "train.seq_len", -(-t.seq_len // cp)),
    ]
    qkv = (
        "q, k and v width / tp",
        "model.head_dim" if m.head_dim else "model.d_model",
        -(-(d.q_dim + 2 * d.kv_dim) // tp),
    )
    out = [
        ("the embedding", [vocab, width], 4),
        ("the attention's QKV weight", [qkv, width], 4),
        ("the MLP weight", [ffn, width], 4),
        ("one micro-batch's hidden states", [*tokens, width], act),
        ("one micro-batch's MLP activations", [*tokens, ffn], act),
        # the loss's fp32 working copy is chunked (parallel/tensor_parallel.py): the logits themselves are the largest
        ("one micro-batch's logits", [*tokens, vocab], act),
    ]
    if family_of(m).moe and d.n_experts:
        hidden = ("expert_hidden", "model.moe.expert_hidden" if m.moe.expert_hidden else ffn_key, d.expert_hidden)
        out += [
            (
                "a layer's stacked experts weight",
                [("experts / ep", "model.moe.n_experts", -(-d.n_experts // ep)), hidden, width],
                4,
            ),
            ("one micro-batch's routed tokens", [*tokens, ("top_k", "model.moe.top_k", d.top_k), width], act),
        ]
    return out


CHECKS: list[Callable[[Config, Layout, CheckReport], None]] = [
    _dry_run,
    _finite_numbers,
    _model_shape,
    _experts,
    _tensor_parallel,
    _context_parallel,
    _pipeline,
    _zero,
    _precision,
    _fp8,
    _optim,
    _train_and_data,
    _run_paths,
    *cluster_checks,
    _checkpoint,
    _domains,
    _tensor_sizes,
]
