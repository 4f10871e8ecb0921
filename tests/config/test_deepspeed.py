"""DeepSpeed configs read as hpctrain settings (hpctrain/config/deepspeed.py), on real configs from DeepSpeed's
own repositories and Hugging Face (tests/config/deepspeed/README.md): what each key becomes, that no key is
dropped without a word, DeepSpeed's batch arithmetic, and `+deepspeed=` on the command line end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config.deepspeed import leaves, load, translate
from hpctrain.config.problems import ConfigError
from tests.conftest import run_hpctrain

HERE = Path(__file__).parent / "deepspeed"
REPO = Path(__file__).resolve().parents[2]
REAL = sorted(HERE.glob("*.json"))


def covered(translation: Any, leaf: str) -> bool:
    """The leaf is in one of the three lists (a section's entry covers the keys under it)."""
    keys = [k for sources in translation.sources.values() for k in sources]
    keys += list(translation.same) + list(translation.unmapped)
    return any(leaf == k or leaf.startswith(k + ".") for k in keys)


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_every_key_of_a_real_config_is_mapped_or_said_why_not(path: Path, compose_cfg: Callable[..., Any]) -> None:
    ds = load(path)
    translation = translate(ds, compose_cfg("cluster.gpus_per_node=2"))
    assert all(covered(translation, leaf) for leaf in leaves(ds)), [
        leaf for leaf in leaves(ds) if not covered(translation, leaf)
    ]
    assert all(why for why in translation.unmapped.values()) and all(why for why in translation.same.values())
    assert translation.report()


def test_zero_infinity_from_deepspeedexamples(compose_cfg: Callable[..., Any]) -> None:
    """Stage 3, optimizer state to NVMe, parameters to NVMe (to the CPU here, said so), fp16 with a static
    scale, buckets in elements -> bytes."""
    t = translate(load(HERE / "megatron_zero_infinity.json"), compose_cfg("cluster.gpus_per_node=2"))
    o = t.overrides
    assert (o["zero.stage"], o["zero.offload_optimizer"], o["zero.offload_params"]) == (3, True, True)
    assert (o["zero.offload_optimizer_device"], o["zero.nvme_path"]) == ("nvme", "/nvme_data")
    assert "nvme" in t.notes["zero.offload_params"]  # parameters: to CPU memory, said so
    assert (o["train.micro_batch"], o["train.grad_accum"], o["train.global_batch"]) == (4, 1, 8)  # dp 2
    assert o["precision.dtype"] == "fp16" and o["precision.loss_scaling"] is True
    assert o["precision.initial_scale"] == 1024.0 and "static" in t.notes["precision.initial_scale"]
    assert o["zero.reduce_bucket_size"] == 90_000_000 * 4  # fp32 reduction: 4 bytes an element
    assert o["optim.grad_clip"] == 1.0 and o["train.log_every"] == 1
    for key in (
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.offload_param.nvme_path",
        "fp16.hysteresis",
        "aio",
    ):
        assert key in t.unmapped
    assert "wall_clock_breakdown" in t.same and "zero_optimization.overlap_comm" in t.same


def test_cifar_adam_warmup_and_legacy_cpu_offload(compose_cfg: Callable[..., Any]) -> None:
    t = translate(load(HERE / "cifar.json"), compose_cfg("cluster.gpus_per_node=2"))
    o = t.overrides
    assert (o["optim.name"], o["optim.lr"], o["optim.betas"], o["optim.eps"], o["optim.weight_decay"]) == (
        "adamw",
        0.001,
        [0.8, 0.999],
        1e-8,
        3e-7,
    )
    assert (o["optim.warmup_steps"], o["optim.decay"]) == (1000, "constant")
    assert o["zero.offload_optimizer"] is True and o["zero.stage"] == 2
    assert o["precision.initial_scale"] == 2.0**15 and o["precision.loss_scale_window"] == 500
    assert (o["train.global_batch"], o["train.micro_batch"], o["train.grad_accum"]) == (4, 2, 1)
    assert o["zero.allgather_bucket_size"] == 50_000_000 * 2  # all-gathered in fp16
    assert "log" in t.unmapped["scheduler.params.warmup_type (default)"]
    assert "fp16.fp16_master_weights_and_grads" in t.unmapped


def test_an_optimizer_hpctrain_does_not_have_is_listed_not_mapped(compose_cfg: Callable[..., Any]) -> None:
    t = translate(load(HERE / "bert_lamb.json"), compose_cfg("cluster.nodes=64", "cluster.gpus_per_node=16"))
    assert "Lamb" in t.unmapped["optimizer"] and not any(
        k.startswith("optim.") and k != "optim.grad_clip" for k in t.overrides
    )
    assert (t.overrides["train.global_batch"], t.overrides["train.grad_accum"]) == (65536, 1)  # 64 x 1 x 1024
    assert "sparse_attention" in t.unmapped


def test_auto_takes_hpctrains_own_values(compose_cfg: Callable[..., Any]) -> None:
    cfg = compose_cfg("cluster.gpus_per_node=2", "train.micro_batch=3", "train.global_batch=12")
    t = translate(load(HERE / "autotuning_fp16_z3.json"), cfg)
    # DeepSpeed: only the micro-batch given -> no accumulation, the global batch = micro x dp
    assert (t.overrides["train.micro_batch"], t.overrides["train.grad_accum"], t.overrides["train.global_batch"]) == (
        3,
        1,
        6,
    )
    assert "auto" in t.same["train_micro_batch_size_per_gpu"] and t.overrides["zero.stage"] == 3
    article = translate(load(HERE / "article_snippet.json"), cfg)  # micro and accumulation "auto"
    assert (
        article.overrides["train.micro_batch"],
        article.overrides["train.grad_accum"],
        article.overrides["train.global_batch"],
    ) == (3, 2, 12)
    assert article.overrides["precision.dtype"] == "bf16" and article.overrides["zero.offload_optimizer"] is True
    assert article.overrides["zero.reduce_bucket_size"] == 500_000_000 * 4
    assert article.overrides["zero.allgather_bucket_size"] == 500_000_000 * 2  # bf16 parameters


@pytest.mark.parametrize(
    "ds, message",
    [
        (
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
            "16 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 3 x data-parallel size 2",
        ),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "10 is not a multiple of"),
        ({"train_batch_size": "many"}, "is 'many'"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ],
)
def test_batch_and_precision_checked_as_deepspeed_does(ds: dict, message: str, compose_cfg: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError) as err:
        translate(ds, compose_cfg("cluster.gpus_per_node=2"))
    assert message in str(err.value) and "deepspeed." in str(err.value)


def test_schedulers_with_decay(compose_cfg: Callable[..., Any]) -> None:
    cfg = compose_cfg()
    decay = translate(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": 1e-5,
                    "warmup_max_lr": 1e-3,
                    "warmup_num_steps": 10,
                    "total_num_steps": 100,
                    "warmup_type": "linear",
                },
            },
        },
        cfg,
    ).overrides
    assert (decay["optim.decay"], decay["train.max_steps"], decay["optim.warmup_steps"]) == ("linear", 100, 10)
    assert decay["optim.min_lr_ratio"] == pytest.approx(0.01)
    cosine = translate(
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 50, "warmup_num_steps": 5, "cos_min_ratio": 0.1, "warmup_min_ratio": 0},
            }
        },
        cfg,
    )
    assert (cosine.overrides["optim.decay"], cosine.overrides["optim.min_lr_ratio"]) == ("cosine", 0.1)
    other = translate({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}, cfg)
    assert "OneCycle" in other.unmapped["scheduler"] and not other.overrides


def test_plus_deepspeed_on_the_command_line_and_the_tool_agree(tmp_path: Path) -> None:
    """`+deepspeed=PATH` sets what the file says except what the command line set itself; the overrides that
    `tools/from_deepspeed.py` prints give the same plan."""
    ds = HERE / "gpt2_zero2_offload.json"
    common = ["+experiment=smoke", "dry_run=true", "plan.format=json", f"run.root={tmp_path}"]
    imported = run_hpctrain(*common, f"+deepspeed={ds}", "train.log_every=7", cwd=tmp_path, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert "zero.stage=2  <- zero_optimization.stage" in imported.stderr
    assert "the command line's train.log_every=7 kept over the file's 1" in imported.stderr
    assert "(no equivalent) activation_checkpointing.partition_activations" in imported.stderr
    tool = subprocess.run(
        [sys.executable, str(REPO / "tools" / "from_deepspeed.py"), str(ds), "+experiment=smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert tool.returncode == 0, tool.stderr
    command = tool.stdout.splitlines()[0].split()
    assert command[:4] == ["python", "-m", "hpctrain", "+experiment=smoke"]
    overrides = command[4:]
    assert "zero.offload_optimizer=true" in overrides and "precision.dtype=fp16" in overrides
    direct = run_hpctrain(*common, *overrides, "train.log_every=7", cwd=tmp_path, timeout=120)
    assert direct.returncode == 0, direct.stderr
    plan_a, plan_b = json.loads(imported.stdout), json.loads(direct.stdout)
    plan_a.pop("run"), plan_b.pop("run")
    assert plan_a == plan_b


# -- issue 29: the legacy "bfloat16" section, "bfp16", activation_checkpointing's flags, "auto" for the stage


def lines_of(t: Any) -> dict[str, int]:
    """How many lines of the report each DeepSpeed key has (as a source, "same" or "no equivalent")."""
    counts: dict[str, int] = {}
    for key in [k for sources in t.sources.values() for k in set(sources)] + list(t.same) + list(t.unmapped):
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_megatron_deepspeeds_legacy_bfloat16_section_trains_in_bf16(compose_cfg: Callable[..., Any]) -> None:
    """Megatron-DeepSpeed's ds_zero2_config_bf16.json: "bfloat16": {"enabled": true} (DeepSpeed reads it when
    there is no "bf16") and communication_data_type "bfp16" (DeepSpeed's spelling before 0.14.1)."""
    t = translate(load(HERE / "megatron_zero2_bf16.json"), compose_cfg("cluster.gpus_per_node=2"))
    o = t.overrides
    assert (o["precision.dtype"], o["precision.loss_scaling"]) == ("bf16", False)
    assert t.sources["precision.dtype"] == ["bfloat16.enabled"] and "legacy" in t.notes["precision.dtype"]
    assert o["precision.reduce_dtype"] == "bf16" and "bfp16" in t.notes["precision.reduce_dtype"]
    assert not any(k.startswith("bfloat16.enabled") or k == "bfloat16" for k in t.unmapped)
    assert "communication_data_type" not in t.unmapped
    assert "loss scaling" in t.unmapped["bfloat16.loss_scale"]
    assert "fp16.enabled" in t.same and t.same["fp16.loss_scale"].startswith("fp16 is not enabled")


def test_plus_deepspeed_with_the_legacy_bfloat16_section_plans_bf16(tmp_path: Path) -> None:
    ds = HERE / "megatron_zero2_bf16.json"
    done = run_hpctrain(
        "+experiment=smoke",
        "dry_run=true",
        "plan.format=json",
        f"run.root={tmp_path}",
        f"+deepspeed={ds}",
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["precision"] == "bf16" and plan["layout"]["zero_stage"] == 2
    assert "precision.dtype=bf16  <- bfloat16.enabled" in done.stderr
    assert "precision.reduce_dtype=bf16  <- communication_data_type" in done.stderr
    assert "(no equivalent) bfloat16:" not in done.stderr and "(no equivalent) bfloat16.enabled" not in done.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_transformers_bfloat16_auto_takes_hpctrains_precision(dtype: str, compose_cfg: Callable[..., Any]) -> None:
    """Hugging Face's ds_config_zero3_bf16.json: "bfloat16": {"enabled": "auto"}, filled by the trainer's own
    choice: hpctrain's precision.dtype, said so with how to get bf16."""
    t = translate(
        load(HERE / "transformers_zero3_bf16.json"), compose_cfg("cluster.gpus_per_node=2", f"precision.dtype={dtype}")
    )
    assert "precision.dtype" not in t.overrides and "bfloat16.enabled" not in t.unmapped
    assert t.same["bfloat16.enabled"].startswith(f"auto: hpctrain's precision.dtype, {dtype}")
    if dtype == "fp32":
        assert "precision.dtype=bf16" in t.same["bfloat16.enabled"]


def test_bf16_wins_over_bfloat16_as_in_deepspeed(compose_cfg: Callable[..., Any]) -> None:
    t = translate({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, compose_cfg())
    assert "precision.dtype" not in t.overrides and t.same["bf16.enabled"] == "disabled"
    assert "ignored" in t.unmapped["bfloat16"]
    with pytest.raises(ConfigError, match="fp16 and bfloat16 are both enabled"):
        translate({"fp16": {"enabled": True}, "bfloat16": {"enabled": True}}, compose_cfg())
    with pytest.raises(ConfigError, match="deepspeed.bfloat16.enabled: is 'yes'"):
        translate({"bfloat16": {"enabled": "yes"}}, compose_cfg())


@pytest.mark.parametrize(
    "spelling, dtype", [("bfp16", "bf16"), ("BFP16", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")]
)
def test_communication_data_type_spellings(spelling: str, dtype: str, compose_cfg: Callable[..., Any]) -> None:
    t = translate({"communication_data_type": spelling}, compose_cfg())
    assert t.overrides["precision.reduce_dtype"] == dtype and "communication_data_type" not in t.unmapped


def test_a_communication_data_type_deepspeed_refuses_is_refused(compose_cfg: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="deepspeed.communication_data_type: is 'int8'"):
        translate({"communication_data_type": "int8"}, compose_cfg())


AC_KEYS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)


def test_activation_checkpointing_with_every_flag_off_recomputes_nothing(compose_cfg: Callable[..., Any]) -> None:
    """DeepSpeed's section configures its checkpointing API; it turns on no recomputation by itself, least of
    all with every flag off. Each of its six keys has a line of its own."""
    ds = {
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    }
    t = translate(ds, compose_cfg())
    assert "parallel.recompute" not in t.overrides
    counts = lines_of(t)
    assert all(counts.get(f"activation_checkpointing.{key}") == 1 for key in AC_KEYS), counts
    assert all(f"activation_checkpointing.{key}" in t.report() for key in AC_KEYS)
    assert "parallel.recompute" not in translate({"activation_checkpointing": {}}, compose_cfg()).overrides


def test_activation_checkpointing_flags_that_need_recomputation(compose_cfg: Callable[..., Any]) -> None:
    on = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    t = translate({"activation_checkpointing": on}, compose_cfg())
    assert t.overrides["parallel.recompute"] == "full"
    assert "partition_activations" in t.notes["parallel.recompute"]
    assert all(t.unmapped.get(f"activation_checkpointing.{key}") for key in AC_KEYS), t.unmapped
    gpt2 = translate(load(HERE / "gpt2_zero2_offload.json"), compose_cfg("cluster.gpus_per_node=2"))
    assert gpt2.overrides["parallel.recompute"] == "full"
    assert {
        "activation_checkpointing.partition_activations",
        "activation_checkpointing.contiguous_memory_optimization",
    } <= set(gpt2.unmapped)


def test_auto_zero_stage_takes_hpctrains_own(compose_cfg: Callable[..., Any]) -> None:
    t = translate({"zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"}}, compose_cfg("zero.stage=2"))
    assert "zero.stage" not in t.overrides and t.same["zero_optimization.stage"] == "auto: hpctrain's zero.stage, 2"


@pytest.mark.parametrize("stage", ["three", 5, -1, 2.5, True])
def test_a_zero_stage_that_is_not_one_is_a_config_error(stage: Any, compose_cfg: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="deepspeed.zero_optimization.stage: is"):
        translate({"zero_optimization": {"stage": stage}}, compose_cfg())


def test_the_tool_takes_auto_for_the_stage_and_refuses_a_bad_value_without_a_traceback(tmp_path: Path) -> None:
    tool = [sys.executable, str(REPO / "tools" / "from_deepspeed.py")]
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"zero_optimization": {"stage": "auto"}, "bf16": {"enabled": "auto"}}))
    done = subprocess.run([*tool, str(auto), "zero=stage3"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "(same as hpctrain) zero_optimization.stage: auto: hpctrain's zero.stage, 3" in done.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}}))
    done = subprocess.run([*tool, str(bad)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(bad) in done.stderr and "'ten'" in done.stderr and "fix:" in done.stderr


@pytest.mark.parametrize("make", ["device", "directory", "fifo"])
def test_a_path_that_is_not_a_json_file_is_a_config_error_not_a_read(make: str, tmp_path: Path) -> None:
    """`+deepspeed=/dev/zero` read 11.4 GB in 30 s, a FIFO blocked for ever (issue 46): hpctrain.bounded refuses
    them by what they are, at once (tests/config/test_file_reads.py runs them through the command line)."""
    import os
    import time

    path = {"device": Path("/dev/zero"), "directory": tmp_path}.get(make, tmp_path / "pipe")
    if make == "fifo":
        os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load(path)
    assert time.monotonic() - started < 1.0
    (problem,) = err.value.problems
    assert problem.key == "deepspeed" and "is not a regular file" in problem.message and problem.fix


def test_a_number_past_a_floats_range_is_a_config_error(compose_cfg: Callable[..., Any]) -> None:
    """float(10**400) raises OverflowError, which the importer says as a value it cannot read, naming the section."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 10**400}}}
    with pytest.raises(ConfigError) as err:
        translate(ds, compose_cfg())
    assert err.value.problems[0].key == "deepspeed (optimizer)" and "cannot read" in err.value.problems[0].message
