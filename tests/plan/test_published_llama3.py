"""The planner beside Meta's published Llama 3 405B runs (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
Table 4, BF16 on H100s at 989 TFLOP/s peak): 430 TFLOP/s per GPU on 8,192 GPUs (TP 8, PP 16, DP 64, 8K tokens),
400 on 16,384 (DP 128) and 380 for the 131K-context stage on 16,384 (TP 8, CP 16, PP 16, DP 8), all with 16M tokens
a step. Meta ran the interleaved schedule with one layer fewer on the first and the last stage and, at 8K, "without
activation checkpointing" (sec. 3.3.2). The plans come from the real dry-run path (`dry_run=true
plan.format=json`, in process)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from hpctrain.checks.runner import check_config, run_checks
from hpctrain.launch.cli import run
from hpctrain.plan.auto import CHOSEN, auto_candidates, layout_overrides

PEAK_TFLOPS = 989.0  # H100 SXM dense BF16, the peak Table 4's MFU is of
# experiment -> (Table 4's TFLOP/s per GPU, its layout: GPUs, tp, cp, pp, dp)
PUBLISHED = {
    "llama3_405b_8k_gpus": (430.0, (8192, 8, 1, 16, 64)),
    "llama3_405b": (400.0, (16384, 8, 1, 16, 128)),
    "llama3_405b_long": (380.0, (16384, 8, 16, 16, 8)),
}
WITHIN = 0.15


def _plan(capsys: pytest.CaptureFixture[str], cfg: DictConfig) -> tuple[int, dict[str, Any]]:
    code = run(cfg).code
    return code, json.loads(capsys.readouterr().out)


def _tflops(plan: dict[str, Any]) -> float:
    return float(plan["est_mfu"]) * PEAK_TFLOPS


@pytest.mark.parametrize("experiment", PUBLISHED)
def test_the_experiment_is_metas_pipeline_and_fits(
    experiment: str, compose_cfg: Callable[..., DictConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    """Table 4's layout, Meta's interleaved schedule (4 chunks a rank) and uneven cut (126 layers as 1 + 62 x 2 + 1),
    planned without errors: it fits, with full recomputation (the next test says why)."""
    code, plan = _plan(capsys, compose_cfg(f"+experiment={experiment}", "dry_run=true", "plan.format=json"))
    lay = plan["layout"]
    assert code == 0
    assert (lay["nodes"] * lay["gpus_per_node"], lay["tp"], lay["cp"], lay["pp"], lay["dp"]) == PUBLISHED[experiment][1]
    assert lay["tokens_per_step"] == 2**24  # 16M tokens a step
    assert (lay["schedule"], lay["virtual_stages"]) == ("interleaved_1f1b", 4)
    assert (lay["first_stage_layers"], lay["last_stage_layers"]) == (1, 1)
    assert plan["memory_per_gpu_bytes"]["fits"]


@pytest.mark.parametrize("experiment", PUBLISHED)
def test_metas_layout_and_recompute_plan_within_15_percent(
    experiment: str, compose_cfg: Callable[..., DictConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    """As Meta ran it (no recomputation), the planner's compute, bubble and communication model lands within 15% of
    Table 4: 1.01 / 1.05 / 1.12 x at the default assumptions. The same layout does not fit hpctrain's stack: the
    first stage holds every micro-batch of its 7 layers (torch's interleaved warm-up, pipeline.held_chunks) at
    9.55 s b h a layer (DTensor SP keeps the gathered matmul inputs whole, RMSNorm an fp32 copy of its input), so the
    plan refuses it (exit 2) and the experiments run full recomputation."""
    code, plan = _plan(
        capsys, compose_cfg(f"+experiment={experiment}", "parallel.recompute=none", "dry_run=true", "plan.format=json")
    )
    published = PUBLISHED[experiment][0]
    assert abs(_tflops(plan) / published - 1) <= WITHIN, _tflops(plan)
    assert code == 2 and not plan["memory_per_gpu_bytes"]["fits"]


@pytest.mark.xfail(
    strict=True,
    reason="hpctrain's stack keeps 9.55 s b h per Llama 405B layer and micro-batch under TP 8 + SP (Megatron's "
    "sharded SP ~5), so Meta's no-recompute layout needs ~164 GiB on the first stage (docs/planner.md, 'Llama 3 "
    "405B'); the configured experiment runs full recomputation at 303 TFLOP/s, 0.76 of the paper's 400",
)
def test_the_configured_experiment_plans_within_15_percent_of_400(
    compose_cfg: Callable[..., DictConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    _, plan = _plan(capsys, compose_cfg("+experiment=llama3_405b", "dry_run=true", "plan.format=json"))
    assert abs(_tflops(plan) / PUBLISHED["llama3_405b"][0] - 1) <= WITHIN, _tflops(plan)


def test_parallel_auto_rates_at_least_the_experiment_and_passes_the_checks(
    compose_cfg: Callable[..., DictConfig],
) -> None:
    """The search tries uneven interleaved cuts (first and last chunk one layer lighter, virtual stages): its choice
    for llama3_405b rates at least as high as the experiment's own layout, and the checks accept it."""
    cfg = compose_cfg("+experiment=llama3_405b", "dry_run=true")
    mine = check_config(cfg).estimates
    best = auto_candidates(cfg)[0]
    assert best.tokens_per_s >= mine.step.tokens_per_s
    chosen = copy.deepcopy(cfg)
    for key, value in layout_overrides(best.layout).items():
        OmegaConf.update(chosen, key, value)
    report = run_checks(chosen)
    assert report.errors == [], report.errors
    assert report.estimates.memory.fits
    assert {f: getattr(report.layout, f) for f in CHOSEN} == {f: getattr(best.layout, f) for f in CHOSEN}
