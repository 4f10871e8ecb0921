"""Checks that run on the login node before anything is queued: the config's own rules.

Each check names the key at fault and the fix. Errors stop the run before a run directory exists or a job
is submitted; warnings are printed in the plan. The schema already rejected unknown keys and wrong types.
The checks that need the planner's estimates (memory per GPU, the pipeline bubble, offload), and the runner of
every check, are hpctrain.plan.checks: config never imports the planner (pyproject.toml's import contract).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from hpctrain import schedules
from hpctrain.config.layout import Layout, data_parallel_kind, model_fit_problems, sequence_problems
from hpctrain.config.cluster_checks import cluster_checks
from hpctrain.config.file_checks import walk_values
from hpctrain.config.problems import CheckReport, ConfigError, Problem
from hpctrain.config.schema import (
    DRY_RUNS,
    SCHEDULES,
    Config,
    DataConfig,
    DataKind,
    DType,
    MoEConfig,
    TrainConfig,
    parse_blend,
    simulating,
)
from hpctrain.hardware import KNOWN_HARDWARE
from hpctrain.models.params import ffn_hidden_of, kv_heads_of
from hpctrain.models.family import Dims
from hpctrain.models.registry import FAMILIES, family_of



def check_schema(cfg: Any) -> None:
    """Keys added with Hydra's `+key=value` bypass the schema during composition: catch them here. And
    model.arch names a registered family (a string in the schema, so that a family registered at run time,
    a site's or a test's, needs no change to it)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg))
    except ConfigKeyError as err:
        key = str(err.full_key)
        raise ConfigError([Problem(key, "is not a key of hpctrain's config schema", _suggest(key))]) from None
    arch = merged.model.arch
    if arch not in FAMILIES:
        close = difflib.get_close_matches(arch, list(FAMILIES), n=1)
        raise ConfigError([Problem("model.arch", f"{arch!r} is not a model family",
                                   (f"did you mean model.arch={close[0]}? " if close else "")
                                   + f"The families: {', '.join(FAMILIES)} (hpctrain.models.registry)")])


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


def model_shape_checks(cfg: Config, r: CheckReport) -> None:
    """The model's own rules, which need no layout (parallel=auto runs them before its search)."""
    m = cfg.model
    for key, value in {"model.n_layers": m.n_layers, "model.d_model": m.d_model, "model.n_heads": m.n_heads,
                       "model.vocab_size": m.vocab_size, "model.context": m.context}.items():
        if value < 1:
            r.error(key, f"must be >= 1, got {value}", f"set {key} to a positive integer")
    if m.n_heads >= 1 and not m.head_dim and m.d_model % m.n_heads:
        r.error("model.d_model", f"d_model {m.d_model} is not divisible by n_heads {m.n_heads}",
                f"use a d_model that is a multiple of {m.n_heads} (e.g. {m.n_heads * max(1, m.d_model // m.n_heads)})")
    if not 0.0 <= m.dropout < 1.0:
        r.error("model.dropout", f"must be in [0, 1), got {m.dropout}", "set model.dropout=0.0")
    if m.init_std < 0:
        r.error("model.init_std", f"must be >= 0 (a standard deviation), got {m.init_std}", "use model.init_std=0.02")
    if m.norm_eps < 0:
        r.error("model.norm_eps", f"must be >= 0, got {m.norm_eps}", "use model.norm_eps=1e-5")
    for key, what, fix in family_of(m).shape_problems(m):  # the family's own rules
        r.error(key, what, fix)
    if m.init_from and not os.path.exists(m.init_from):
        (r.warn if cfg.dry_run else r.error)("model.init_from", f"{m.init_from} does not exist on this machine",
                                             "give a Hugging Face model directory readable from every node")


def _experts(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """model.moe.* belongs to the Mixture-of-Experts families (their own rules, top_k within the experts and so on,
    are the family's shape_problems; experts over parallel.ep are model_fit_problems'); an MoE model's routing
    gives data-dependent shapes, which torch.compile is not set up for here."""
    m = cfg.model
    family = family_of(m)
    if not family.moe:
        moe_families = ", ".join(f.name for f in FAMILIES.values() if f.moe)
        for f in dataclasses.fields(MoEConfig):
            value = getattr(m.moe, f.name)
            if value != f.default:
                r.error(f"model.moe.{f.name}", f"set to {value!r}, but model.arch={family.name} is a dense model: "
                        "model.moe configures a Mixture-of-Experts feed-forward, which its blocks do not have",
                        f"remove model.moe.{f.name}, or use an MoE family (model.arch={moe_families}; e.g. "
                        "model=mixtral_8x7b, model=qwen3_30b_a3b)")
        return
    if lay.cp > 1:
        r.error("parallel.cp", f"model.arch={family.name} is a Mixture-of-Experts model: its load-balancing losses "
                "are computed over the tokens a rank routes, and context parallelism would cut them to parts of "
                "sequences (hpctrain's CP is tested equal to one process for the dense families only)",
                "set parallel.cp=1 for MoE models, or use a dense family (model.arch=gpt or llama)")
    if cfg.parallel.compile:
        r.error("parallel.compile", f"model.arch={family.name} routes tokens to experts: the rows each expert "
                "gets (and, with expert parallelism, the all-to-all's split sizes) change every step, "
                "data-dependent shapes that hpctrain's torch.compile setup does not support yet",
                "set parallel.compile=false")


def _model_shape(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """model_shape_checks as one of CHECKS."""
    model_shape_checks(cfg, r)


def _tensor_parallel(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The layout against the model's shape (config.layout.model_fit_problems: the search obeys the same)."""
    m = cfg.model
    if cfg.parallel.sequence_parallel and lay.tp == 1:
        r.warn("parallel.sequence_parallel", "ignored with tp=1: sequence parallelism shards along the TP group",
               "set parallel.sequence_parallel=false, or parallel.tp>1 to use it")
    for key, message, fix in model_fit_problems(lay, m.n_layers, m.n_heads, kv_heads_of(m), ffn_hidden_of(m),
                                                m.moe.n_experts):
        r.error(key, message, fix)


def _context_parallel(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The sequence against the CP degree (config.layout.sequence_problems: the search obeys the same)."""
    for key, message, fix in sequence_problems(lay, cfg.train.seq_len, cfg.model.dropout):
        r.error(key, message, fix)
    if lay.cp > 1 and cfg.parallel.compile:
        r.error("parallel.compile", f"with cp={lay.cp}: the CP attention's bottom-right causal mask (torch's "
                "CausalBias, which lets flash attention take a chunk against a longer key prefix) is a tensor "
                "subclass whose constructor torch 2.13's dynamo cannot trace, and blocks compile as one graph "
                "(fullgraph)", "set parallel.compile=false with context parallelism")


def _pipeline(cfg: Config, lay: Layout, r: CheckReport) -> None:
    p = cfg.parallel
    if p.schedule not in SCHEDULES:
        r.error("parallel.schedule", f"unknown schedule {p.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        return
    entry = schedules.get(p.schedule)
    if entry.split_backward and lay.pp > 1 and lay.dp > 1 and lay.zero_stage >= 1:
        r.error("parallel.schedule", f"{p.schedule} computes weight gradients in a separate pass, which loses "
                f"gradients of ZeRO-sharded parameters (zero.stage={lay.zero_stage}) in torch 2.13",
                "use zero.stage=0 with this schedule, or parallel.schedule=interleaved_1f1b")
    if lay.pp == 1 or r.errors:
        return
    mb = lay.microbatches
    need = entry.min_microbatches(lay.pp, lay.virtual_stages)
    if mb < need:
        r.error("train.grad_accum", f"{mb} microbatches for {lay.pp} pipeline stages: {p.schedule} needs at least "
                f"{'one microbatch per stage' if need == lay.pp else f'{need} microbatches'}, or stages sit idle",
                f"use train.grad_accum >= {need} (best >= {4 * lay.pp}), e.g. by lowering train.micro_batch")
        return
    if entry.microbatches_multiple_of_pp and mb % lay.pp:
        r.error("train.grad_accum", f"interleaved schedules need microbatches ({mb}) to be a multiple of pp "
                f"({lay.pp})", f"use train.grad_accum={(mb // lay.pp + 1) * lay.pp}")


def _zero(cfg: Config, lay: Layout, r: CheckReport) -> None:
    z = cfg.zero
    if z.offload_params and not z.offload_optimizer:
        r.error("zero.offload_optimizer", "parameters on the CPU means the optimizer step runs there too",
                "set zero.offload_optimizer=true")
    if z.offload_optimizer and z.stage < 2:
        r.error("zero.offload_optimizer", f"optimizer offload is done with FSDP2's CPU offload, which needs "
                f"stage 2 or 3, got stage {z.stage}", "set zero.stage=2 (or zero=stage2_offload)")
    if lay.offload_device == "nvme":  # an unknown device never gets here: resolve_layout reported it, once
        path = None if OmegaConf.is_missing(z, "nvme_path") else z.nvme_path
        if not path:
            r.error("zero.nvme_path", "zero.offload_optimizer_device=nvme keeps Adam's moments in files on a "
                    "node-local NVMe drive, but no directory is given", "set zero.nvme_path to a node-local NVMe "
                    "mount, e.g. zero.nvme_path=/raid/$USER/hpctrain (DGX: the RAID-0 of data drives at /raid)")
        if z.nvme_chunk_mb < 1:
            r.error("zero.nvme_chunk_mb", f"must be >= 1 MiB, got {z.nvme_chunk_mb}", "use zero.nvme_chunk_mb=64")
    if lay.dp_replicate > 1 and z.stage < 2:
        r.error("parallel.dp_replicate", "HSDP (replicate across groups, shard inside) needs ZeRO stage 2 or 3",
                "set zero.stage=3, or parallel.dp_replicate=1")
    if z.stage > 0 and lay.zero_shard == 1:
        r.warn("zero.stage", f"ZeRO stage {z.stage} with dp=1" + (" and cp=1" if lay.cp == 1 else "")
               + " shards nothing", "use zero=stage0")
    for key, value in {"zero.reduce_bucket_size": z.reduce_bucket_size,
                       "zero.allgather_bucket_size": z.allgather_bucket_size}.items():
        if value < 1_000_000:
            r.error(key, f"{value} bytes is too small: thousands of tiny collectives per step",
                    f"use at least 1e6 bytes (typical: 2.5e7 to 5e8); {key}=25000000")
    if lay.accumulate_unsharded and (lay.zero_stage < 2 or lay.pp > 1 or lay.grad_accum == 1):
        r.warn("zero.accumulate_unsharded", "changes nothing here: it makes ZeRO-2/3 accumulate gradients unsharded "
               "over micro-batches, which ZeRO-1 and every stage under PP (torch's schedules) do anyway, and one "
               "micro-batch has nothing to accumulate", "leave zero.accumulate_unsharded=false")
    if z.stage == 3 and lay.pp > 1:
        r.warn("zero.stage", "ZeRO-3 with pipeline parallelism re-gathers each stage's parameters for every "
               "microbatch (DeepSpeed does not allow it; Megatron uses ZeRO-1 with PP)",
               "consider zero=stage1 with pp>1, unless memory needs stage 3")


def _precision(cfg: Config, lay: Layout, r: CheckReport) -> None:
    pr = cfg.precision
    if pr.dtype == DType.fp16 and not pr.loss_scaling:
        r.error("precision.loss_scaling", "fp16 without loss scaling: small gradients underflow to zero and "
                "training silently stalls", "set precision.loss_scaling=true (or precision=fp16), or use precision=bf16")
    if pr.dtype != DType.fp16 and pr.loss_scaling:
        r.warn("precision.loss_scaling", f"loss scaling does nothing useful with {pr.dtype.value}",
               "set precision.loss_scaling=false")
    if pr.loss_scaling:
        if pr.initial_scale < pr.min_scale or pr.min_scale <= 0:
            r.error("precision.initial_scale", f"initial_scale={pr.initial_scale} must be >= min_scale="
                    f"{pr.min_scale} > 0", "use e.g. precision.initial_scale=65536 precision.min_scale=1")
        if pr.loss_scale_window < 1:
            r.error("precision.loss_scale_window", f"must be >= 1, got {pr.loss_scale_window}",
                    "use precision.loss_scale_window=1000")
    if pr.reduce_dtype == DType.fp16:
        r.warn("precision.reduce_dtype", "fp16 gradient reductions over many ranks overflow or lose precision",
               "set precision.reduce_dtype=fp32")


FP8_RECIPES = ("tensorwise", "rowwise")  # hpctrain.parallel.float8.RECIPES (config imports no torch)
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: FP8 GEMM dimensions are multiples of 16


def _fp8(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """precision.fp8 (torchao Float8Linear, docs/fp8.md): a known recipe, a GPU with FP8 tensor cores, bf16 (or
    fp32) around it, and block Linears whose every TP shard FP8 GEMMs can take."""
    recipe, m, tp = str(cfg.precision.fp8), cfg.model, lay.tp
    if recipe == "none":
        return
    if recipe not in FP8_RECIPES:
        r.error("precision.fp8", f"unknown FP8 recipe {recipe!r}", f"use precision.fp8=none, or one of "
                f"{', '.join(FP8_RECIPES)} (tensorwise: fastest; rowwise: more accurate)")
        return
    gpu, hw = cfg.cluster.gpu_type, KNOWN_HARDWARE.get(cfg.cluster.gpu_type)
    if gpu == "cpu":
        r.warn("precision.fp8", "gpu_type=cpu: torchao emulates FP8 (the same casts and scales, products in high "
               "precision): numerics only, slower than bf16", "use precision.fp8=none for speed on CPU")
        if cfg.parallel.compile:
            r.error("parallel.compile", "torchao's FP8 emulation (gpu_type=cpu) does not support torch.compile",
                    "set parallel.compile=false, or precision.fp8=none")
    elif hw is not None and not hw.has_fp8:
        fp8_gpus = ", ".join(sorted(name for name, h in KNOWN_HARDWARE.items() if h.has_fp8))
        r.error("precision.fp8", f"cluster.gpu_type={gpu} has no FP8 tensor cores (FP8 GEMMs need compute "
                "capability 8.9 or newer: Ada, Hopper, Blackwell)",
                f"set precision.fp8=none (bf16 is this GPU's fastest), or run on {fp8_gpus}")
    elif not cfg.parallel.compile:
        r.warn("parallel.compile", f"precision.fp8={recipe} eager: each Float8Linear casts, takes the amax and "
               "scales in kernels of their own, around every GEMM; torchao's own figures show FP8 faster than bf16 "
               "only compiled (fused), and eager it is slower. The plan's step time assumes the compiled speed-up",
               "set parallel.compile=true (tools/gpu_check.py's f8 and fp8x rows measure both on your GPU)")
    dtype = cfg.precision.dtype
    if dtype == DType.fp16:
        r.error("precision.dtype", "FP8 with fp16: fp16's loss scaling and FP8's own per-tensor scaling would both "
                "rescale the gradients; torchao's recipes (and torchtitan's) train FP8 around bf16",
                "set precision=bf16 (no loss scaling needed)")
    elif dtype == DType.fp32:
        r.warn("precision.dtype", "FP8 with fp32: the Linears run in FP8, everything else (attention, norms, "
               "the head) in fp32, far slower than bf16", "set precision=bf16")
    widths = {"model.d_model": m.d_model, "model.ffn_hidden": ffn_hidden_of(m)}
    if family_of(m).grouped_query and m.n_heads >= 1 and (m.head_dim or m.d_model % m.n_heads == 0):
        widths["model.n_kv_heads"] = Dims.of(m).kv_dim  # K and V width (GQA)
    for key, width in widths.items():
        if width % tp == 0 and (width // tp) % FP8_DIM_MULTIPLE == 0:
            continue
        what = {"model.d_model": "d_model", "model.ffn_hidden": "the MLP hidden size",
                "model.n_kv_heads": "the key/value width (n_kv_heads x head_dim)"}[key]
        shard = f" / tp {tp} = {width / tp:g}" if tp > 1 else ""
        r.error(key, f"{what} {width}{shard} is not a multiple of {FP8_DIM_MULTIPLE}: FP8 GEMMs "
                f"(torch._scaled_mm) need both dimensions of every block Linear's {'TP shard' if tp > 1 else 'weight'} "
                f"to be multiples of {FP8_DIM_MULTIPLE}",
                f"choose {key} so that it is a multiple of {FP8_DIM_MULTIPLE * tp}, or set precision.fp8=none")


def _optim(cfg: Config, lay: Layout, r: CheckReport) -> None:
    o, t = cfg.optim, cfg.train
    if o.name != "adamw":
        r.error("optim.name", f"unknown optimizer {o.name!r}", "use optim.name=adamw")
    if o.lr <= 0:
        r.error("optim.lr", f"must be > 0, got {o.lr}", "use e.g. optim.lr=3e-4")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        r.error("optim.min_lr_ratio", f"must be in [0, 1] (a fraction of optim.lr), got {o.min_lr_ratio}",
                "use e.g. optim.min_lr_ratio=0.1")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        r.error("optim.betas", f"must be two numbers in [0, 1), got {list(o.betas)}", "use optim.betas=[0.9,0.95]")
    if o.warmup_steps < 0:
        r.error("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}",
                f"use e.g. optim.warmup_steps={max(0, t.max_steps // 10)}")
    elif o.warmup_steps > t.max_steps:  # a short trial run of a long config: the lr is still ramping at the end
        r.warn("optim.warmup_steps", f"warmup ({o.warmup_steps} steps) is longer than the run (train.max_steps="
               f"{t.max_steps}): the learning rate never reaches optim.lr={o.lr:g}",
               f"use e.g. optim.warmup_steps={max(0, t.max_steps // 10)} for a run this short")
    if o.decay not in ("cosine", "linear", "constant"):
        r.error("optim.decay", f"unknown decay {o.decay!r}", "use cosine, linear or constant")
    if o.grad_clip < 0:
        r.error("optim.grad_clip", f"must be >= 0 (0 disables clipping), got {o.grad_clip}", "use optim.grad_clip=1.0")
    if o.weight_decay < 0:
        r.error("optim.weight_decay", f"must be >= 0, got {o.weight_decay}", "use e.g. optim.weight_decay=0.1")
    if o.eps < 0:
        r.error("optim.eps", f"must be >= 0, got {o.eps}", "use optim.eps=1e-8")


def _train_and_data(cfg: Config, lay: Layout, r: CheckReport) -> None:
    t, d, m = cfg.train, cfg.data, cfg.model
    if t.max_steps < 1:
        r.error("train.max_steps", f"must be >= 1, got {t.max_steps}", "set train.max_steps to the number of steps")
    elif t.max_steps > MAX_STEPS:
        r.error("train.max_steps", f"{t.max_steps} is more than {MAX_STEPS:,} steps: the progress line's time to go "
                "(a datetime.timedelta, at most 999,999,999 days) overflows at the first steps, and no run takes "
                "that many (Llama 3 405B: about 1.2 million)", f"set train.max_steps<={MAX_STEPS}, the steps this "
                "run is to take")
    if not 0 <= t.seed < MAX_SEED:
        r.error("train.seed", f"must be in [0, 2**32), got {t.seed}: the data order's seeds are derived from it "
                "(seed x 1,000,003 + sample) and must stay within 64 bits", "use e.g. train.seed=1234")
    if t.seq_len < 1 or t.seq_len > m.context:
        r.error("train.seq_len", f"sequence length {t.seq_len} must be in [1, model.context={m.context}]: "
                "positions beyond the context have no embedding", f"set train.seq_len<={m.context}")
    if t.log_every < 1:
        r.error("train.log_every", f"must be >= 1, got {t.log_every}", "use train.log_every=10")
    if d.vocab_size > m.vocab_size:
        r.error("data.vocab_size", f"the data uses {d.vocab_size} token ids but model.vocab_size={m.vocab_size}",
                f"set model.vocab_size>={d.vocab_size} or use data matching the model's tokenizer")
    if d.kind == DataKind.text_bytes and d.vocab_size != 256:
        r.error("data.vocab_size", f"text_bytes data is byte-level (256 ids), got {d.vocab_size}",
                "set data.vocab_size=256")
    if d.kind == DataKind.tokens:
        if d.token_dtype not in ("uint16", "uint32"):
            r.error("data.token_dtype", f"must be uint16 or uint32, got {d.token_dtype!r}", "set data.token_dtype=uint16")
        elif d.token_dtype == "uint16" and d.vocab_size > 65536:
            r.error("data.token_dtype", f"uint16 cannot hold {d.vocab_size} token ids", "set data.token_dtype=uint32")
        if OmegaConf.is_missing(d, "path") or not d.path:
            r.error("data.path", "data=tokens needs the path of a pre-tokenised .bin file",
                    "set data.path=/path/to/train.bin")
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
                r.error("data.blend", "data=indexed needs the prefix of a Megatron-format dataset (PREFIX.bin + "
                        "PREFIX.idx), or several with weights", "set data.blend=/data/pile_text_document or "
                        "data.blend='0.3 /data/a 0.7 /data/b' (make one with python -m hpctrain.data.prepare)")
            continue
        try:
            pairs = parse_blend(text)
        except ValueError as exc:
            r.error(f"data.{key}", str(exc), f"set data.{key}='0.3 /data/a_text_document 0.7 /data/b_text_document'")
            continue
        weights = [w for w, _ in pairs]
        if not all(math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
            bad = next((f"the weight of {p} is {w:g}" for w, p in pairs if not math.isfinite(w)),
                       f"the weights add up to {sum(weights):g}")
            r.error(f"data.{key}", f"{bad}: weights must be finite positive numbers (each dataset's share is its "
                    "weight over their sum)", f"set data.{key}='0.3 /data/a_text_document 0.7 /data/b_text_document'")
            continue
        if prepare and key == "blend":
            if len(pairs) != 1:
                r.error("data.prepare.inputs", f"data.prepare makes one dataset, but data.blend names {len(pairs)}",
                        "set data.blend to the one prefix data.prepare writes, or prepare each with "
                        "python -m hpctrain.data.prepare")
            continue  # made on the login node before the job starts
        for _, prefix in pairs:
            missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.exists(f"{prefix}{ext}")]
            if missing:
                (r.warn if dry_run else r.error)(f"data.{key}", f"{' and '.join(missing)} not found on this machine",
                                                 "check the prefix (without .bin/.idx); it must be readable from "
                                                 "every node, or make it with python -m hpctrain.data.prepare")
    for source in prepare:
        if source != "stdlib" and not os.path.exists(source):
            r.error("data.prepare.inputs", f"{source} does not exist", "name text or jsonl files, directories, "
                    "a saved datasets directory, or stdlib")
    if prepare and d.prepare.tokenizer and not os.path.exists(d.prepare.tokenizer):
        r.error("data.prepare.tokenizer", f"{d.prepare.tokenizer} does not exist",
                "give a tokenizers tokenizer.json, or leave it unset to train a byte-level BPE on the inputs")
    if d.valid_blend and d.valid_fraction:
        r.error("data.valid_fraction", "both data.valid_blend and data.valid_fraction hold out validation data",
                "keep one: data.valid_fraction=0 to validate on data.valid_blend")


def _validation(t: TrainConfig, d: DataConfig, r: CheckReport) -> None:
    if not 0.0 <= d.valid_fraction < 1.0:
        r.error("data.valid_fraction", f"must be in [0, 1), got {d.valid_fraction}", "use e.g. data.valid_fraction=0.01")
    if d.valid_blend and d.kind != DataKind.indexed:
        r.error("data.valid_blend", f"validation prefixes are for data=indexed, not {d.kind.value}",
                "use data.valid_fraction to hold out part of this data")
    if d.prefetch < 0:
        r.error("data.prefetch", f"must be >= 0 steps, got {d.prefetch}", "use data.prefetch=1 (0: no read-ahead)")
    if t.eval_every < 0:
        r.error("train.eval_every", f"must be >= 0 (0: no validation), got {t.eval_every}", "use e.g. train.eval_every=100")
    elif t.eval_every:
        if t.eval_batches < 1:
            r.error("train.eval_batches", f"must be >= 1, got {t.eval_batches}", "use e.g. train.eval_batches=4")
        if not d.valid_fraction and not d.valid_blend:
            r.error("train.eval_every", f"validation every {t.eval_every} steps, but no validation data is held out",
                    "set data.valid_fraction=0.01 (the last 1% of the documents), or data.valid_blend (indexed)")


def _checkpoint(cfg: Config, lay: Layout, r: CheckReport) -> None:
    ck = cfg.checkpoint
    names = [t.name for t in ck.tiers]
    if len(set(names)) != len(names):
        r.error("checkpoint.tiers", f"tier names must be unique, got {names}", "give each tier its own name")
    for i, tier in enumerate(ck.tiers):
        key = f"checkpoint.tiers[{i}]"
        if tier.keep_last < 1:
            r.error(f"{key}.keep_last", f"must be >= 1, got {tier.keep_last}: the newest checkpoint would be "
                    "deleted", f"set {key}.keep_last=1 or more")
        if not os.path.isabs(str(tier.path)) and _leaves(str(tier.path)):
            r.error(f"{key}.path", f"{tier.path!r} leads out of the run directory (a relative tier path is inside "
                    "it)", f"use a path inside the run directory (e.g. {key}.path=checkpoints), or an absolute one "
                    "(the run id is appended to it)")
        if tier.interval_steps < 0 or tier.interval_minutes < 0:
            r.error(key, "intervals must be >= 0", f"set {key}.interval_steps or interval_minutes to a positive value")
        if ck.enabled and tier.interval_steps == 0 and tier.interval_minutes == 0 and not ck.save_final:
            r.warn(key, f"tier {tier.name!r} has no interval and nothing is saved at the end",
                   f"set {key}.interval_steps")
    if ck.write_threads < 1:
        r.error("checkpoint.write_threads", f"must be >= 1, got {ck.write_threads}", "use checkpoint.write_threads=2")
    if cfg.cluster.failure_rate_per_gpu_day < 0:
        r.error("cluster.failure_rate_per_gpu_day", f"must be >= 0, got {cfg.cluster.failure_rate_per_gpu_day}",
                "use the cluster's measured rate, e.g. 0.001 (0.1% of GPUs fail per day)")
    if ck.when_busy not in ("skip", "wait"):
        r.error("checkpoint.when_busy", f"must be skip or wait, got {ck.when_busy!r}", "use checkpoint.when_busy=skip")
    if ck.enabled and not ck.tiers:
        r.error("checkpoint.tiers", "checkpointing is enabled but no tier is listed",
                "use checkpoint=default, or checkpoint=none")


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
    if not run.lease_check_s > 0:
        r.error("run.lease_check_s", f"must be > 0 seconds, got {run.lease_check_s}: rank 0 re-reads the run's lease "
                "this often to notice a newer attempt", "use run.lease_check_s=1")
    name = "" if run.name is None else str(run.name)
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or os.path.isabs(name) or ".." in parts:
        r.error("run.name", f"{name!r} would put the run directory outside run.root={run.root} (run directories are "
                "run.root/run.name/run.id)" if parts else f"{name!r} names no directory under run.root",
                "use a plain name, e.g. run.name=gpt3_1.3b (a/b makes a subdirectory); change run.root to write "
                "elsewhere")
    elif not _inside(run.root, name):
        r.error("run.name", f"run.root/{name} resolves outside run.root={run.root} (a symbolic link)",
                "use a run.name whose directory is inside run.root, or change run.root")
    if run.id is None:
        return
    rid = str(run.id)
    if not rid or rid in (".", "..") or "/" in rid or "\\" in rid or os.sep in rid:
        r.error("run.id", f"{rid!r} is not a directory name: the run directory is run.root/run.name/run.id, and "
                "an id must be one directory inside it", "use a plain id such as run.id=baseline-1 (or leave "
                "it unset for a fresh one; run.resume=PATH continues a run by its path)")
    elif parts and ".." not in parts and not os.path.isabs(name) and not _inside(run.root, name, rid):
        r.error("run.id", f"run.root/{name}/{rid} resolves outside run.root={run.root} (a symbolic link)",
                "use another run.id, or change run.root")


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
        r.error("dry_run", f"must be true, false or simulate, got {cfg.dry_run!r}",
                "dry_run=true prints the plan; dry_run=simulate also builds one rank of the job on fake tensors")
        return
    rank = cfg.plan.simulate_rank
    if rank is not None and not 0 <= rank < lay.world_size:
        r.error("plan.simulate_rank", f"{rank} is not a rank of this {lay.world_size}-rank job",
                f"set plan.simulate_rank to 0..{lay.world_size - 1}, or leave it out for the planner's most loaded rank")
    if not simulating(cfg):
        return
    if data_parallel_kind(lay) == "ddp":
        r.error("dry_run", "simulate builds FSDP2 layouts; zero.stage=0 with DP alone runs DDP, whose C++ reducer "
                "needs real memory for its buckets, which fake tensors do not have",
                "dry_run=true gives DDP's memory (the planner's closed form); or simulate zero.stage=1 (FSDP2)")
    if lay.offload_device == "nvme" and (lay.offload_optimizer or lay.offload_params):
        r.error("dry_run", "simulate cannot run Adam's moments on NVMe: fake tensors have no bytes to write",
                "simulate with zero.offload_optimizer_device=cpu (the GPU side is the same), or use dry_run=true")
    if cfg.parallel.compile:
        r.error("dry_run", "simulate runs the model eagerly: torch.compile on fake tensors is not simulated",
                "add parallel.compile=false to the simulation (compilation changes kernels, not what is stored)")


CHECKS: list[Callable[[Config, Layout, CheckReport], None]] = [
    _dry_run, _finite_numbers, _model_shape, _experts, _tensor_parallel, _context_parallel, _pipeline, _zero,
    _precision, _fp8, _optim, _train_and_data, _run_paths, *cluster_checks, _checkpoint,
]
