"""Sequence parallelism keeping shards (hpctrain.parallel.sequence_parallel, Layout.sp_keeps_shards), measured on
the real blocks on 2 gloo ranks against DTensor's SP and the planner (hpctrain/plan/activations.py).

Without recomputation, each rank's block keeps, byte for byte, the planner's formula with the gathered QKV and
MLP inputs as 1/t slices (`sp_keeps_gathered=False`): 2 s b h less than DTensor's SP here (4 (1 - 1/t) at t = 2),
an MoE block 1 less (its MoE layer, whole on every TP rank, still runs on the gathered sequence). The gradients of
every weight and of the input are bit for bit DTensor's; backward runs one all-gather more per gathered input,
the MLP's gate and up sharing theirs, and no matmul more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hpctrain.models.params import built_dims
from hpctrain.plan.activations import activation_bytes_per_layer
from tests.distributed_harness import run_distributed
from tests.plan.saved import saved_bytes
from tests.plan.test_plan_recompute import SBH, B, S, _cfg, _OpCounter

pytestmark = [pytest.mark.slow]


def _block(rank: int, world: int, model_cfg: Any, keep: bool) -> tuple[int, int, int, dict[str, torch.Tensor]]:
    from hpctrain.models import as_module, create_model
    from hpctrain.parallel.tensor_parallel import block_plan

    mesh = init_device_mesh("cpu", (world,))
    model = create_model(model_cfg)
    model.init_weights(seed=0)
    block = as_module(model).to(torch.bfloat16).layers["0"]
    torch.manual_seed(1 + rank)
    x = torch.randn(B, S // world, model_cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    counter = _OpCounter()
    kept = saved_bytes(
        block, x, "none", lambda m: parallelize_module(m, mesh, block_plan(True, model_cfg.arch, keep)), counter
    )
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
        for name, p in block.named_parameters()
    }
    grads["input"] = x.grad.float()
    return kept, counter.matmuls, counter.collectives, grads


def _arch_cfg(compose_cfg: Any, arch: str) -> Any:
    if arch == "moe":
        return compose_cfg("model=moe_tiny", "model.n_layers=1").model
    return _cfg(compose_cfg, arch)


@pytest.mark.parametrize("arch", ["gpt", "llama", "moe"])
def test_sp_keeps_the_gathered_inputs_as_shards(compose_cfg: Any, arch: str) -> None:
    model = _arch_cfg(compose_cfg, arch)
    dtensor = run_distributed(_block, 2, model, False, timeout=300)
    shards = run_distributed(_block, 2, model, True, timeout=300)
    family, dims = built_dims(model)
    sbh = SBH * model.d_model // 256  # the blocks here are 256 wide but moe_tiny's own width
    gathered = 1 if arch == "moe" else 2  # 4 (1 - 1/t) s b h at t = 2, the MoE block's QKV input only
    for rank in range(2):
        kept, matmuls, collectives, grads = shards[rank]
        plain_kept, plain_matmuls, plain_collectives, plain_grads = dtensor[rank]
        formula = {
            keeps: activation_bytes_per_layer(family, dims, S, B, 2, True, sp_keeps_gathered=keeps)
            for keeps in (True, False)
        }
        # what the formula leaves out either way (norm statistics, the RoPE tables) is the same
        assert kept - formula[False] == plain_kept - formula[True] < sbh
        assert plain_kept - kept == formula[True] - formula[False] == gathered * sbh
        assert (matmuls, collectives) == (plain_matmuls, plain_collectives + gathered)
        for name, grad in plain_grads.items():
            assert torch.equal(grads[name], grad), name
