"""Check c: a checkpoint saved from the device and resumed into a fresh engine, compared bit for bit, through
the real training loop with its engine observed; with dropout, the resumed step's loss equals the uninterrupted
run's only if the RNG streams were restored."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import (
    Ctx,
    Outcome,
    compose,
    expect,
    free_port,
    init_world,
    one_rank_backend,
    read_metrics,
    run_train,
    small_overrides,
)

SAVE_AT, STEPS = 3, 4  # run A saves at step 3; runs B (resumed) and C (uninterrupted) end at step 4


def cpu_copy(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A flat deep copy of a state dict, tensors on the CPU (DTensors gathered), keyed by path."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(cpu_copy(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(cpu_copy(v, f"{prefix}{i}/"))
    elif isinstance(tree, torch.Tensor):
        t = tree.full_tensor() if isinstance(tree, DTensor) else tree
        out[prefix.rstrip("/")] = t.detach().to("cpu", copy=True)
    else:
        out[prefix.rstrip("/")] = copy.deepcopy(tree)
    return out


def bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def differences(saved: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(loaded))
    return [k for k in keys if k not in saved or k not in loaded or not bitwise_equal(saved[k], loaded[k])]


def check_c(ctx: Ctx) -> Outcome:
    """Through the real loop: run A trains 3 steps and saves (the engine's state is copied to the CPU inside
    the save's own state_dict() call); run B resumes A's run directory into a fresh engine (weights from the
    seed) and trains step 4; run C trains 4 steps without interruption. The state B loaded must equal A's
    saved copy bit for bit, and B's step-4 loss must equal C's."""
    import torch

    run_dir = ctx.workdir / "c_checkpoint"
    seen = _run_observed(ctx, run_dir)
    saved, before, after = seen["saved"][0], seen["before_load"], seen["after_load"]
    expect(isinstance(after, dict), "run B did not load a checkpoint")
    changed_by_training = sum(1 for k, v in before.items() if k in saved and not bitwise_equal(saved[k], v))
    expect(changed_by_training > 0, "the saved weights equal the fresh engine's: the comparison would prove nothing")
    diff = differences(saved, after)
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    n_bytes = sum(saved[k].numel() * saved[k].element_size() for k in tensors)
    optim_tensors = sum(1 for k in tensors if k.startswith("optim/"))
    expect(optim_tensors > 0, "the saved state holds no optimizer tensors")
    expect(not diff, f"{len(diff)} of {len(saved)} entries differ after the resume, e.g. {diff[:3]}")
    resumed = read_metrics(run_dir)
    uninterrupted = {m["step"]: m for m in read_metrics(ctx.workdir / "c_uninterrupted")}
    last = resumed[-1]
    expect(
        last["step"] == STEPS and last["consumed_samples"] == uninterrupted[STEPS]["consumed_samples"],
        f"the resumed run ended at step {last['step']} with {last['consumed_samples']} samples consumed",
    )
    expect(
        last["loss"] == uninterrupted[STEPS]["loss"],
        f"step {STEPS} loss {last['loss']!r} after the resume != {uninterrupted[STEPS]['loss']!r} without one",
    )
    numbers = {
        "saved_step": SAVE_AT,
        "entries": len(saved),
        "tensors": len(tensors),
        "optimizer_tensors": optim_tensors,
        "bytes": n_bytes,
        "weights_changed_by_training": changed_by_training,
        "step4_loss": last["loss"],
    }
    return Outcome(
        True,
        f"step {SAVE_AT}: {len(tensors)} tensors ({optim_tensors} optimizer, {n_bytes / 1e6:.1f} MB)"
        f" bitwise equal after resume; step {STEPS} loss = uninterrupted run's ({last['loss']:.4f})",
        numbers,
    )


def _run_observed(ctx: Ctx, run_dir: Path) -> dict[str, Any]:
    """Runs A, B (both in run_dir) and C with the loop's build_engine observed; what it saw, as `_observed` keeps it."""
    from hpctrain.train import loop

    tier = f"checkpoint.tiers=[{{name: fast, path: {ctx.workdir / 'c_tier'}, interval_steps: {SAVE_AT}, keep_last: 2}}]"

    def config(name: str, max_steps: int) -> dict[str, Any]:
        # A constant lr: the 3-step run A and the 4-step runs B and C take the same first 3 steps. Dropout:
        # step 4's masks come from the generator the checkpoint restored (the CUDA one on a GPU).
        return compose(
            ctx,
            [
                *small_overrides(ctx, name, 1, max_steps),
                "checkpoint=default",
                tier,
                "checkpoint.save_final=false",
                "optim.decay=constant",
                "model.dropout=0.1",
            ],
        )

    seen: dict[str, Any] = {"saved": [], "before_load": None, "after_load": None, "fresh": None}
    original = loop.build_engine
    loop.build_engine = _observed(original, seen)
    try:
        for name, max_steps, where in (
            ("c_checkpoint", SAVE_AT, run_dir),
            ("c_checkpoint", STEPS, run_dir),
            ("c_uninterrupted", STEPS, ctx.workdir / "c_uninterrupted"),
        ):
            init_world(ctx, 0, 1, free_port(), one_rank_backend(ctx))
            run_train(config(name, max_steps), where)
            if max_steps == SAVE_AT:
                expect(
                    len(seen["saved"]) == 1,
                    f"run A called state_dict() {len(seen['saved'])} times, expected once (its save at step 3)",
                )
                seen["before_load"] = False  # from here on, state_dict() calls are not saves
    finally:
        loop.build_engine = original
    return seen


def _observed(original: Callable[..., Any], seen: dict[str, Any]) -> Callable[..., Any]:
    """The loop's own engine builder, observed into `seen`: run A's saved state ("saved"), the fresh weights of
    runs B and C ("fresh"), and what B had before and after its load ("before_load", "after_load")."""

    def capturing(cfg: Any, layout: Any, device: Any) -> Any:
        engine = original(cfg, layout, device)
        state_dict, load_state_dict = engine.state_dict, engine.load_state_dict
        if seen["before_load"] is not None:  # runs B and C: the weights from the seed, read from the parameters:
            # engine.state_dict() on a fresh engine would initialise AdamW's state (torch runs a zero-lr step, so
            # the step count starts at 1 and the run changes), and DCP loads in place into its tensors.
            seen["fresh"] = {
                f"model/{name.removeprefix('module.')}": p.detach().to("cpu", copy=True)
                for part in getattr(engine, "model_parts", [])
                for name, p in part.named_parameters()
            }

        def saving_state_dict() -> dict[str, Any]:
            state = state_dict()
            if seen["before_load"] is None:  # run A: this call is the save's, staged right after this copy
                seen["saved"].append(cpu_copy(state))
            return state

        def observed_load(state: dict[str, Any]) -> None:
            seen["before_load"] = seen["fresh"]
            load_state_dict(state)
            seen["after_load"] = cpu_copy(state_dict())

        engine.state_dict, engine.load_state_dict = saving_state_dict, observed_load
        return engine

    return capturing
