"""NVMe offload of Adam's moments: the chunk plan, bitwise equality with AdamW and with CPU offload on real ranks,
and checkpoints that a resume (NVMe or CPU offload) reads without the old files."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.parallel.nvme import ALIGN, ON_NVME, SPLIT, NvmeAdamW, NvmePathError, chunk_elements, plan_chunks
from tests.distributed_harness import run_distributed
from tests.parallel.layouts import make_cfg, rank_batches

CPU_OFFLOAD = {"zero__stage": 3, "zero__offload_optimizer": True, "zero__offload_params": True}
STEPS = 5


def test_the_chunk_plan_covers_every_element_once_and_splits_only_at_multiples_of_split() -> None:
    sizes = [3 * SPLIT + 5, 7, 1, 2 * SPLIT, 100]
    chunks = plan_chunks(sizes, 2 * SPLIT)
    seen = {i: [] for i in range(len(sizes))}
    for chunk in chunks:
        assert chunk.offset % ALIGN == 0 and chunk.nbytes % ALIGN == 0 and chunk.elements <= 2 * SPLIT
        assert sum(s.length for s in chunk.segments) == chunk.elements
        for seg in chunk.segments:
            seen[seg.param].append((seg.start, seg.start + seg.length))
            assert seg.start % SPLIT == 0 or seg.start == 0
    for i, spans in seen.items():  # contiguous, in order, complete
        assert spans[0][0] == 0 and spans[-1][1] == sizes[i]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
    assert any(len(c.segments) > 1 for c in chunks)  # small parameters share a chunk: one read for all
    assert chunk_elements(64) == 64 * 2**20 // 4 and chunk_elements(0.001) == SPLIT
    with pytest.raises(ValueError, match="multiple of"):
        plan_chunks(sizes, SPLIT + 1)


def test_the_step_and_the_state_are_adamws_bit_for_bit(tmp_path: Path) -> None:
    """Many chunks, two parameter groups, a parameter without a gradient for one step, a state dict read back
    and loaded into a fresh optimizer: always the very bits of torch.optim.AdamW."""
    torch.manual_seed(0)
    shapes = [(300, 70), (70,), (5000, 9), (3,), (64, 64)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]

    def groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]

    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    a = torch.optim.AdamW(groups(ref), fused=True, **hyper)  # the kernel build_optimizer picks on the CPU
    b = NvmeAdamW(groups(mine), tmp_path, 2 * SPLIT, **hyper)
    assert len(b.chunks) > 5 and not list(tmp_path.iterdir())  # the file is unlinked at once

    def step(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer, skip: int | None = None) -> None:
        for i, (p, q) in enumerate(zip(ref, mine)):
            g = torch.randn_like(p)
            p.grad, q.grad = (None, None) if i == skip else (g.clone(), g.clone())
        opt_a.step()
        opt_b.step()

    for s in range(4):
        step(a, b, skip=3 if s == 2 else None)
    assert all(torch.equal(p, q) for p, q in zip(ref, mine))
    assert all(v == ON_NVME for st in b.state.values() for k, v in st.items() if k != "step")  # not in memory
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sa["state"] for k in sa["state"][i])
    fresh = NvmeAdamW(groups(mine), tmp_path, 2 * SPLIT, **hyper)
    fresh.load_state_dict(copy.deepcopy(sb))
    for opt in (a, fresh):  # the lr is set in the groups a load put in place, as the training loop does
        for group in opt.param_groups:
            group["lr"] = 3e-3
    step(a, fresh)
    assert all(torch.equal(p, q) for p, q in zip(ref, mine))
    assert b.io.read_bytes > 0 and b.io.write_bytes > 0 and b.io.steps == 4


def test_a_path_that_cannot_hold_the_moments_is_named_with_its_key(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(NvmePathError, match=r"zero.nvme_path=.*a-file/nvme: cannot create .* writable node-local"):
        NvmeAdamW([torch.nn.Parameter(torch.zeros(8))], blocker / "nvme", SPLIT)
    opt = NvmeAdamW([torch.nn.Parameter(torch.zeros(3 * SPLIT))], tmp_path, SPLIT)
    assert os.fstat(opt.file.fd).st_blocks * 512 >= opt.file.nbytes  # reserved at the start, not sparse


def _train(
    rank: int, world: int, overrides: dict[str, Any], steps: int, save: str = "", load: str = ""
) -> dict[str, Any]:
    """`steps` steps (after loading `load` if given), then save to `save` if given; the full weights back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpctrain.config.layout import resolve_layout
    from hpctrain.parallel.engine import build_engine

    cfg = make_cfg(world, **overrides)
    engine = build_engine(cfg, resolve_layout(cfg), torch.device("cpu"))
    first = 0
    if load:
        state = engine.state_dict()
        dcp.load(state, checkpoint_id=load)
        engine.load_state_dict(state)
        first = 2
    # a warm-up: each step's lr differs (a load replaces the optimizer's groups, and the new ones get it)
    losses = [
        engine.step(rank_batches(s, cfg, engine.dp_rank, engine.dp_size), cfg.optim.lr * (s + 1) / 8).loss
        for s in range(first, first + steps)
    ]
    if save:
        dcp.save(engine.state_dict(), checkpoint_id=save)
    opt = engine.optimizers[0]
    facts: dict[str, Any] = {"kind": type(opt).__name__}
    if isinstance(opt, NvmeAdamW):
        facts.update(
            file_bytes=os.fstat(opt.file.fd).st_size,
            planned=opt.chunks[-1].offset + opt.chunks[-1].nbytes,
            chunks=len(opt.chunks),
            direct=opt.file.direct,
            read=opt.io.read_bytes,
            in_memory=[
                k for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step"
            ],
        )
    weights = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    return {"loss": losses, "weights": {k: v.detach().clone() for k, v in weights.items()}, **facts}


def _nvme(path: Path) -> dict[str, Any]:
    return {
        **CPU_OFFLOAD,
        "zero__offload_optimizer_device": "nvme",
        "zero__nvme_path": str(path),
        "zero__nvme_chunk_mb": 0.05,
    }  # 12,288 elements per chunk: each rank streams several chunks


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["loss"] == b["loss"]
    assert a["weights"].keys() == b["weights"].keys()
    different = [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    assert not different, f"not bitwise equal: {different}"


@pytest.mark.parametrize(
    "world,layout",
    [(2, {}), (4, {"parallel__tp": 2, "parallel__sequence_parallel": True})],
    ids=["zero3_dp2", "zero3_dp2xtp2_sp"],
)  # 1-D and 2-D meshes (TP's DTensors inside FSDP2's)
def test_nvme_offload_gives_cpu_offloads_weights_bit_for_bit_on_real_ranks(
    world: int, layout: dict[str, Any], tmp_path: Path
) -> None:
    cpu = run_distributed(_train, world, {**CPU_OFFLOAD, **layout}, STEPS, timeout=240)
    nvme = run_distributed(_train, world, {**_nvme(tmp_path / "nvme"), **layout}, STEPS, timeout=240)
    for c, n in zip(cpu, nvme):
        assert c["kind"] == "AdamW" and n["kind"] == "NvmeAdamW"
        _same(c, n)
        assert n["chunks"] > 3 and n["file_bytes"] == n["planned"] and n["read"] > 0
        assert n["in_memory"] == []  # between steps no moment is held in host memory
    assert not list((tmp_path / "nvme").iterdir())  # nothing left on the NVMe


def test_a_checkpoint_of_nvme_state_resumes_without_the_old_files(tmp_path: Path) -> None:
    """Save after 2 steps with NVMe offload; resume on another NVMe path, and in CPU offload: both continue
    exactly as the unbroken CPU-offload run."""
    unbroken = run_distributed(_train, 2, CPU_OFFLOAD, STEPS, timeout=240)
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_train, 2, _nvme(tmp_path / "first"), 2, ckpt, timeout=240)
    resumed = run_distributed(_train, 2, _nvme(tmp_path / "second"), STEPS - 2, "", ckpt, timeout=240)
    on_cpu = run_distributed(_train, 2, CPU_OFFLOAD, STEPS - 2, "", ckpt, timeout=240)
    for u, r, c in zip(unbroken, resumed, on_cpu):
        tail = {**u, "loss": u["loss"][2:]}
        _same(tail, r)
        _same(tail, c)
