"""A DeepSpeed config (`ds_config.json`) read as hpctrain settings: `+deepspeed=PATH` on the command line, or
`tools/from_deepspeed.py PATH` to print the equivalent overrides.

Every key of the file ends in exactly one of three lists, so nothing is dropped without a word:
- `overrides`: the hpctrain key it sets, and the value (converted: DeepSpeed's bucket sizes count elements,
  hpctrain's count bytes; `initial_scale_power` is a power of two);
- `same`: a setting whose value is what hpctrain does anyway (`overlap_comm: true`, `contiguous_gradients`);
- `unmapped`: no equivalent, with the reason and, where there is one, the nearest hpctrain setting.
Keys are read as DeepSpeed reads them: the legacy `"bfloat16"` section when there is no `"bf16"`,
`communication_data_type: "bfp16"` (its spelling before 0.14.1), `activation_checkpointing` as the settings of a
recomputation the model's code turns on (a flag that acts only on recomputed layers says the run recomputes; all
off, nothing is recomputed). A value DeepSpeed refuses is a `ConfigError` naming the key, never a traceback.
`"auto"` (Hugging Face's convention) takes hpctrain's own value, the ZeRO stage's too. The batch keys are checked
against each other as DeepSpeed checks them (`train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel size`), the data-parallel size being the composed layout's.

Pure: a dict and the composed config in, a `Translation` out (config errors as `ConfigError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.bounded import Unreadable, read_text
from hpctrain.config.problems import ConfigError, Problem

if TYPE_CHECKING:
    from hpctrain.config.schema import Config

AUTO = "auto"
MAX_BATCH = 2**31 - 1  # hpctrain.checks.config.MAX_COUNT: the batch keys' bound there too
FP32_MAX_EXPONENT = 127  # a loss scale is an fp32 number: 2^127 is its largest power of two
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# What a DeepSpeed dtype name is in hpctrain (communication_data_type and friends).
# "bfp16" is DeepSpeed's own spelling of bf16 for communication_data_type before 0.14.1 (its PR #5297).
DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bfp16": "bf16",
}


@dataclass
class Translation:
    overrides: dict[str, Any] = field(default_factory=dict)  # hpctrain key -> value
    sources: dict[str, list[str]] = field(default_factory=dict)  # hpctrain key -> the DeepSpeed keys it came from
    notes: dict[str, str] = field(default_factory=dict)  # hpctrain key -> how the value was converted
    same: dict[str, str] = field(default_factory=dict)  # DeepSpeed key -> why nothing needs setting
    unmapped: dict[str, str] = field(default_factory=dict)  # DeepSpeed key -> why, and the nearest setting

    def command_line(self) -> list[str]:
        """The overrides as `python -m hpctrain` arguments."""
        return [f"{key}={_hydra_value(value)}" for key, value in self.overrides.items()]

    def report(self) -> str:
        lines = [
            f"{key}={_hydra_value(value)}  <- {', '.join(self.sources[key]) or 'DeepSpeed batch arithmetic'}"
            + (f" ({self.notes[key]})" if key in self.notes else "")
            for key, value in self.overrides.items()
        ]
        lines += [f"(same as hpctrain) {key}: {why}" for key, why in self.same.items()]
        lines += [f"(no equivalent) {key}: {why}" for key, why in self.unmapped.items()]
        return "\n".join(lines)


def load(path: str | Path) -> dict[str, Any]:
    """The file as a dict; a missing file, one that is not a regular file of at most `bounded.CONFIG_BYTES`
    (`+deepspeed=/dev/zero` read 11.4 GB in 30 s before this limit, a FIFO blocked), or bad JSON is a config error
    naming it."""
    p = Path(path).expanduser()
    fix = "give the path of a DeepSpeed config JSON (a text file of a few kilobytes, e.g. ds_config.json)"
    try:
        text = read_text(p)
    except Unreadable as exc:
        raise ConfigError([Problem("deepspeed", str(exc), fix)]) from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [Problem("deepspeed", f"{p} is not JSON: {exc}", "fix the file (DeepSpeed reads it too)")]
        ) from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity, a number of thousands of digits, deep nesting
        what = "is nested too deeply" if isinstance(exc, RecursionError) else f"holds {exc}"
        raise ConfigError(
            [
                Problem(
                    "deepspeed",
                    f"{p} {what}: not a DeepSpeed config",
                    "fix the file: DeepSpeed's settings are finite numbers, strings and booleans in "
                    "a few levels of sections",
                )
            ]
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    "deepspeed",
                    f"{p} holds a {type(data).__name__}, not an object",
                    "a DeepSpeed config is one JSON object",
                )
            ]
        )
    return data


def _no_constant(name: str) -> Any:
    """json's NaN, Infinity and -Infinity (Python's json reads them; no DeepSpeed setting is one)."""
    raise ValueError(f"{name}, which is not a number a setting can take")


def translate(ds: dict[str, Any], cfg: Config) -> Translation:
    """The hpctrain settings of a DeepSpeed config, given the composed hpctrain config (`cfg`)."""
    t = _Import(ds, cfg)
    for section, step in (
        ("batch keys", t.batch),
        ("fp16/bf16", t.precision),
        ("zero_optimization", t.zero),
        ("optimizer", t.optimizer),
        ("scheduler", t.scheduler),
        ("other keys", t.rest),
    ):
        try:
            step()
        # a value of the wrong kind, or a number beyond a float's range: said, not a traceback
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            raise ConfigError(
                [
                    Problem(
                        f"deepspeed ({section})",
                        f"a value this importer cannot read: {exc}",
                        "fix the value in the file (a number where DeepSpeed takes a number, "
                        '"auto" for hpctrain\'s own)',
                    )
                ]
            ) from exc
    leftover = sorted(set(leaves(ds)) - t.seen)
    for key in leftover:  # a key this importer does not know: said so, never dropped
        t.out.unmapped[key] = "no equivalent in hpctrain (an option this importer does not map)"
    return t.out


def leaves(d: dict[str, Any], prefix: str = "") -> list[str]:
    """Every key path of the file, a section's keys one by one (a list value is one leaf)."""
    out = []
    for key, value in d.items():
        path = f"{prefix}{key}"
        out += leaves(value, path + ".") if isinstance(value, dict) and value else [path]
    return out


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


class _Import:
    def __init__(self, ds: dict[str, Any], cfg: Config) -> None:
        self.ds, self.cfg, self.out = ds, cfg, Translation()
        self.seen: set[str] = set()

    # -- bookkeeping: every DeepSpeed key read goes to exactly one list
    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.ds
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def set(self, key: str, value: Any, *sources: str, note: str = "") -> None:
        self.out.overrides[key] = value  # a later key wins (the scheduler's peak over the optimizer's lr)
        self.out.sources[key] = [*self.out.sources.get(key, []), *sources]
        self.seen.update(sources)
        if note:
            self.out.notes[key] = note

    def same(self, path: str, why: str) -> None:
        if self.get(path) is not None:
            self.out.same[path] = why
            self.seen.add(path)

    def skip(self, path: str, why: str) -> None:
        if self.get(path) is not None:
            self.out.unmapped[path] = why
            self._seen_under(path)

    def _offload_optimizer(self, section: str, device: str) -> None:
        """device cpu: host memory; nvme: Adam's moments in files under nvme_path (zero.offload_optimizer_device)."""
        self.set("zero.offload_optimizer", device in ("cpu", "nvme"), f"{section}.device")
        if device == "nvme":
            self.set("zero.offload_optimizer_device", "nvme", f"{section}.device")
            if self.get(f"{section}.nvme_path") is not None:
                self.set("zero.nvme_path", str(self.get(f"{section}.nvme_path")), f"{section}.nvme_path")
        self.same(f"{section}.pipeline_read", "hpctrain always reads the next chunk while it updates this one")
        self.same(f"{section}.pipeline_write", "hpctrain always writes a chunk back while it updates the next")
        self.skip(
            f"{section}.buffer_count",
            "hpctrain streams through three buffers (read, update, write), each "
            "holding both of Adam's moments for zero.nvme_chunk_mb MiB of each",
        )
        self.skip(
            f"{section}.fast_init",
            "the moments' file starts sparse (zeros, as AdamW's state does): nothing to initialise",
        )

    def _seen_under(self, path: str) -> None:
        value = self.get(path)
        self.seen.update(
            [path] if not isinstance(value, dict) or not value else [f"{path}.{leaf}" for leaf in leaves(value)]
        )

    def by_value(self, path: str, same_if: Any, same_why: str, other_why: str) -> None:
        """`path` is what hpctrain does when it equals `same_if`; otherwise it has no equivalent."""
        value = self.get(path)
        if value is None:
            return
        if value == same_if:
            self.same(path, same_why)
        else:
            self.skip(path, other_why)

    # -- the sections
    def batch(self) -> None:
        """DeepSpeed's batch arithmetic (its `_configure_train_batch_size`), "auto" taking hpctrain's value."""
        c = self.cfg
        world = int(c.cluster.nodes) * int(c.cluster.gpus_per_node)
        model_parallel = int(c.parallel.tp) * int(c.parallel.pp)
        dp = int(c.parallel.dp) if int(c.parallel.dp) > 0 else max(1, world // model_parallel)
        global_batch, micro = int(c.train.global_batch), int(c.train.micro_batch)
        accum = int(c.train.grad_accum) if int(c.train.grad_accum) > 0 else max(1, global_batch // max(1, micro * dp))
        own = {
            "train_batch_size": global_batch,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
        }
        given = {}
        for key, mine in own.items():
            value = self.get(key)
            if value is None:
                continue
            self.seen.add(key)
            if value == AUTO:
                given[key] = mine
                self.out.same[key] = f"auto: hpctrain's value, {mine}"
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError([Problem(f"deepspeed.{key}", f"is {value!r}", 'a positive integer, or "auto"')])
            elif value > MAX_BATCH:
                raise ConfigError(
                    [
                        Problem(
                            f"deepspeed.{key}",
                            f"is {value:,}, more than {MAX_BATCH:,} sequences: no "
                            "GPU holds such a batch (a sample index beyond 32-bit integers)",
                            'give the batch in sequences (e.g. 1 to 64 per GPU), or "auto"',
                        )
                    ]
                )
            else:
                given[key] = value
        tb, mb, gas = (given.get(k) for k in own)
        where = f"data-parallel size {dp} (cluster.nodes x cluster.gpus_per_node / (parallel.tp x parallel.pp))"
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * dp:
                raise ConfigError(
                    [
                        Problem(
                            "deepspeed.train_batch_size",
                            f"{tb} != train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {gas} "
                            f"x {where}",
                            "make the three agree (DeepSpeed refuses this file too), or give two of them",
                        )
                    ]
                )
        elif tb is not None and mb is not None:
            gas = self._divide(tb, mb * dp, "train_batch_size", f"train_micro_batch_size_per_gpu {mb} x {where}")
        elif tb is not None and gas is not None:
            mb = self._divide(tb, gas * dp, "train_batch_size", f"gradient_accumulation_steps {gas} x {where}")
        elif mb is not None and gas is not None:
            tb = mb * gas * dp
        elif tb is not None:
            gas, mb = 1, self._divide(tb, dp, "train_batch_size", where)
        elif mb is not None:
            gas, tb = 1, mb * dp
        else:
            return  # neither: hpctrain's own batch
        sources = [k for k in own if k in given and self.get(k) != AUTO]  # "auto" ones are listed as such
        self.set("train.global_batch", tb, *sources)
        self.set("train.micro_batch", mb, *sources)
        self.set("train.grad_accum", gas, *sources)

    @staticmethod
    def _divide(total: int, by: int, key: str, what: str) -> int:
        if total % by:
            raise ConfigError(
                [
                    Problem(
                        f"deepspeed.{key}",
                        f"{total} is not a multiple of {what} = {by}",
                        "DeepSpeed refuses this file too: change the batch or the layout",
                    )
                ]
            )
        return total // by

    def _enabled(self, section: str, other_explicit: bool, dtype: str) -> bool:
        """Whether a precision section (fp16, bf16/bfloat16) is on: true, false (DeepSpeed's default), or "auto"
        (Hugging Face's: the trainer's own choice), which takes hpctrain's precision.dtype unless the other
        section is explicitly on."""
        value = self.get(f"{section}.enabled", False)
        if value == AUTO:
            return _value(self.cfg.precision.dtype) == dtype and not other_explicit
        if not isinstance(value, bool):
            raise ConfigError([Problem(f"deepspeed.{section}.enabled", f"is {value!r}", 'true, false or "auto"')])
        return value

    def _auto_off(self, dtype: str, other_on: bool) -> str:
        if other_on:
            return f"auto: off, the file enables {'bf16' if dtype == 'fp16' else 'fp16'}"
        return (
            f"auto: hpctrain's precision.dtype, {_value(self.cfg.precision.dtype)}, not {dtype} "
            f"(precision.dtype={dtype} trains in {dtype}, as Hugging Face's --{dtype} fills this in)"
        )

    def precision(self) -> None:
        # DeepSpeed reads the legacy "bfloat16" section when there is no "bf16" (precision_config.get_bfloat16_config)
        bf = "bfloat16" if self.get("bf16") is None and self.get("bfloat16") is not None else "bf16"
        legacy = (
            'the legacy "bfloat16" section, which DeepSpeed reads when there is no "bf16"' if bf == "bfloat16" else ""
        )
        if bf == "bf16":
            self.skip(
                "bfloat16",
                'DeepSpeed reads the "bf16" section when both are there: this legacy one is ignored (by DeepSpeed too)',
            )
        fp16, bf16 = (self.get(k) if isinstance(self.get(k), dict) else {} for k in ("fp16", bf))
        fp16_on = self._enabled("fp16", bf16.get("enabled") is True, "fp16")
        bf16_on = self._enabled(bf, fp16.get("enabled") is True, "bf16")
        if fp16_on and bf16_on:
            raise ConfigError([Problem("deepspeed.fp16", f"fp16 and {bf} are both enabled", "enable one")])
        if fp16_on:
            if fp16.get("enabled") == AUTO:
                self.same("fp16.enabled", "auto: hpctrain's precision.dtype, fp16")
            else:
                self.set("precision.dtype", "fp16", "fp16.enabled")
                self.set("precision.loss_scaling", True, "fp16.enabled")
            scale = fp16.get("loss_scale", 0)
            if scale:
                self.set(
                    "precision.initial_scale",
                    float(scale),
                    "fp16.loss_scale",
                    note=f"a static scale in DeepSpeed; hpctrain's is dynamic: it starts at {scale} and halves "
                    "on an overflow",
                )
            else:
                self.same("fp16.loss_scale", "0: dynamic loss scaling, as hpctrain's")
            if "initial_scale_power" in fp16:
                power = int(fp16["initial_scale_power"])
                if abs(power) > FP32_MAX_EXPONENT:  # 2 ** 10**18 would take all memory before it failed
                    raise ConfigError(
                        [
                            Problem(
                                "deepspeed.fp16.initial_scale_power",
                                f"is {power}: 2^{power} is beyond "
                                f"fp32's range (2^-{FP32_MAX_EXPONENT} to 2^{FP32_MAX_EXPONENT})",
                                "use DeepSpeed's default, 16 (a first scale of 65536)",
                            )
                        ]
                    )
                self.set(
                    "precision.initial_scale",
                    float(2**power),
                    "fp16.initial_scale_power",
                    note=f"2^{int(fp16['initial_scale_power'])}",
                )
            if "loss_scale_window" in fp16:
                self.set("precision.loss_scale_window", int(fp16["loss_scale_window"]), "fp16.loss_scale_window")
            if "min_loss_scale" in fp16:
                self.set("precision.min_scale", float(fp16["min_loss_scale"]), "fp16.min_loss_scale")
            self.by_value(
                "fp16.hysteresis",
                1,
                "hpctrain halves the scale at the first overflow",
                "hpctrain halves the scale at the first overflow (hysteresis 1)",
            )
            self.skip("fp16.consecutive_hysteresis", "hpctrain has no hysteresis: the first overflow halves the scale")
            self.skip(
                "fp16.fp16_master_weights_and_grads",
                "hpctrain keeps fp32 master weights and gradients (Adam: 16 bytes per parameter with its moments)",
            )
            self.skip("fp16.auto_cast", "hpctrain casts the model itself (FSDP2 mixed precision or autocast)")
        elif fp16:
            self.same("fp16.enabled", "disabled" if fp16.get("enabled") != AUTO else self._auto_off("fp16", bf16_on))
            for key in fp16:
                if key != "enabled":
                    self.same(f"fp16.{key}", "fp16 is not enabled: no effect")
        if bf16_on:
            if bf16.get("enabled") == AUTO:
                self.same(f"{bf}.enabled", "auto: hpctrain's precision.dtype, bf16")
            else:
                self.set("precision.dtype", "bf16", f"{bf}.enabled", note=legacy)
                self.set("precision.loss_scaling", False, f"{bf}.enabled")
        elif bf16:
            self.same(f"{bf}.enabled", "disabled" if bf16.get("enabled") != AUTO else self._auto_off("bf16", fp16_on))
        for key in bf16:
            if key == "enabled":
                continue
            if not bf16_on:
                self.same(f"{bf}.{key}", "bf16 is not enabled: no effect")
            elif "scale" in key or "overflow" in key:
                self.skip(f"{bf}.{key}", "bf16 needs no loss scaling: ignored (as DeepSpeed ignores it)")
            else:
                self.skip(
                    f"{bf}.{key}",
                    "hpctrain keeps fp32 master weights, gradients and optimizer state, and "
                    "applies each step's update at once",
                )
        self.skip("amp", "NVIDIA Apex AMP: hpctrain's mixed precision is fp16 or bf16 (precision.dtype)")
        comm = self.get("communication_data_type")
        if comm is not None:
            name = str(comm).lower()
            if name in DTYPES:
                self.set(
                    "precision.reduce_dtype",
                    DTYPES[name],
                    "communication_data_type",
                    note=f"{comm!r}: older DeepSpeed's spelling of bf16" if name == "bfp16" else "",
                )
            else:
                raise ConfigError(
                    [
                        Problem(
                            "deepspeed.communication_data_type",
                            f"is {comm!r}",
                            "fp32, fp16 or bf16 (DeepSpeed refuses this value too)",
                        )
                    ]
                )
        self.skip("data_types", "gradients accumulate in the master weights' dtype (fp32)")

    def zero(self) -> None:
        z = "zero_optimization"
        if self.get(z) is None:
            return
        if isinstance(self.get(z), bool):  # the oldest form: "zero_optimization": true (stage 1)
            self.set("zero.stage", 1 if self.get(z) else 0, z)
            return
        stage = self.get(f"{z}.stage")
        if stage == AUTO:
            self.same(f"{z}.stage", f"auto: hpctrain's zero.stage, {int(self.cfg.zero.stage)}")
        elif isinstance(stage, bool) or not isinstance(stage, (int, float)) or stage not in (0, 1, 2, 3):
            if stage is not None:
                raise ConfigError(
                    [
                        Problem(
                            f"deepspeed.{z}.stage",
                            f"is {stage!r}",
                            'a ZeRO stage 0, 1, 2 or 3, or "auto" (hpctrain\'s zero.stage)',
                        )
                    ]
                )
        else:
            self.set("zero.stage", int(stage), f"{z}.stage")
        for section, key in (("offload_optimizer", "zero.offload_optimizer"), ("offload_param", "zero.offload_params")):
            device = self.get(f"{z}.{section}.device")
            if device is None:
                continue
            if section == "offload_optimizer":
                self._offload_optimizer(f"{z}.{section}", device)
            else:
                self.set(
                    key,
                    device in ("cpu", "nvme"),
                    f"{z}.{section}.device",
                    note="nvme: parameters offloaded to CPU memory instead (hpctrain puts only the optimizer's "
                    "state on NVMe: FSDP2 all-gathers from the host copy)"
                    if device == "nvme"
                    else "",
                )
                for sub in ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"):
                    self.skip(
                        f"{z}.{section}.{sub}",
                        "a parameter-offload-to-NVMe setting: hpctrain offloads parameters to CPU memory",
                    )
            self.skip(f"{z}.{section}.ratio", "partial offload: hpctrain offloads all of it")
            self.same(f"{z}.{section}.pin_memory", "hpctrain pins offloaded state whenever a GPU is there")
        for legacy, key in (("cpu_offload", "zero.offload_optimizer"), ("cpu_offload_params", "zero.offload_params")):
            if self.get(f"{z}.{legacy}") is not None:
                self.set(key, bool(self.get(f"{z}.{legacy}")), f"{z}.{legacy}")
        reduce_bytes = DTYPE_BYTES[
            str(self.out.overrides.get("precision.reduce_dtype", _value(self.cfg.precision.reduce_dtype)))
        ]
        param_bytes = DTYPE_BYTES[str(self.out.overrides.get("precision.dtype", _value(self.cfg.precision.dtype)))]
        for name, width in (("reduce_bucket_size", reduce_bytes), ("allgather_bucket_size", param_bytes)):
            value = self.get(f"{z}.{name}")
            if value == AUTO:
                self.same(f"{z}.{name}", f"auto: hpctrain's zero.{name}")
            elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(
                    [
                        Problem(
                            f"deepspeed.{z}.{name}",
                            f"is {value!r}",
                            'a number of elements (5e8), or "auto" (hpctrain\'s own)',
                        )
                    ]
                )
            elif value is not None and int(value) > 0:
                self.set(
                    f"zero.{name}", int(value) * width, f"{z}.{name}", note=f"{int(value):,} elements x {width} bytes"
                )
            elif value is not None:
                self.skip(f"{z}.{name}", "0: no bucket size; hpctrain keeps its own")
        self.by_value(
            f"{z}.overlap_comm",
            True,
            "hpctrain always overlaps (DDP buckets, FSDP2 prefetch)",
            "hpctrain always overlaps communication with compute",
        )
        self.by_value(
            f"{z}.contiguous_gradients",
            True,
            "FSDP2 keeps each rank's gradient shard in one flat buffer",
            "FSDP2's gradient shards are contiguous whatever this says",
        )
        self.by_value(
            f"{z}.reduce_scatter",
            True,
            "ZeRO-2/3 reduce-scatter gradients in hpctrain",
            "hpctrain always reduce-scatters sharded gradients",
        )
        self.by_value(
            f"{z}.allgather_partitions",
            True,
            "hpctrain all-gathers each shard in one collective",
            "hpctrain always all-gathers whole partitions",
        )
        self.skip(
            f"{z}.stage3_prefetch_bucket_size",
            "FSDP2 prefetches the next module's parameters: its unit is a module, not a byte count",
        )
        for key in ("stage3_param_persistence_threshold", "stage3_param_persitance_threshold"):
            self.skip(f"{z}.{key}", "FSDP2 shards every wrapped module's parameters; small ones are not kept whole")
        for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
            self.skip(f"{z}.{key}", "FSDP2 frees each module's gathered parameters after use (reshard_after_forward)")
        for key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            self.skip(
                f"{z}.{key}",
                "hpctrain saves sharded DCP checkpoints; `tools/checkpoint.py export` "
                "consolidates the weights (or --format hf)",
            )
        self.skip(
            f"{z}.sub_group_size",
            "the optimizer steps each rank's shard at once (a CPU-offload memory knob in DeepSpeed)",
        )
        self.skip(f"{z}.round_robin_gradients", "a DeepSpeed CPU-offload copy order; FSDP2 has no such setting")
        self.skip(f"{z}.elastic_checkpoint", "DCP checkpoints reshard to any layout on load")
        self.skip(f"{z}.load_from_fp32_weights", "hpctrain always resumes from the fp32 master weights")
        self.skip(f"{z}.ignore_unused_parameters", "every parameter of hpctrain's models is used")
        self.skip(f"{z}.legacy_stage1", "an old DeepSpeed implementation of stage 1")
        mics = self.get(f"{z}.mics_shard_size")
        if isinstance(mics, int) and mics > 0:
            self.skip(
                f"{z}.mics_shard_size",
                f"MiCS: shard within groups of {mics} ranks; the nearest is HSDP, "
                "parallel.dp_replicate = data-parallel size / that",
            )
        self.skip(
            f"{z}.zero_hpz_partition_size",
            "ZeRO++ secondary weight partitions: the nearest is HSDP (parallel.dp_replicate)",
        )
        for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
            self.skip(f"{z}.{key}", "ZeRO++ quantized communication: hpctrain reduces in precision.reduce_dtype")
        self.skip(f"{z}.memory_efficient_linear", "a DeepSpeed ZeRO-3 linear layer; hpctrain's models use nn.Linear")
        self.same(f"{z}.cpu_offload_use_pin_memory", "hpctrain pins offloaded state whenever a GPU is there")

    def optimizer(self) -> None:
        kind = self.get("optimizer.type")
        if kind is None:
            return
        if str(kind).lower() not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
            self.skip(
                "optimizer",
                f"{kind}: hpctrain trains with AdamW (optim.*); the run keeps hpctrain's optimizer settings",
            )
            return
        self.set("optim.name", "adamw", "optimizer.type")
        p = "optimizer.params"
        if self.get(f"{p}.adam_w_mode") is False or (str(kind).lower() == "adam" and self.get(f"{p}.torch_adam")):
            self.skip(
                f"{p}.adam_w_mode" if self.get(f"{p}.adam_w_mode") is False else f"{p}.torch_adam",
                "L2-regularised Adam (weight decay in the gradient): hpctrain's AdamW decays the weights "
                "directly (decoupled), the default of DeepSpeed's Adam too",
            )
        self.same(f"{p}.adam_w_mode", "true: decoupled weight decay, as hpctrain's AdamW")
        for key, target in (("lr", "optim.lr"), ("eps", "optim.eps"), ("weight_decay", "optim.weight_decay")):
            value = self.get(f"{p}.{key}")
            if value == AUTO:
                self.same(f"{p}.{key}", f"auto: hpctrain's {target}")
            elif value is not None:
                self.set(target, float(value), f"{p}.{key}")
        betas = self.get(f"{p}.betas")
        if betas == AUTO:
            self.same(f"{p}.betas", "auto: hpctrain's optim.betas")
        elif betas is not None:
            self.set("optim.betas", [float(b) for b in betas], f"{p}.betas")
        self.by_value(
            f"{p}.bias_correction",
            True,
            "AdamW corrects its moments' bias",
            "hpctrain's AdamW always corrects the moments' bias",
        )
        self.by_value(f"{p}.amsgrad", False, "hpctrain's AdamW is not AMSGrad", "hpctrain's AdamW has no AMSGrad")
        self.skip(f"{p}.torch_adam", "hpctrain uses torch's AdamW (fused on GPUs) already")

    def scheduler(self) -> None:
        kind = self.get("scheduler.type")
        if kind is None:
            return
        p = "scheduler.params"
        if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            self.skip(
                "scheduler",
                f"{kind}: hpctrain's schedule is a linear warmup, then constant, linear or cosine "
                "decay (optim.warmup_steps, optim.decay, optim.min_lr_ratio)",
            )
            return
        self.seen.add("scheduler.type")
        steps = self.get(f"{p}.warmup_num_steps")
        if steps not in (None, AUTO):
            self.set("optim.warmup_steps", int(steps), f"{p}.warmup_num_steps")
        elif steps == AUTO:
            self.same(f"{p}.warmup_num_steps", "auto: hpctrain's optim.warmup_steps")
        peak = self.get(f"{p}.warmup_max_lr")
        if peak not in (None, AUTO):
            self.set("optim.lr", float(peak), f"{p}.warmup_max_lr")
        elif peak == AUTO:
            self.same(f"{p}.warmup_max_lr", "auto: hpctrain's optim.lr")
        low = self.get(f"{p}.warmup_min_lr")
        if kind == "WarmupDecayLR" and low not in (None, AUTO):  # also where the decay ends
            lr = self.out.overrides.get("optim.lr", float(self.cfg.optim.lr))
            self.set(
                "optim.min_lr_ratio",
                float(low) / lr if lr else 0.0,
                f"{p}.warmup_min_lr",
                note="the decay's end, as a share of the peak"
                + ("" if not low else "; hpctrain's warmup still starts from 0"),
            )
        elif low == AUTO:
            self.same(f"{p}.warmup_min_lr", "auto: hpctrain warms up from 0")
        else:
            self.by_value(
                f"{p}.warmup_min_lr",
                0,
                "hpctrain warms up from 0",
                "hpctrain's warmup starts from 0 (lr x 1/warmup_steps at the first step)",
            )
        self.by_value(
            f"{p}.warmup_type",
            "linear",
            "hpctrain warms up linearly",
            "hpctrain warms up linearly (DeepSpeed's default is log)",
        )
        if kind == "WarmupLR":
            self.set("optim.decay", "constant", "scheduler.type")
            if self.get(f"{p}.warmup_type") is None:
                self.out.unmapped["scheduler.params.warmup_type (default)"] = (
                    "DeepSpeed's WarmupLR warms up logarithmically by default; hpctrain linearly"
                )
            return
        total = self.get(f"{p}.total_num_steps")
        if total not in (None, AUTO):
            self.set("train.max_steps", int(total), f"{p}.total_num_steps")
        elif total == AUTO:
            self.same(f"{p}.total_num_steps", "auto: hpctrain's train.max_steps")
        if kind == "WarmupDecayLR":
            self.set("optim.decay", "linear", "scheduler.type")
            if low in (None, AUTO):
                self.set("optim.min_lr_ratio", 0.0, "scheduler.type", note="WarmupDecayLR decays to 0")
            return
        self.set("optim.decay", "cosine", "scheduler.type")
        ratio = self.get(f"{p}.cos_min_ratio")
        if ratio not in (None, AUTO):
            self.set("optim.min_lr_ratio", float(ratio), f"{p}.cos_min_ratio")
        self.by_value(f"{p}.warmup_min_ratio", 0, "hpctrain warms up from 0", "hpctrain's warmup starts from 0")

    def activation_checkpointing(self) -> None:
        """DeepSpeed's section configures its checkpointing API (deepspeed.checkpointing); it recomputes nothing by
        itself: the model's code turns recomputation on (Megatron's --checkpoint-activations, Hugging Face's
        gradient_checkpointing). A flag that acts only on recomputed layers (partitioned, CPU or contiguous
        checkpoints, a number of checkpoints) says the run recomputes: parallel.recompute=full. All flags off (or
        the section empty): nothing to set. Every key has its own line."""
        ac = "activation_checkpointing"
        section = self.get(ac)
        if not isinstance(section, dict):
            return
        if not section:
            self.same(ac, "empty: DeepSpeed's defaults, which recompute nothing by themselves")
            return
        number = section.get("number_checkpoints")
        implies = [
            f"{ac}.{key}"
            for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
            if section.get(key) is True
        ]
        implies += (
            [f"{ac}.number_checkpoints"]
            if isinstance(number, int) and not isinstance(number, bool) and number > 0
            else []
        )
        if implies:
            self.set(
                "parallel.recompute",
                "full",
                ac,
                note=f"{' and '.join(k.split('.')[-1] for k in implies)}: "
                f"{'acts' if len(implies) == 1 else 'act'} only on recomputed layers; the section alone "
                "recomputes nothing; parallel.recompute=selective recomputes element-wise ops only",
            )
        self.by_value(
            f"{ac}.partition_activations",
            False,
            "false: not partitioned, as hpctrain",
            "the nearest is parallel.sequence_parallel (activations split over the TP ranks)",
        )
        self.by_value(
            f"{ac}.cpu_checkpointing",
            False,
            "false: kept on the GPU, as hpctrain",
            "hpctrain keeps recomputation checkpoints on the GPU (no activation offload)",
        )
        self.by_value(
            f"{ac}.contiguous_memory_optimization",
            False,
            "false: no preallocated buffer, as hpctrain",
            "a DeepSpeed buffer for partitioned checkpoints; hpctrain's recomputation keeps each layer's "
            "input in PyTorch's caching allocator",
        )
        if number is None and "number_checkpoints" in section:
            self.out.same[f"{ac}.number_checkpoints"] = "null: DeepSpeed's default (a buffer sized on first use)"
            self.seen.add(f"{ac}.number_checkpoints")
        else:
            self.skip(
                f"{ac}.number_checkpoints",
                "sizes DeepSpeed's contiguous buffer; hpctrain checkpoints every "
                "layer (parallel.recompute=full) or element-wise ops only (selective)",
            )
        self.by_value(
            f"{ac}.synchronize_checkpoint_boundary",
            False,
            "false: no device synchronisation, as hpctrain",
            "a device synchronisation at each checkpoint (a debugging aid): hpctrain has none",
        )
        self.by_value(
            f"{ac}.profile",
            False,
            "false: no profiling",
            "DeepSpeed's timing of checkpointed forwards: hpctrain records each step's time in metrics.jsonl",
        )
        for key in section:  # a key DeepSpeed does not have (a typo?): its own line too
            if f"{ac}.{key}" not in self.seen:
                self.skip(f"{ac}.{key}", "not a DeepSpeed activation_checkpointing key (it ignores it too)")

    def rest(self) -> None:
        if self.get("gradient_clipping") is not None:
            clip = self.get("gradient_clipping")
            if clip == AUTO:
                self.same("gradient_clipping", "auto: hpctrain's optim.grad_clip")
            else:
                self.set("optim.grad_clip", float(clip), "gradient_clipping")
        if isinstance(self.get("steps_per_print"), int):
            self.set("train.log_every", int(self.get("steps_per_print")), "steps_per_print")
        self.by_value(
            "prescale_gradients",
            False,
            "hpctrain averages gradients in the reduction",
            "hpctrain averages in the reduction (FSDP2/DDP), it does not prescale",
        )
        self.by_value(
            "gradient_predivide_factor",
            1.0,
            "no predivision, as hpctrain",
            "hpctrain averages in the reduction; no predivide factor",
        )
        self.same(
            "wall_clock_breakdown",
            "hpctrain always records step time, data wait, checkpoint blocking "
            "(metrics.jsonl) and the goodput ledger (python -m hpctrain.status)",
        )
        self.same("memory_breakdown", "metrics.jsonl has peak memory every step; health.* watches for leaks")
        self.same("zero_allow_untested_optimizer", "hpctrain's AdamW is the one it tests")
        self.same("zero_force_ds_cpu_optimizer", "hpctrain steps offloaded shards with torch's AdamW on the CPU")
        self.activation_checkpointing()
        wandb = self.get("wandb")
        if isinstance(wandb, dict) and wandb.get("enabled"):
            self.set("tracking.mode", "online", "wandb.enabled")
            for key, target in (
                ("project", "tracking.project"),
                ("group", "tracking.group"),
                ("team", "tracking.entity"),
            ):
                if wandb.get(key):
                    self.set(target, wandb[key], f"wandb.{key}")
        elif isinstance(wandb, dict):
            self.same("wandb", "disabled")
            self._seen_under("wandb")
        for key, why in (
            ("tensorboard", "metrics.jsonl always, W&B with tracking=wandb"),
            ("csv_monitor", "metrics.jsonl always (one JSON object per step)"),
            ("comms_logger", "NCCL's own log: cluster.nccl.debug=INFO, read by tools/nccl_log.py"),
            ("flops_profiler", "metrics.jsonl has MFU every step; the plan (dry_run=true) has FLOPs and memory"),
            (
                "checkpoint",
                (
                    "DCP checkpoints in tiers (checkpoint.tiers: node-local RAM/SSD, shared), resharded "
                    "to any layout on load"
                ),
            ),
            ("elasticity", "elastic.min_nodes (a job that shrinks) and cluster.spare_nodes (hot spares)"),
            ("autotuning", "parallel=auto: the planner's search over layouts"),
            (
                "aio",
                "libaio's settings: hpctrain streams the optimizer's state with positioned O_DIRECT reads and "
                "writes of whole chunks (zero.nvme_chunk_mb), one reader and one writer thread per rank",
            ),
            ("pipeline", "parallel.pp and parallel.schedule"),
            ("sparse_attention", "hpctrain's attention is dense (scaled_dot_product_attention)"),
            ("compression_training", "no compression or quantized training in hpctrain"),
            ("quantize_training", "no quantized training in hpctrain"),
            ("data_efficiency", "hpctrain reads data in order from a seeded global index (data.*)"),
            ("curriculum_learning", "no curriculum in hpctrain"),
            ("eigenvalue", "no eigenvalue-based quantization in hpctrain"),
            ("progressive_layer_drop", "no layer drop in hpctrain"),
            ("dump_state", "the resolved config is in the run directory (config.yaml)"),
            (
                "sequence_parallel_size",
                ("Ulysses sequence parallelism: the nearest is parallel.sequence_parallel with tensor parallelism"),
            ),
            ("hybrid_engine", "DeepSpeed-Chat's inference engine"),
            ("tensor_parallel", "parallel.tp (DTensor tensor parallelism)"),
        ):
            self.skip(key, why)


def _value(v: Any) -> str:
    return str(getattr(v, "value", v))
