"""parallel.recompute=selective, measured on the real blocks against the planner (hpctrain/plan/activations.py).

The bytes a checkpointed block keeps (tests/plan/saved.py: its input and the op outputs the selective policy
caches, storages counted once, parameters left out; TP on 2 gloo ranks, this rank's shards) equal the planner's
formula byte for byte, for GPT and Llama blocks, without TP, with TP 2 and with TP 2 + SP, and for the MoE
families' block. The policy keeps less than no recomputation; its backward runs the same collectives as
backward without recomputation, and reruns no matmul but the attention's output projection under TP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.models.params import built_dims
from hpctrain.plan.activations import activation_bytes_per_layer
from tests.distributed_harness import run_distributed
from tests.plan.saved import block_saved_bytes, saved_bytes
from tests.plan.shapes import GPT, dims

_c10d = torch.ops._c10d_functional
_COLLECTIVES = {_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default}
D, A, G, F, S, B = 256, 8, 2, 704, 512, 2
SBH = S * B * D
BLOCKS = {"gpt": "model=tiny", "llama": "model=llama_tiny"}


def _cfg(compose_cfg: Any, arch: str) -> Any:
    extra = [f"model.n_kv_heads={G}", f"model.ffn_hidden={F}"] if arch == "llama" else []
    return compose_cfg(BLOCKS[arch], f"model.d_model={D}", f"model.n_heads={A}", "model.n_layers=1", *extra).model


def _formula(model_cfg: Any, recompute: str, tp: int = 1, sp: bool = False) -> float:
    """The planner's bytes for the config's block (its family and Dims) at S tokens, B sequences."""
    return activation_bytes_per_layer(*built_dims(model_cfg), S, B, tp, sp, recompute)


@pytest.mark.parametrize("arch", list(BLOCKS))
def test_selective_keeps_what_the_formula_counts(compose_cfg: Any, arch: str) -> None:
    """Without TP: 22 sbh + the log-sum-exp for both blocks here (GPT none: 32, Llama none: 45.6), full 2."""
    model = _cfg(compose_cfg, arch)
    selective = block_saved_bytes(model, B, S, "selective")
    assert selective == _formula(model, "selective") == SBH * (22 + 4 * A / D)
    assert block_saved_bytes(model, B, S, "full") == _formula(model, "full") == 2 * SBH
    assert selective < _formula(model, "none") < block_saved_bytes(model, B, S, "none")


class _OpCounter(TorchDispatchMode):
    """Counts the matmuls and the collectives dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls = self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        self.collectives += func in _COLLECTIVES
        return func(*args, **(kwargs or {}))


def _tp_block(rank: int, world: int, model_cfg: Any, sp: bool) -> dict[str, Any]:
    """Per recompute mode: the bytes layer 0 keeps on this rank under TP (+SP), and the matmuls and collectives
    its backward runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hpctrain.models import create_model
    from hpctrain.parallel.tensor_parallel import block_plan

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        block = create_model(model_cfg).to(torch.bfloat16).layers["0"]
        x = torch.randn(B, S // world if sp else S, D, dtype=torch.bfloat16, requires_grad=True)
        counter = _OpCounter()
        kept = saved_bytes(
            block, x, mode, lambda m: parallelize_module(m, mesh, block_plan(sp, model_cfg.arch)), backward_mode=counter
        )
        out[mode] = (kept, counter.matmuls, counter.collectives)
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@pytest.mark.parametrize("arch", list(BLOCKS))
def test_selective_under_tp_keeps_what_the_formula_counts(compose_cfg: Any, arch: str, sp: bool) -> None:
    """TP 2 (sbh): GPT and Llama here 14 + lse / 2 (the all-reduce outputs 4 whole), with SP 15 + lse / 2 (the
    gathered inputs 4 whole, the reduce-scatter outputs 2 / t): less than none. Backward runs the collectives of
    backward without recomputation, no more (full recomputation's forward communicates again), and one matmul
    more: the attention's output projection, whose partial sum the policy does not save (full reruns more)."""
    model = _cfg(compose_cfg, arch)
    ranks = run_distributed(_tp_block, 2, model, sp, timeout=300)
    assert ranks[0] == ranks[1]
    got = ranks[0]
    for mode in ("selective", "full"):
        assert got[mode][0] == _formula(model, mode, 2, sp)
    assert got["selective"][0] == SBH * ((15 if sp else 14) + 4 * A / D / 2)
    assert got["selective"][0] < _formula(model, "none", 2, sp) < got["none"][0]
    none, selective, full = (got[m][1:] for m in ("none", "selective", "full"))
    assert selective == (none[0] + 1, none[1])
    assert full[0] > selective[0] and full[1] > none[1]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_selective_moe_block_keeps_what_the_formula_counts(compose_cfg: Any, arch: str) -> None:
    """The MoE layer under the policy: the router's fp32 logits and each routed row's gate, up and down outputs
    (moe_bytes_per_token); the router weight's fp32 copy and the balance loss's fractions are recomputed."""
    e, k = 8, 2
    model = compose_cfg(
        "model=moe_tiny",
        f"model.arch={arch}",
        f"model.d_model={D}",
        f"model.n_heads={A}",
        f"model.n_kv_heads={G}",
        f"model.ffn_hidden={F}",
        f"model.moe.expert_hidden={F}",
        f"model.moe.n_experts={e}",
        f"model.moe.top_k={k}",
        "model.n_layers=1",
    ).model
    selective = block_saved_bytes(model, B, S, "selective")
    assert selective == _formula(model, "selective")
    assert selective < _formula(model, "none")


def test_gpt3_175b_at_tp8_sp_selective_keeps_less_than_none() -> None:
    """GPT-3 175B, s 2048, b 1, t 8 + SP (sbh units): none 7.5, selective 6.75 (the old policy: 10.5), full 0.25;
    each + the log-sum-exp 4 a / (h t) where it applies."""
    s, h, a = 2048, 12288, 96
    sbh, lse = s * h, 4 * a / h / 8
    assert activation_bytes_per_layer(GPT, dims(h, a), s, 1, 8, True) == pytest.approx(sbh * (7.5 + lse))
    assert activation_bytes_per_layer(GPT, dims(h, a), s, 1, 8, True, "selective") == pytest.approx(sbh * (6.75 + lse))
    assert activation_bytes_per_layer(GPT, dims(h, a), s, 1, 8, True, "full") == sbh / 4
