"""One real engine step per layout family on fake CUDA (hpctrain.simulate.fake_cuda): the GPU path executed on a
CPU build, under the GPU's rules (docs/gpu_path.md, "Fake CUDA").

Each layout's rank 0 builds the task's engine on a "cuda" mesh of a fake world and runs a step of bf16 training,
backward on autograd's device thread as on a GPU. The step fails, naming the rule, where a GPU would crash, race
or stall: a CPU tensor in a CUDA op or on an NCCL group, a non_blocking device-to-host copy read before a
synchronisation (the CPU-offload clip factor and found_inf did, issue 45's W1), a data-dependent shape, a device
group's collective from a thread of the code's own. What passes is pinned: the host syncs of the step, the
torch.cuda calls it makes, the threads its collectives come from, the attention kernel a GPU would run.
"""

from __future__ import annotations

import json
import os

import pytest

from hpctrain.simulate import fake_cuda
from tests.fake_cuda.layouts import ELSEWHERE, LAYOUTS, check

REASON = fake_cuda.unavailable_reason()
pytestmark = pytest.mark.skipif(
    REASON is not None and os.environ.get("CI") != "true", reason=f"fake CUDA cannot be built here: {REASON}"
)

# The step's host syncs: one (the control plane's read of the reduced values, Engine._read), and
# - expert parallelism's read of its all-to-all split sizes, one per MoE layer forward (4 layers x micro-batches:
#   2 in moe_ep2, 1 in the others), none again in a recomputation (replayed: hpctrain.models.common.host_reads);
# - under FSDP2's CPU offload, a blocking copy of each gradient to the host per parameter and micro-batch when
#   they accumulate, and a wait on an event per parameter before the optimizer (torch 2.13's _fsdp_collectives).
SYNCS = {
    "moe_ep2": 1 + 4 * 2,
    "moe_ep2_tp2": 1 + 4,
    "recompute_selective": 1 + 4,
    "cpu_offload": 105,
    "nvme_offload": 53,
}
FSDP_STREAMS = {"current_stream", "Stream.wait_stream", "Stream.record_event", "Stream.wait_event", "Event.record"}
# torch.cuda calls the engine's design expects in a step: FSDP2's stream and event bookkeeping, DTensor's device
# queries under TP, the grouped GEMM's capability check in MoE layers, the offload's event waits.
CUDA_CALLS = {
    "zero1_buffer": FSDP_STREAMS,
    "zero2": FSDP_STREAMS,
    "zero3": FSDP_STREAMS,
    "hsdp_2x2": FSDP_STREAMS,
    "tp2_sp": {"current_device"},
    "zero3_dp2xtp2_sp": FSDP_STREAMS | {"current_device"},
    "pp2_1f1b": set(),
    "pp2_interleaved": set(),
    "pp2_uneven": set(),
    "cp2": FSDP_STREAMS,
    "moe_ep2": FSDP_STREAMS | {"current_device", "get_device_capability"},
    "moe_ep2_tp2": FSDP_STREAMS | {"current_device", "get_device_capability"},
    "moe_capacity": FSDP_STREAMS | {"get_device_capability"},
    "fp8": FSDP_STREAMS,
    "cpu_offload": FSDP_STREAMS | {"Event.synchronize"},
    "nvme_offload": FSDP_STREAMS | {"Event.synchronize"},
    "recompute_full": FSDP_STREAMS,
    "recompute_selective": FSDP_STREAMS | {"current_device", "get_device_capability"},
}
# The attention kernel: flash in bf16, context parallelism's chunks included (their bottom-right CausalBias is
# flash's own is_causal for fewer queries than keys, grouped-query heads kept: docs/context_parallel.md).
ATTENTION = {name: "flash" for name in LAYOUTS}


def test_every_layout_family_is_covered() -> None:
    assert set(CUDA_CALLS) == set(LAYOUTS)


QUICK = ("cpu_offload", "zero3_dp2xtp2_sp", "moe_ep2", "pp2_1f1b")  # the quick tier's; every one in the full run


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in sorted(LAYOUTS)]
)
def test_one_engine_step_on_fake_cuda_keeps_the_gpu_rules(name: str, tmp_path) -> None:
    out = check(name, nvme_path=str(tmp_path / "nvme"))
    assert not isinstance(out, str), f"{name}: {out}"
    assert len(out.host_syncs) == SYNCS.get(name, 1), "\n".join(out.host_syncs)
    assert "Engine._read" in out.host_syncs[-1] or "_read" in out.host_syncs[-1]  # the control plane's, last
    assert set(out.cuda_calls) == CUDA_CALLS[name], out.cuda_calls
    threads = {thread for _, thread in out.collectives}
    assert threads <= {"main", "autograd"}, out.collectives
    # the step's control plane: its one all-reduce on the default group, from the main thread
    assert out.collectives.get(("allreduce_", "main"), 0) >= 1
    assert set(out.attention) == {ATTENTION[name]}, out.attention


def test_layouts_fake_cuda_cannot_run_say_why() -> None:
    from omegaconf import OmegaConf

    from hpctrain.config.layout import resolve_layout
    from hpctrain.simulate.rank import not_on_fake_cuda
    from tests.parallel.layouts import make_cfg

    why = {}
    for name, (world, overrides) in ELSEWHERE.items():
        cfg = make_cfg(world, **overrides)
        why[name] = not_on_fake_cuda(OmegaConf.to_container(cfg, resolve=True), resolve_layout(cfg))
    assert "DDP" in why["ddp"] and "C++" in why["ddp"]
    assert "Triton" in why["compile"]
    for world, overrides in LAYOUTS.values():
        cfg = make_cfg(world, **overrides)
        assert not_on_fake_cuda(OmegaConf.to_container(cfg, resolve=True), resolve_layout(cfg)) is None


RULE_BROKEN = {
    "mixed": "one device per op",
    "cpu_on_nccl": "CPU tensor on an NCCL group",
    "early_read": "asynchronous copy read too early",
    "early_read_of_view": "asynchronous copy read too early",
    "nonzero": "host sync",
    "boolean_index": "host sync",
    "masked_select": "host sync",
    "unique": "host sync",
    "other_thread": "one thread per device group",
}
RULE_KEPT = {
    "scalar_on_host": 0,
    "device_on_nccl": 0,
    "read_after_sync": 1,
    "read_after_event": 1,
    "copy_back_to_device": 0,
    "integer_index": 0,
    "backward_thread": 0,
    "host_reads": 3,
}


def test_each_rule_fails_where_a_gpu_would_and_only_there() -> None:
    done = fake_cuda.run_module("tests.fake_cuda.rule_cases", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert set(results) == set(RULE_BROKEN) | set(RULE_KEPT)
    for case, rule in RULE_BROKEN.items():
        assert f"GPU rule ({rule})" in results[case]["violation"], (case, results[case])
        assert "rule_cases.py:" in results[case]["violation"], results[case]  # names the code that did it
    for case, syncs in RULE_KEPT.items():
        assert results[case] == {"violation": "", "syncs": syncs}, (case, results[case])
