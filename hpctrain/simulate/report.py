"""The simulation next to the planner: the same rank, column by column, and the plan's section for it.

The planner (hpctrain.plan.memory) and torch's tracker (hpctrain.simulate.memory) must agree on the model
states, parameters + gradients + optimizer state, within STATES_TOLERANCE: those are sizes of tensors the
layout fixes, and the planner is the figure the checks hold a run to. The collectives' staging buffers (FSDP2's
all-gather outputs and reduce-scatter inputs) are a column of their own on both sides, apart from the model
states (hpctrain.plan.states, "Columns"). Buffers and activations are compared and reported but held to
nothing: CPU SDPA is not the flash attention the planner assumes on GPUs, and the planner
counts a recomputed layer's transient and the loss's fp32 working chunk by formula (docs/planner.md, "The planner
against torch").
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hpctrain.config.layout import Layout
from hpctrain.config.schema import Config
from hpctrain.hardware import GiB
from hpctrain.plan.estimate import Estimates
from hpctrain.plan.memory import stage_parts
from hpctrain.simulate.rank import Simulation, most_loaded_rank, simulate

STATES_TOLERANCE = 0.10  # |planner - torch| / torch on parameters + gradients + optimizer state
COLUMNS = (
    ("parameters", "params"),
    ("gradients", "grads"),
    ("optimizer state", "optimizer"),
    ("buffers", "buffers"),
    ("activations", "activations"),
)
STATES = ("params", "grads", "optimizer")


def planner_columns(est: Estimates, pp_rank: int) -> dict[str, float]:
    """The planner's GPU bytes by column for one pipeline rank (the same parts its memory table lists)."""
    out = {key: 0.0 for _, key in COLUMNS}
    for part in stage_parts(est.model, est.layout, pp_rank):
        if part.on_gpu:
            out[part.kind] += part.bytes
    return out


def comparison(sim: Simulation, est: Estimates) -> dict[str, Any]:
    """Planner vs torch for the simulated rank: bytes by column, each at its own worst over the step on both sides
    (under ZeRO-3 the gathered parameters and the root's gradient are gone by the moment of torch's peak, the
    fp32 loss, yet the planner must hold room for them), the model states' difference and verdict; the total
    is torch's peak, one moment, against the planner's sum of worst cases."""
    planner, torch_ = planner_columns(est, sim.pp_rank), sim.column_peaks
    states_planner = sum(planner[k] for k in STATES)
    states_torch = sum(torch_[k] for k in STATES)
    drift = (states_planner - states_torch) / states_torch if states_torch else 0.0
    return {
        "columns": {key: {"planner": planner[key], "torch": torch_[key]} for _, key in COLUMNS},
        "total": {"planner": sum(planner.values()), "torch": sim.peak},
        "model_states": {
            "planner": states_planner,
            "torch": states_torch,
            "drift": drift,
            "tolerance": STATES_TOLERANCE,
            "within": abs(drift) <= STATES_TOLERANCE,
        },
    }


def simulation_json(sim: Simulation, est: Estimates) -> dict[str, Any]:
    return {**asdict(sim), "snapshot_columns": sim.columns, "unseen": list(sim.unseen), **comparison(sim, est)}


def simulation_lines(data: dict[str, Any]) -> list[str]:
    """The plan's text section: the table, torch's own categories, groups and collectives, what is not seen."""
    g = GiB
    stages = ",".join(map(str, data["stages"]))
    sliced = (
        ""
        if data["microbatches"] == data["step_microbatches"]
        else f" (micro-batches 1 and 2 of {data['step_microbatches']}: the later ones repeat the second's allocations)"
    )
    lines = [
        f"simulation: rank {data['rank']} of {data['world_size']} (pipeline rank {data['pp_rank']}, stage(s) "
        f"{stages}; DP {data['dp_rank']}, TP {data['tp_rank']}"
        + (f", CP {data['cp_rank']}" if data.get("cp_rank") is not None else "")
        + f"), one training step on fake tensors {_where(data)}, "
        f"{data['seconds']:.1f} s{sliced}",
        f"  {'':<18} {'planner':>10} {'torch':>10}  torch vs planner (a column: its most in the step; "
        "total: torch's peak, one moment)",
    ]
    rows = [(name, data["columns"][key]) for name, key in COLUMNS] + [("total", data["total"])]
    for name, row in rows:
        lines.append(
            f"  {name:<18} {row['planner'] / g:6.2f} GiB {row['torch'] / g:6.2f} GiB  "
            f"{_relative(row['torch'], row['planner'])}"
        )
    states = data["model_states"]
    verdict = "within" if states["within"] else "OUTSIDE"
    lines.append(
        f"  model states (parameters + gradients + optimizer): planner {states['planner'] / g:.2f} GiB, "
        f"torch {states['torch'] / g:.2f} GiB: {states['drift']:+.1%}, {verdict} the "
        f"{states['tolerance']:.0%} tolerance"
    )
    lines.append(
        "  torch's peak by its own categories: "
        + ", ".join(f"{name} {b / g:.2f} GiB" for name, b in sorted(data["categories"].items(), key=lambda kv: -kv[1]))
    )
    lines.append(
        f"  process groups: {data['groups_held']} held by this rank; {data['group_calls']} made by the "
        "engine beyond the mesh"
    )
    lines.append(
        f"  collectives in the step: {data['world_collectives']} over all {data['world_size']} ranks; "
        + ", ".join(f"{name} x{n}" for name, n in data["collectives"].items())
    )
    lines.append("  not seen on fake tensors: " + "; ".join(data["unseen"]))
    return lines


def _where(data: dict[str, Any]) -> str:
    """On fake CUDA, with the attention kernels a GPU runs; or on the CPU, and why not on fake CUDA."""
    if data.get("device") == "cuda (fake)":
        kernels = ", ".join(f"{kernel} x{n}" for kernel, n in sorted(data.get("attention", {}).items()))
        return f"on fake CUDA (the GPU's attention kernels: {kernels or 'none'})"
    return f"on the CPU ({data['why_cpu']})" if data.get("why_cpu") else "on the CPU"


def _relative(torch_bytes: float, planner_bytes: float) -> str:
    if not planner_bytes:
        return "" if not torch_bytes else "planner: none"
    return f"{(torch_bytes - planner_bytes) / planner_bytes:+.0%}"


def add_simulation(plan: dict[str, Any], cfg: Config, layout: Layout, est: Estimates) -> None:
    """Simulate the rank plan.simulate_rank names (default: the first rank of the planner's most loaded pipeline
    stage) and add it to the plan: plan["simulation"] and a text section. On fake CUDA where it can run here (a
    GPU's attention kernels, so a GPU's activations), else on the CPU, saying why."""
    rank = cfg.plan.simulate_rank
    if rank is None:
        rank = most_loaded_rank(layout, est.memory.stage)
    data = simulation_json(simulate(cfg, layout, int(rank), device=cfg.plan.simulate_device.value), est)
    plan["simulation"] = data
    plan.setdefault("sections", []).append({"title": "simulation", "lines": simulation_lines(data)})
