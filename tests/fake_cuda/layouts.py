"""The layout suite on fake CUDA: one rank of each layout family builds the engine on a "cuda" mesh and runs a
real step under the GPU's rules (hpctrain.simulate.fake_cuda). Shared by the tests and `python -m
tests.fake_cuda.layouts [NAME...]`, which prints what each step did (host syncs, torch.cuda calls, collectives by
thread, attention kernels)."""

from __future__ import annotations

import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hpctrain.config.layout import resolve_layout
from tests.parallel.layouts import LLAMA, make_cfg

BF16 = {"precision__dtype": "bf16"}
PP = {"train__micro_batch": 2}
# A tiny Qwen3-MoE (tests/parallel/test_moe_layouts.py's), d 64: bf16 rows of 64 take the grouped GEMM on an H100
MOE = {
    "model__arch": "qwen3_moe",
    "model__n_kv_heads": 2,
    "model__head_dim": 32,
    "model__ffn_hidden": 32,
    "model__rope__theta": 500000.0,
    "model__moe__n_experts": 4,
    "model__moe__top_k": 2,
    "model__moe__balance_coef": 0.01,
    "model__moe__z_loss_coef": 0.001,
}
OFFLOAD = {"zero__stage": 3, "zero__offload_optimizer": True, "zero__offload_params": True}

# id -> (world size, overrides): one per layout family of the layout suite, in bf16 as a GPU runs them
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "zero1_buffer": (2, {**BF16, "zero__stage": 1, "train__micro_batch": 1, "precision__reduce_dtype": "fp32"}),
    "zero2": (2, {**BF16, "zero__stage": 2, "train__micro_batch": 2}),
    "zero3": (2, {**BF16, "zero__stage": 3, "train__micro_batch": 2}),
    "hsdp_2x2": (4, {**BF16, "zero__stage": 3, "parallel__dp_replicate": 2, "train__micro_batch": 2}),
    "tp2_sp": (2, {**BF16, "parallel__tp": 2, "parallel__sequence_parallel": True}),
    "zero3_dp2xtp2_sp": (
        4,
        {**BF16, "parallel__tp": 2, "zero__stage": 3, "parallel__sequence_parallel": True, "train__micro_batch": 2},
    ),
    "pp2_1f1b": (2, {**BF16, **PP, "parallel__pp": 2, "parallel__schedule": "1f1b"}),
    "pp2_interleaved": (
        2,
        {**BF16, **PP, "parallel__pp": 2, "parallel__schedule": "interleaved_1f1b", "parallel__virtual_stages": 2},
    ),
    "pp2_uneven": (2, {**BF16, **PP, "model__n_layers": 8, "parallel__pp": 2, "parallel__first_stage_layers": 3}),
    "cp2": (4, {**BF16, **LLAMA, "parallel__cp": 2, "zero__stage": 3, "train__micro_batch": 2}),
    "moe_ep2": (2, {**BF16, **MOE, "parallel__ep": 2, "zero__stage": 3, "train__micro_batch": 2}),
    "moe_ep2_tp2": (4, {**BF16, **MOE, "parallel__ep": 2, "parallel__tp": 2, "zero__stage": 3}),
    "moe_capacity": (2, {**BF16, **MOE, "zero__stage": 3, "model__moe__capacity_factor": 1.25}),
    "fp8": (2, {**BF16, **LLAMA, "zero__stage": 3, "precision__fp8": "tensorwise"}),
    "cpu_offload": (2, {**BF16, **OFFLOAD, "train__micro_batch": 2}),
    "nvme_offload": (2, {**BF16, **OFFLOAD, "zero__offload_optimizer_device": "nvme", "zero__nvme_chunk_mb": 0.05}),
    "recompute_full": (2, {**BF16, "zero__stage": 3, "parallel__recompute": "full"}),
    "recompute_selective": (
        2,
        {**BF16, **MOE, "zero__stage": 3, "parallel__ep": 2, "parallel__recompute": "selective"},
    ),
}
# Not on fake CUDA, and why (hpctrain.simulate.fake_cuda.not_on_fake_cuda says so for any config): the layout suite
# runs them on gloo ranks, tools/gpu_check.py on a GPU.
ELSEWHERE: dict[str, tuple[int, dict[str, Any]]] = {
    "ddp": (2, {**BF16}),
    "compile": (2, {**BF16, "zero__stage": 3, "parallel__compile": True}),
}


def check(name: str, nvme_path: str | None = None, timeout: float = 300) -> Any:
    """Layout `name`'s step on fake CUDA: a fake_cuda.child.Checked, or the failure's message (a str)."""
    from hpctrain.simulate import fake_cuda

    world, overrides = LAYOUTS[name]
    if "zero__offload_optimizer_device" in overrides:
        overrides = {**overrides, "zero__nvme_path": nvme_path or tempfile.mkdtemp(prefix="hpctrain-nvme-")}
    cfg = make_cfg(world, **overrides)
    layout = resolve_layout(cfg)
    with tempfile.TemporaryDirectory(prefix="hpctrain-fake-cuda-") as tmp:
        request, answer = Path(tmp) / "request.pkl", Path(tmp) / "answer.pkl"
        request.write_bytes(pickle.dumps((OmegaConf.to_container(cfg, resolve=True), layout, 0, None)))
        done = fake_cuda.run_module(
            "hpctrain.simulate.fake_cuda.child", ["check", str(request), str(answer)], timeout=timeout
        )
        if not answer.is_file():
            return f"the child exited {done.returncode} without an answer:\n{done.stderr[-4000:]}"
        return pickle.loads(answer.read_bytes())


def main(names: list[str]) -> None:
    for name in names or LAYOUTS:
        out = check(name)
        if isinstance(out, str):
            print(f"[{name}] FAILED: {out.splitlines()[0][:1500]}")
            continue
        print(
            f"[{name}] host syncs {len(out.host_syncs)}; cuda calls {out.cuda_calls}; "
            f"collectives {out.collectives}; attention {out.attention}"
        )
        for sync in dict.fromkeys(out.host_syncs):
            print(f"    sync: {sync}")


if __name__ == "__main__":
    main(sys.argv[1:])
