"""Every number of the config has a domain (issue 46, "Accepted nonsense"; hpctrain.checks.config.DOMAINS), and
sizes no device can hold are refused, not warned about ("Sizes a CPU or GPU cannot hold").

The keys are found in the schema itself (hpctrain/config/schema.py), so a number added there without a domain
fails here. Each is tried with values outside any sane domain, through `python -m hpctrain`'s own function: -1
(the counts, rates and sizes: none means anything below 0 but the keys of NEGATIVE_MEANS), NaN and infinity (the
floats), 2**62 (the integers: past every count a run has, int32's range). Each is a config error naming the key,
with a fix, and leaves the run root empty.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from hpctrain.checks.config import DOMAINS, domain_checks
from hpctrain.checks.report import CheckReport
from hpctrain.config.schema import Config
from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run


def numeric_leaves(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every int or float key of the schema (Optional ones, lists of numbers, and a list of dataclasses's
    fields as `key[].field`), with its type."""
    out: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # Optional[X], X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if dataclasses.is_dataclass(kind):
            out.update(numeric_leaves(kind, f"{prefix}{f.name}."))
        elif item is not None and dataclasses.is_dataclass(item):
            out.update(numeric_leaves(item, f"{prefix}{f.name}[]."))
        elif kind in (int, float) or item in (int, float):
            out[f"{prefix}{f.name}"] = kind if item is None else list
    return out


LEAVES = numeric_leaves()

# Keys where a negative value has a meaning, with the reason: they are tried with -2 (or only from above)
NEGATIVE_MEANS = {
    "parallel.dp": "-1 infers DP from the world size (hpctrain.config.layout._infer_dp)",
    "train.grad_accum": "-1 infers it from the global batch (hpctrain.config.layout._infer_grad_accum)",
    "cluster.nccl.ib_gid_index": "-1 is NCCL's own choice of GID (NCCL_IB_GID_INDEX=-1, NCCL 2.21 and later)",
    "model.vocab_pad_multiple": "any value <= 1 means no padding (the schema's words; models.params.padded_vocab)",
}

# The config a key is tried in, where the default one does not read the key
BASES = {
    "model.moe.": ["model=moe_tiny"],
    "model.rope.": ["model=llama_tiny"],
    "precision.": ["precision=fp16"],
    "data.prepare.": [
        "data=indexed",
        "data.vocab_size=256",
        "data.blend=/nonexistent/d",
        "data.prepare.inputs=[stdlib]",
    ],
}


def base(key: str) -> list[str]:
    return next((overrides for prefix, overrides in BASES.items() if key.startswith(prefix)), [])


def override(key: str) -> str:
    return key.replace("[].", ".0.")


def reported(key: str) -> str:
    return key.replace("[].", "[0].")


def bad_values(key: str, kind: type) -> list[Any]:
    low = [] if key == "model.vocab_pad_multiple" else [-2 if key in NEGATIVE_MEANS else -1]
    if kind is list:  # optim.betas
        return [[-1.0, 0.9], ["nan", 0.9]]
    if kind is float:
        return [*low, "nan", "inf"]
    return [*low, 2**62]


CASES = [(key, value) for key, kind in LEAVES.items() for value in bad_values(key, kind)]
# Through the whole command path (`run`: compose, every check, nothing on disk), about 0.3 s a case: the quick tier
# takes one case of each config section, the full suite all of them (the table test covers every key quickly).
_FIRST_OF_SECTION = {
    next(k for k, _ in CASES if k.split(".")[0] == section): None
    for section in dict.fromkeys(k.split(".")[0] for k, _ in CASES)
}
RUN_CASES = [
    pytest.param(
        key,
        value,
        id=f"{key}={value}",
        marks=() if key in _FIRST_OF_SECTION and value == bad_values(key, LEAVES[key])[0] else pytest.mark.slow,
    )
    for key, value in CASES
]


def test_every_number_of_the_schema_has_a_domain() -> None:
    assert len(LEAVES) > 90, "the schema walk found too few keys"
    assert set(LEAVES) == set(DOMAINS), (sorted(set(LEAVES) - set(DOMAINS)), sorted(set(DOMAINS) - set(LEAVES)))


def test_the_allow_list_is_what_the_domains_allow() -> None:
    """A key allows a negative value only when NEGATIVE_MEANS says why."""
    negative = {key for key, d in DOMAINS.items() if d.holds(-1)}
    assert negative == set(NEGATIVE_MEANS)


@pytest.mark.parametrize("key", sorted(DOMAINS))
def test_each_domain_holds_its_example_and_refuses_what_is_past_its_bounds(compose_cfg, key: str) -> None:
    """The table against itself: its example is inside, a value past each bound is refused by domain_checks,
    naming the key, with a fix that sets it."""
    d = DOMAINS[key]
    example = json.loads(d.example) if isinstance(d.example, str) and d.example.startswith("[") else d.example
    assert all(d.holds(float(v)) for v in (example if isinstance(example, list) else [example])), (key, example)
    integer = LEAVES[key] is int
    past = []
    if d.low is not None:
        below = d.low if d.low_open else d.low - (1 if integer else 1e-3)
        while d.holds(below):  # past the values of `also` (parallel.dp=-1)
            below -= 1
        past.append(below)
    if d.high is not None:
        past.append(d.high if d.high_open else (d.high + 1 if integer else d.high * 1.5))
    assert past, f"{key} has no bound"
    for value in past:
        value = int(value) if integer else float(value)
        cfg = compose_cfg(*base(key))
        OmegaConf.update(cfg, override(key), [value, 0.5] if LEAVES[key] is list else value, merge=False)
        report = CheckReport(layout=None)
        domain_checks(cfg, report)
        assert [p.key for p in report.errors] == [reported(key)], (key, value, report.errors)
        assert report.errors[0].message.startswith(("must be", "each must be")), report.errors[0].message
        assert f"{reported(key)}=" in report.errors[0].fix


@pytest.mark.parametrize("key, value", RUN_CASES)
def test_a_number_outside_its_domain_is_refused(compose_cfg, capsys, tmp_path: Path, key: str, value: Any) -> None:
    shown = "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)
    cfg = compose_cfg(*base(key), f"{override(key)}={shown}", f"run.root={tmp_path}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{reported(key)}: " in err and "fix: " in err, err
    assert not any(tmp_path.iterdir()), "a rejected config must leave nothing behind"


def test_the_negative_values_that_mean_something_are_accepted(compose_cfg) -> None:
    from hpctrain.checks.runner import run_checks

    report = run_checks(
        compose_cfg(
            "parallel.dp=-1", "train.grad_accum=-1", "cluster.nccl.ib_gid_index=-1", "model.vocab_pad_multiple=-1"
        )
    )
    assert not report.errors, report.errors


def test_a_negative_bias_update_rate_names_what_it_would_do(compose_cfg, capsys, tmp_path: Path) -> None:
    cfg = compose_cfg(
        "model=moe_tiny", "model.moe.router=sigmoid", "model.moe.bias_update_rate=-1", f"run.root={tmp_path}"
    )
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "model.moe.bias_update_rate: must be >= 0 (0: the router's bias stays), got -1.0" in err
    assert "a negative rate moves it away" in err and "fix: use e.g. model.moe.bias_update_rate=0.001" in err


def test_llama3_rope_scaling_needs_high_above_low(compose_cfg, capsys, tmp_path: Path) -> None:
    cfg = compose_cfg(
        "model=llama_tiny",
        "model.rope.scaling_factor=8",
        "model.rope.low_freq_factor=4",
        "model.rope.high_freq_factor=4",
        f"run.root={tmp_path}",
    )
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "model.rope.high_freq_factor: 4 must be > model.rope.low_freq_factor=4" in err and "fix: " in err


# ---------------------------------------------------------------- sizes no CPU or GPU can hold

ALLOCATION = [
    # (id, overrides, key, words)
    (
        "a-billion-experts",
        ["model=moe_tiny", "model.moe.n_experts=1000000000"],
        "model.moe.n_experts",
        "a layer's stacked experts weight is one tensor of 1,000,000,000 (experts / ep)",
    ),
    ("huge-d-model", ["model.d_model=1048576"], "model.d_model", "cannot be allocated"),
    ("huge-vocab", ["model.vocab_size=2000000000"], "model.vocab_size", "one micro-batch's logits"),
    (
        "huge-micro-batch",
        ["train.micro_batch=1000000000", "train.global_batch=2000000000"],
        "train.micro_batch",
        "one micro-batch's hidden states",
    ),
    (
        "huge-sequence",
        ["model.context=2000000000", "train.seq_len=2000000000"],
        "train.seq_len",
        "one micro-batch's hidden states",
    ),
    (
        "past-int64",
        ["model=moe_tiny", "model.moe.n_experts=2147483647", "model.moe.expert_hidden=2147483647"],
        "model.moe.n_experts",
        "more than int64 counts",
    ),
    (
        "past-a-cpu-host",
        ["model.d_model=2147483647", "model.n_heads=1", "model.vocab_size=2147483647", "model.vocab_pad_multiple=1"],
        "model.vocab_size",
        "more than the 2.00 TiB of host memory of the largest node hpctrain knows (gpu_type=cpu)",
    ),
    (
        "on-an-h100",
        [
            "cluster=dev",
            "cluster.gpu_type=h100_80gb",
            "cluster.gpus_per_node=2",
            "model.d_model=262144",
            "model.n_heads=1",
        ],
        "model.d_model",
        "more than the 80.00 GiB of a h100_80gb",
    ),
    (
        "thousand-times-a-cpu",
        ["model=moe_tiny", "model.moe.n_experts=10000000"],
        "parallel",
        "times over: no machine holds that per process",
    ),
]


@pytest.mark.parametrize("overrides, key, words", [c[1:] for c in ALLOCATION], ids=[c[0] for c in ALLOCATION])
def test_what_cannot_be_allocated_is_an_error_even_on_cpu(
    compose_cfg, capsys, tmp_path: Path, overrides: list[str], key: str, words: str
) -> None:
    cfg = compose_cfg(*overrides, f"run.root={tmp_path}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err and f"{key}: " in err and words in err and "fix: " in err, err
    assert not any(tmp_path.iterdir())


def test_a_dry_run_of_what_cannot_be_allocated_plans_fast_and_exits_2(compose_cfg, capsys, tmp_path: Path) -> None:
    """The plan is still printed (closed forms), without the estimates, and quickly."""
    import time

    cfg = compose_cfg("model=moe_tiny", "model.moe.n_experts=1000000000", "dry_run=true", f"run.root={tmp_path}")
    started = time.monotonic()
    assert run(cfg).code == EXIT_CONFIG_ERROR
    assert time.monotonic() - started < 5
    out, err = capsys.readouterr()
    assert "hpctrain plan" in out and "model.moe.n_experts: " in err


@pytest.mark.parametrize(
    "overrides",
    [["model=gpt3_13b"], ["model=gpt3_175b"], ["model=moe_tiny", "model.moe.n_experts=100000"]],
    ids=["13b", "175b", "moe-100k-experts"],
)
def test_what_a_large_cpu_host_might_hold_stays_a_warning(compose_cfg, overrides: list[str]) -> None:
    """gpu_type=cpu's memory is a placeholder: a model up to CPU_BEYOND times over it only warns."""
    from hpctrain.checks.runner import run_checks

    report = run_checks(compose_cfg(*overrides, "dry_run=true"))
    assert not report.errors, report.errors
    assert [w.key for w in report.warnings if "exceeds the" in w.message] == ["parallel"]


def test_the_published_layouts_have_no_tensor_past_their_gpu(compose_cfg) -> None:
    from hpctrain.checks.config import _largest_tensors
    from hpctrain.config.layout import resolve_layout
    from hpctrain.hardware import KNOWN_HARDWARE

    for name in ("175b", "llama3_405b", "llama3_405b_long", "qwen3_235b_a22b", "gpt3_13b_16node"):
        cfg = compose_cfg(f"+experiment={name}")
        limit = KNOWN_HARDWARE[cfg.cluster.gpu_type].gpu_mem_bytes
        for what, factors, size in _largest_tensors(cfg, resolve_layout(cfg)):
            assert math.prod(v for _, _, v in factors) * size < limit / 4, (name, what)


def test_a_deepspeed_micro_batch_of_1e23_is_refused_naming_the_file_key(compose_cfg, capsys, tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 100000000000000000000000}')
    cfg = compose_cfg(f"+deepspeed={ds}", f"run.root={tmp_path / 'runs'}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "deepspeed.train_micro_batch_size_per_gpu: is 100,000,000,000,000,000,000,000" in err and "fix: " in err
    assert not (tmp_path / "runs").exists()


def test_a_deepspeed_micro_batch_that_fits_int32_but_no_memory(compose_cfg, capsys, tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1000000000, "gradient_accumulation_steps": 1}')
    cfg = compose_cfg(f"+deepspeed={ds}", f"run.root={tmp_path / 'runs'}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "train.micro_batch: one micro-batch's hidden states is one tensor of 1,000,000,000" in err


def test_a_loss_scale_power_past_fp32_is_refused_before_it_is_computed(compose_cfg, capsys, tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"fp16": {"enabled": true, "initial_scale_power": 1000000000000000000}}')
    cfg = compose_cfg(f"+deepspeed={ds}", f"run.root={tmp_path / 'runs'}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "deepspeed.fp16.initial_scale_power: is 1000000000000000000: 2^1000000000000000000 is beyond" in err
