"""parallel.compile: whole transformer blocks compiled (hpctrain.parallel.compile), on every layout.

The structure is checked with dynamo's counting backend over AOTAutograd (the graphs Inductor would get, without
its code generation): one graph serves every layer, names do not change. The numerics are checked with Inductor
(C++ on CPU) on real gloo ranks against the plain single-process run of tests/parallel/layouts.py. Tolerance:
losses, gradient norms and validation losses within 1e-5 relative, weights after the steps within rtol 1e-5,
atol 1e-6, the layout suite's bounds (compiled kernels fuse and reorder fp32 arithmetic: measured at most
2e-7 apart from the eager engine). The Inductor tests share one cache directory (the graphs repeat across
them), so only the first pays the whole compilation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch._dynamo.testing import CompileCounterWithBackend

from hpctrain.distributed.task_env import compile_cache_environment, node_local_tmp, task_environment
from hpctrain.parallel.compile import CompileClock, apply_compile
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import LLAMA, make_cfg, reference, run_engine

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TINY = {"model__n_layers": 2, "parallel__compile": True}
PP = {"train__micro_batch": 2}


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One Inductor cache for this module's runs (the forked ranks inherit the variable)."""
    path = str(tmp_path_factory.mktemp("inductor"))
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_one_graph_serves_every_block_and_names_stay(arch: str) -> None:
    """Six layers, one compiled frame: the blocks share their graph (compile time does not grow with depth),
    fullgraph=True held (a graph break would raise), and the gradients are the eager model's."""
    from hpctrain.parallel.engine import build_model

    cfg = make_cfg(1, model__n_layers=6, **(LLAMA if arch == "llama" else {}))
    eager = build_model(cfg.model, 7, torch.device("cpu"))
    compiled = build_model(cfg.model, 7, torch.device("cpu"))
    names = [n for n, _ in compiled.named_parameters()]
    counter = CompileCounterWithBackend("aot_eager")
    apply_compile(compiled, backend=counter)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in (eager, compiled):
        model(tokens).float().pow(2).mean().backward()
    assert counter.frame_count == 1
    assert [n for n, _ in compiled.named_parameters()] == names
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def _check(results: list[dict], ref: dict) -> None:
    r = results[0]
    for key in ("loss", "grad_norm", "val_loss"):
        assert all(x[key] == r[key] for x in results), f"{key} differs between ranks"
        assert max(abs(a - b) / abs(b) for a, b in zip(r[key], ref[key])) <= 1e-5, (key, r[key], ref[key])
    weights: dict[str, torch.Tensor] = {}
    for x in results:
        weights.update(x["weights"])
    assert set(weights) == set(ref["weights"])
    for key, expected in ref["weights"].items():
        torch.testing.assert_close(
            weights[key][: expected.shape[0]], expected, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
        )


# id -> (processes, overrides): together they cover TP+SP, FSDP2, PP and both recomputations
COMPILED = {
    # attention and MLP compiled each (compiled_units)
    "tp2_sp_selective": (
        2,
        {"parallel__tp": 2, "parallel__sequence_parallel": True, "parallel__recompute": "selective"},
    ),
    "llama_zero3_dp2xtp2_sp": (
        4,
        {**LLAMA, "parallel__tp": 2, "parallel__sequence_parallel": True, "zero__stage": 3, "train__micro_batch": 2},
    ),
    "zero3_dp2xpp2_full": (4, {"parallel__pp": 2, "zero__stage": 3, "parallel__recompute": "full", **PP}),
    "zero3_dp2_selective": (2, {"zero__stage": 3, "parallel__recompute": "selective"}),
    "dp2_selective": (2, {"parallel__recompute": "selective"}),
}
SLOW = {"llama_zero3_dp2xtp2_sp", "zero3_dp2xpp2_full", "zero3_dp2_selective", "dp2_selective"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in COMPILED])
def test_compiled_blocks_train_like_the_single_process_run(name: str, inductor_cache: str) -> None:
    world, overrides = COMPILED[name]
    overrides = {**TINY, **overrides}
    results = run_distributed(run_engine, world, overrides, STEPS, timeout=600)
    _check(results, reference({k: v for k, v in overrides.items() if k != "parallel__compile"}, STEPS, world))


_RESTART = """
import json, torch
torch.set_num_threads(1)
from hpctrain.config.layout import resolve_layout
from hpctrain.parallel.compile import CompileClock
from hpctrain.parallel.engine import build_engine
from tests.parallel.layouts import make_cfg, rank_batches
from torch._dynamo.utils import counters
cfg = make_cfg(1, model__n_layers=2, parallel__compile=True)
engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
clock, reports = CompileClock(), []
for step in range(2):
    with clock:
        engine.step(rank_batches(step, cfg, 0, 1), cfg.optim.lr)
    reports.append(clock.report())
print(json.dumps({**reports[0], "second": reports[1], **counters["inductor"]}))
"""


@pytest.mark.slow
def test_a_restart_compiles_from_the_node_local_cache(tmp_path: Path) -> None:
    """Two processes in sequence on one node, as a restart inside the allocation: the second loads every graph
    from the cache the first left in the node's scratch directory, and compiles in less time. The step after
    the first compiles nothing (CompileClock reports nothing)."""
    env = {
        **os.environ,
        **compile_cache_environment(str(tmp_path), "test", gpu=False),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _RESTART],
                env=env,
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]
    cold, warm = runs
    print(f"compile: cold {cold['compile_s']:.1f} s, from the cache {warm['compile_s']:.1f} s")
    assert cold["fxgraph_cache_miss"] > 0 and cold.get("fxgraph_cache_hit", 0) == 0
    assert warm["fxgraph_cache_hit"] == cold["fxgraph_cache_miss"] and warm.get("fxgraph_cache_miss", 0) == 0
    assert warm["compile_s"] < cold["compile_s"]
    assert cold["second"] == {} and warm["second"] == {}


def test_compile_time_is_reported_for_the_steps_that_compile() -> None:
    clock = CompileClock()
    double = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True)
    with clock:
        double(torch.ones(3))
    assert clock.report()["compile_s"] > 0
    with clock:
        double(torch.ones(3))
    assert clock.report() == {}


def test_the_compile_caches_go_to_the_nodes_scratch_directory() -> None:
    cfg = make_cfg(2, parallel__compile=True)
    env = task_environment(cfg, node_tmp="/local/job42")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/local/job42/hpctrain-compile-")
    assert "TRITON_CACHE_DIR" not in env  # a CPU run: no Triton
    gpu = compile_cache_environment("/tmp", "ann", gpu=True)
    assert gpu == {
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/hpctrain-compile-ann",
        "TRITON_CACHE_DIR": "/tmp/hpctrain-compile-ann/triton",
    }
    assert "TORCHINDUCTOR_CACHE_DIR" not in task_environment(make_cfg(2), node_tmp="/tmp")
    mine = OmegaConf.merge(cfg, {"cluster": {"env": {"TORCHINDUCTOR_CACHE_DIR": "/scratch/cache"}}})
    assert task_environment(mine, node_tmp="/tmp")["TORCHINDUCTOR_CACHE_DIR"] == "/scratch/cache"
    assert node_local_tmp({"SLURM_TMPDIR": "/l/1", "TMPDIR": "/t"}) == "/l/1"
    assert node_local_tmp({"TMPDIR": "/t"}) == "/t" and node_local_tmp({}) == "/tmp"
