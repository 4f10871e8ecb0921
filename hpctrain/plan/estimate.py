"""The planner applied to a config: memory, FLOPs, step time, communication and bubble for the dry-run plan.

Takes the run's resolved Layout (the same object the tasks build their mesh from) and collects the estimates
as plain data (the JSON form of the plan); the login side (hpctrain.launch.plan_view) renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpctrain.config.cluster import cluster_hardware
from hpctrain.plan.flops import flops_per_iteration
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu, stage_params_per_gpu
from hpctrain.plan.offload import offload_costs
from hpctrain.plan.step_time import StepEstimate, StepRange, step_range
from hpctrain.plan.types import Hardware, Layout, ModelShape

if TYPE_CHECKING:
    from hpctrain.config.schema import Config


@dataclass(frozen=True)
class Estimates:
    model: ModelShape
    layout: Layout
    hw: Hardware
    memory: MemoryBreakdown
    step: StepEstimate
    flops_per_iteration: float
    range: StepRange  # the step estimate as its two unsourced constants move (step_time.ASSUMED)


def estimate(cfg: Config, layout: Layout) -> Estimates:
    """Memory, step time (with its range) and FLOPs of the run's layout (the run's own Layout object, as
    resolved by hpctrain.config.layout); the checks call it once per run."""
    model, hw = ModelShape.of(cfg.model, cfg.train.seq_len), cluster_hardware(cfg.cluster)
    span = step_range(model, layout, hw)
    if span.point.offload is not None:  # the host figure with the checkpoint tiers' staging copies (offload.py)
        point = replace(span.point, offload=offload_costs(model, layout, hw, checkpoint=cfg.checkpoint))
        span = replace(span, point=point)
    return Estimates(
        model=model,
        layout=layout,
        hw=hw,
        memory=memory_per_gpu(model, layout, hw),
        step=span.point,
        flops_per_iteration=flops_per_iteration(model, layout.global_batch, layout.recompute, layout.tp),
        range=span,
    )


def model_states_per_param(est: Estimates) -> dict[str, float]:
    """The model-state columns over the parameters the most loaded GPU holds as built (its stage, its TP and EP
    share, vocabulary padding included): the ZeRO paper's and Megatron's bytes per parameter (ZeRO-1 with
    Megatron's distributed optimizer 6 + 12/N)."""
    mem = est.memory
    n = stage_params_per_gpu(est.model, est.layout, mem.stage)
    states = {"params": mem.params / n, "grads": mem.grads / n, "optimizer": mem.optimizer / n}
    return {"params_on_gpu": n, **states, "total": (mem.params + mem.grads + mem.optimizer) / n}


def as_json(est: Estimates) -> dict[str, Any]:
    mem, st = est.memory, est.step
    return {
        "memory_per_gpu_bytes": {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "buffers": mem.buffers,
            "activations": mem.activations,
            "total": mem.total,
            "cpu_offload": mem.cpu_offload_bytes,
            "nvme": mem.nvme_bytes,
            "usable": mem.usable,
            "fits": mem.fits,
            "pipeline_stage": mem.stage,
        },
        "memory_parts_bytes": [
            {"kind": p.kind, "name": p.name, "bytes": p.bytes, "cpu": p.cpu, "nvme": p.nvme} for p in mem.parts
        ],
        "model_states_bytes_per_param": model_states_per_param(est),
        "flops_per_iteration": est.flops_per_iteration,
        "est_step_time_s": st.step_time_s,
        "est_tokens_per_s": st.tokens_per_s,
        "est_mfu": st.mfu,
        "hardware": {
            "gpu_type": est.hw.name,
            "peak_flops": est.hw.peak_flops,
            "fp8_flops": est.hw.fp8_flops,
            "intra_node_bw": est.hw.intra_node_bw,
            "inter_node_bw": est.hw.inter_node_bw,
            "nvlink_gpus": est.hw.nvlink_gpus,
            "gpu_mem_bytes": est.hw.gpu_mem_bytes,
            "from_cluster": list(est.hw.overridden),  # the rest: the datasheets (hpctrain/hardware.py)
        },
        "bubble_fraction": st.bubble_fraction,
        "comm_bytes_per_gpu_per_step": sum(item.bytes for item in st.comm.items),
        "comm_per_gpu_per_step": [
            {"name": i.name, "kind": i.kind, "bytes": i.bytes, "link": i.link, "time_s": i.time_s}
            for i in st.comm.items
        ],
        "step_time_split_s": {
            "compute": st.compute_s,
            "tp": st.tp_s,
            "pp": st.pp_s,
            "ep": st.ep_s,
            "expert_imbalance": st.imbalance_s,
            "bubble": st.bubble_s,
            "dp_exposed": st.dp_exposed_s,
            "offload": st.offload_s,
        },
        "offload": offload_json(st, est.hw),
        "est_samples_per_s": st.samples_per_s,
        **range_json(est.range),
    }


def offload_json(st: StepEstimate, hw: Hardware) -> dict[str, Any] | None:
    """ZeRO offload's footprint per node against the node's host memory and NVMe, its traffic and time per step
    (hpctrain.plan.offload); None without offload."""
    o = st.offload
    if o is None:
        return None
    g, h = o.gpus_per_node, o.host
    return {
        "device": o.device,
        "params_per_rank": o.shard_params,
        "gpus_per_node": o.gpus_per_node,
        "host_bytes_per_node": o.host_bytes_per_node,
        "host_memory_per_node": hw.host_mem_bytes,
        "host_per_node_bytes": {
            "offloaded_shards": g * h.shards,
            "pinned_rounding": g * h.pinned_rounding,
            "checkpoint_staging_per_tier": g * h.staging_per_tier,
            "checkpoint_staging_rounding_per_tier": g * h.staging_rounding_per_tier,
            "checkpoint_tiers": h.tiers,
            "nvme_save_readback": g * h.save_readback,
            "pinned": h.pinned,
        },
        "nvme_bytes_per_node": o.nvme_bytes_per_node,
        "nvme_capacity_per_node": hw.nvme_bytes,
        "nvme_read_bytes_per_step": o.nvme_read_bytes,
        "nvme_write_bytes_per_step": o.nvme_write_bytes,
        "pcie_bytes_per_gpu_per_step": o.pcie_bytes,
        "h2d_bytes_per_gpu_per_step": o.h2d_bytes,
        "d2h_bytes_per_gpu_per_step": o.d2h_bytes,
        "param_all_gathers_per_step": o.all_gathers,
        "time_s": {
            "pcie": o.pcie_s,
            "cpu_adam": o.cpu_adam_s,
            "nvme_read": o.nvme_read_s,
            "nvme_write": o.nvme_write_s,
            "optimizer_step": o.optimizer_s,
            "exposed": o.exposed_s,
        },
        "nvme_bound": o.nvme_bound,
        "slowdown_vs_no_offload": st.offload_slowdown,
    }


def range_json(span: StepRange) -> dict[str, Any]:
    """The assumptions with their intervals and what each end gives alone; the slowest and fastest corners."""

    def figures(st: StepEstimate) -> dict[str, float]:
        return {
            "samples_per_s": st.samples_per_s,
            "tokens_per_s": st.tokens_per_s,
            "step_time_s": st.step_time_s,
            "mfu": st.mfu,
        }

    return {
        "assumptions": [
            {
                "name": a.name,
                "value": a.value,
                "interval": [a.low, a.high],
                "why": a.why,
                "at_low": figures(low),
                "at_high": figures(high),
            }
            for a, (low, high) in zip(span.assumptions, span.alone)
        ],
        "est_range": {"slowest": figures(span.slowest), "fastest": figures(span.fastest)},
    }
