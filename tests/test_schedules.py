"""The schedule registry: each entry is everything hpctrain asks about a pipeline schedule."""

from __future__ import annotations

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from hpctrain import schedules
from hpctrain.config.layout import Layout
from hpctrain.config.schema import SCHEDULES
from hpctrain.plan.activations import inflight_microbatches
from hpctrain.plan.bubble import bubble_fraction


def test_every_runnable_entry_names_a_torch_schedule_and_the_schema_allows_exactly_those() -> None:
    assert SCHEDULES == schedules.RUNNABLE
    for name in schedules.RUNNABLE:
        cls = getattr(torch_schedules, schedules.get(name).torch_class)
        assert issubclass(cls, torch_schedules._PipelineSchedule), name
    assert not schedules.get("zb_h2").runnable  # modelled by the planner only


def test_chunk_rules_come_from_the_entry() -> None:
    assert schedules.get("1f1b").chunk_problem(4, 2)[0] == "virtual_stages"
    assert schedules.get("interleaved_1f1b").chunk_problem(4, 1)[0] == "schedule"
    assert schedules.get("zbv").chunk_problem(4, 3)[0] == "virtual_stages"
    assert schedules.get("dualpipev").chunk_problem(4, 2) is None
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        Layout(dp=1, tp=1, pp=4, virtual_stages=3, schedule="dualpipev")


def test_placement() -> None:
    assert schedules.get("interleaved_1f1b").stage_ids(1, 4, 2) == [1, 5]
    assert schedules.get("dualpipev").stage_ids(0, 4, 2) == [0, 7]  # a V: rank 0 holds the first and last stage


def test_dualpipev_costs() -> None:
    """DeepSeek's DualPipe table: bubble (PP/2 - 1)(F&B + B - 3W), PP + 1 activations per device (PP = 2p
    chunks here): with F = B = W, (p - 1) chunk-times of a 6-chunk-time microbatch; p + 1/2 stage-equivalents."""
    assert bubble_fraction(8, 32, 2, "dualpipev") == pytest.approx((7 / 6) / (32 + 7 / 6))
    assert inflight_microbatches(8, 32, 2, "dualpipev") == 8.5
    assert schedules.get("dualpipev").min_microbatches(8, 2) == 16


def test_dualpipev_needs_two_microbatches_per_rank(compose_cfg) -> None:
    from hpctrain.checks.runner import run_checks

    cfg = compose_cfg(
        "cluster.gpus_per_node=2",
        "parallel.pp=2",
        "parallel.schedule=dualpipev",
        "parallel.virtual_stages=2",
        "train.micro_batch=8",
        "model=tiny",
    )
    errors = run_checks(cfg).errors
    assert [(e.key, "at least 4 microbatches" in e.message) for e in errors] == [("train.grad_accum", True)]
