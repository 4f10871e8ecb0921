"""The MoE block as a GPU runs it, checked on the CPU (issue 45): the router in full fp32 whatever the global
matmul precision and autocast (W3), the grouped GEMM under autocast with fp32 weights (S1), and no host waits for
device values on the capacity path nor in a recomputed expert-parallel forward (S2)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.models.common import moe as moe_module
from hpctrain.models.common.moe import MoE, MoEArgs
from tests.distributed_harness import run_distributed
from tests.gpu_rules import recording_host_reads
from tests.models.test_moe_block import D, block, grouped_mm_runs_on_cpu, tokens

aten = torch.ops.aten
# Ops whose output the host must wait for on a GPU: a value read, or a shape that depends on values.
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._unique.default,
}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class Ops(TorchDispatchMode):
    """Counts every aten op by name, and records the host syncs among them (SYNC_OPS and indexing by a boolean
    mask, whose nonzero waits for the device) and each matmul's output width with the fp32 matmul precision in
    force when it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.syncs: list[str] = []
        self.matmuls: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        masked = func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        if func in SYNC_OPS or masked:
            self.syncs.append(str(func))
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.matmuls.append((out.shape[-1], torch.get_float32_matmul_precision()))
        return out


@contextlib.contextmanager
def global_matmul_precision(precision: str) -> Iterator[None]:
    """What hpctrain.parallel.precision.configure_device_math sets on GPUs (TF32: "high"), restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ------------------------------------------------------------------------------------------ W3: the router in fp32


def test_the_router_multiplies_in_full_fp32_under_tf32_and_autocast() -> None:
    """On a GPU the global precision is "high" (TF32: a 10-bit mantissa) and the router's "fp32" logits would be
    TF32's; under autocast (one GPU, DDP) its linear would even run in bf16. Only the router's matmul is taken
    out of both: the experts' run as the global settings say."""
    m = block(torch.float32)
    x = tokens(torch.float32)
    exact = m.router_logits(x.view(-1, D))
    ops = Ops()
    with global_matmul_precision("high"):
        with ops:
            m.compute(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m.router_logits(x.view(-1, D))
        assert torch.get_float32_matmul_precision() == "high"  # restored after the router
    router = [precision for width, precision in ops.matmuls if width == m.args.n_experts]
    experts = {precision for width, precision in ops.matmuls if width != m.args.n_experts}
    assert router == ["highest"] and experts == {"high"}, ops.matmuls
    assert logits.dtype == torch.float32 and torch.equal(logits, exact)


# ------------------------------------------------------------------------------------------ S1: autocast


def test_autocast_with_fp32_weights_takes_the_grouped_gemm() -> None:
    """One GPU or DDP: autocast to bf16, the parameters fp32 (no FSDP2 mixed precision). The experts' weights are
    cast as autocast casts a matmul's, so the grouped GEMM serves (fake CPU tensors decide as an H100 would) and
    no per-expert loop with its host read of the counts runs."""
    m = block(torch.float32, balance_coef=0.01)
    ops = Ops()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, ops:
        x = mode.from_tensor(tokens(torch.float32)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().square().sum().backward()
    assert ops.counts["aten._grouped_mm.default"] == 3 * 3, ops.counts  # forward 3, backward 2 each
    assert not ops.syncs and x.grad is not None and m.experts.w_gate.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------ S2: no host syncs


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_the_capacity_path_never_waits_for_the_device(capacity_factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward and backward on real tensors, on the grouped GEMM's path (an H100's in bf16), reads nothing on
    the host: no value, no shape that depends on values (a boolean mask's nonzero). A capacity drops assignments
    with static shapes: the dropped ones sorted after the kept, outside every expert's count."""
    monkeypatch.setattr(moe_module, "grouped_mm_serves", lambda x, weight: True)
    reads: list[str] = []
    m = block(torch.float32, capacity_factor=capacity_factor, balance_coef=0.01, z_loss_coef=0.001)
    x = tokens(torch.float32).requires_grad_()
    ops = Ops()
    with recording_host_reads(reads), ops:
        out, stats = m.compute(x, 1.0)
        out.square().sum().backward()
    assert not ops.syncs and not reads, (ops.syncs, reads)
    assert (stats.dropped.item() > 0) == (capacity_factor > 0)


class Stack(nn.Module):
    """MoE layers with residuals, as apply_recompute checkpoints a model's blocks (`layers`)."""

    def __init__(self, layers: list[MoE]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = x + layer(x)
        return x


def _ep_split_size_reads(rank: int, world: int, n_layers: int) -> dict[str, Any]:
    """Each recompute mode on the same EP model and batch: the host reads in `_dispatch` over a forward and
    backward, the output and every gradient."""
    from hpctrain.parallel.recompute import apply_recompute

    results: dict[str, Any] = {}
    for mode in ("none", "full", "selective"):
        layers = []
        for i in range(n_layers):
            layer = MoE(MoEArgs(d_model=D, expert_hidden=24, n_experts=4, top_k=2, balance_coef=0.01))
            layer.init_weights(0.5, seed=0, prefix=f"layers.{i}.mlp.")
            for name, param in list(layer.experts.named_parameters(recurse=False)):
                local = param.detach()[rank * 4 // world : (rank + 1) * 4 // world].clone()
                layer.experts.register_parameter(name, nn.Parameter(local))
            layer.experts.ep_group = dist.group.WORLD
            layers.append(layer)
        model = Stack(layers)
        apply_recompute(model, mode)
        x = tokens(torch.float32, seed=rank).requires_grad_()
        reads: list[str] = []
        with recording_host_reads(reads):
            out = model(x)
            out.square().sum().backward()
        for layer in layers:
            layer.take_routing()
        results[mode] = {
            "reads": len([r for r in reads if r.endswith("in _dispatch")]),
            "out": out.detach(),
            "grads": [x.grad, *(p.grad for p in model.parameters())],
        }
    return results


def test_a_recomputed_expert_parallel_forward_reads_its_split_sizes_once() -> None:
    """All-to-all takes its split sizes as host lists: the forward reads them, once a layer. A recomputation in
    backward replays the forward's (its routing is the same), where it read them again: a second wait for the
    GPU a layer. Results are identical with and without recomputation."""
    n_layers = 2
    for rank in run_distributed(_ep_split_size_reads, 2, n_layers, timeout=120):
        plain = rank["none"]
        for mode in ("none", "full", "selective"):
            assert rank[mode]["reads"] == n_layers, (mode, rank[mode]["reads"])
            assert torch.equal(rank[mode]["out"], plain["out"]), mode
            assert all(torch.equal(a, b) for a, b in zip(rank[mode]["grads"], plain["grads"])), mode
