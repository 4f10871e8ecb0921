"""The planner applied to a config: memory, FLOPs, step time, communication and bubble for the dry-run plan.

Translates the config's resolved layout into the planner's pure types and collects the estimates as plain
data (the JSON form of the plan) plus the lines of the text table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.config.layout import Layout as ConfigLayout
from hpctrain.plan.flops import flops_per_iteration
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu
from hpctrain.plan.step_time import StepEstimate, estimate_step
from hpctrain.plan.types import GiB, Hardware, Layout, ModelShape, hardware


@dataclass(frozen=True)
class Estimates:
    model: ModelShape
    layout: Layout
    hw: Hardware
    memory: MemoryBreakdown
    step: StepEstimate
    flops_per_iteration: float


def model_shape(cfg: Any) -> ModelShape:
    """The config's model: tokenizer vocabulary, padded per TP as hpctrain.models.gpt builds it, and its dropout."""
    m = cfg.model
    return ModelShape(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=cfg.train.seq_len,
                      vocab_size=m.vocab_size, ffn_hidden=m.ffn_mult * m.d_model,
                      vocab_pad_multiple=m.vocab_pad_multiple, dropout=m.dropout)


def plan_layout(cfg: Any, lay: ConfigLayout) -> Layout:
    return Layout(
        dp=lay.dp, tp=lay.tp, pp=lay.pp, virtual_stages=lay.virtual_stages, zero_stage=lay.zero_stage,
        micro_batch=lay.micro_batch, grad_accum=lay.grad_accum,
        sequence_parallel=bool(cfg.parallel.sequence_parallel), recompute=cfg.parallel.recompute.value,
        offload_optimizer=bool(cfg.zero.offload_optimizer), offload_params=bool(cfg.zero.offload_params),
        schedule=cfg.parallel.schedule, dtype=cfg.precision.dtype.value, dp_replicate=lay.dp_replicate,
        reduce_dtype=cfg.precision.reduce_dtype.value,
    )


def cluster_hardware(cfg: Any) -> Hardware:
    """The GPU type's figures, with the job's GPUs per node (TP and DP links depend on it)."""
    from dataclasses import replace

    return replace(hardware(cfg.cluster.gpu_type), gpus_per_node=cfg.cluster.gpus_per_node)


def estimate(cfg: Any, lay: ConfigLayout) -> Estimates:
    model, layout, hw = model_shape(cfg), plan_layout(cfg, lay), cluster_hardware(cfg)
    return Estimates(
        model=model, layout=layout, hw=hw,
        memory=memory_per_gpu(model, layout, hw),
        step=estimate_step(model, layout, hw),
        flops_per_iteration=flops_per_iteration(model, layout.global_batch, layout.recompute, layout.tp),
    )


def as_json(est: Estimates) -> dict[str, Any]:
    mem, st = est.memory, est.step
    return {
        "memory_per_gpu_bytes": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                                 "activations": mem.activations, "total": mem.total,
                                 "cpu_offload": mem.cpu_offload_bytes, "usable": mem.usable,
                                 "fits": mem.fits, "pipeline_stage": mem.stage},
        "memory_parts_bytes": [{"kind": p.kind, "name": p.name, "bytes": p.bytes, "cpu": p.cpu} for p in mem.parts],
        "flops_per_iteration": est.flops_per_iteration,
        "est_step_time_s": st.step_time_s,
        "est_tokens_per_s": st.tokens_per_s,
        "est_mfu": st.mfu,
        "bubble_fraction": st.bubble_fraction,
        "comm_bytes_per_gpu_per_step": sum(item.bytes for item in st.comm.items),
        "comm_per_gpu_per_step": [{"name": i.name, "kind": i.kind, "bytes": i.bytes, "link": i.link,
                                   "time_s": i.time_s} for i in st.comm.items],
        "step_time_split_s": {"compute": st.compute_s, "tp": st.tp_s, "pp": st.pp_s, "bubble": st.bubble_s,
                              "dp_exposed": st.dp_exposed_s},
    }


def table_lines(est: Estimates) -> list[str]:
    mem, st, hw = est.memory, est.step, est.hw
    g = GiB
    bar_total = max(mem.total, mem.usable)
    lines = [f"per-GPU memory (most loaded GPU: pipeline stage {mem.stage}; {hw.name}, "
             f"{hw.gpu_mem_bytes / g:.0f} GiB, {mem.usable / g:.1f} GiB usable after the reserve)"]
    columns = (("parameters", "params", mem.params), ("gradients", "grads", mem.grads),
               ("optimizer", "optimizer", mem.optimizer), ("activations", "activations", mem.activations),
               ("total", "", mem.total))
    for name, kind, value in columns:
        bar = "#" * round(30 * value / bar_total) if bar_total else ""
        lines.append(f"  {name:<12} {value / g:9.2f} GiB  {bar}")
        lines += [f"  {'':<12} {p.bytes / g:9.2f} GiB    {p.name}" + (" (host memory)" if p.cpu else "")
                  for p in mem.parts if p.kind == kind]
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines.append(f"  {verdict}: headroom {mem.headroom / g:.2f} GiB"
                 + (f"; {mem.cpu_offload_bytes / g:.1f} GiB offloaded to CPU memory" if mem.cpu_offload_bytes else ""))
    comm = sum(i.time_s for i in st.comm.items)
    lines += [
        "",
        "step estimate",
        f"  FLOPs per iteration  {est.flops_per_iteration:.3e} (Narayanan et al. 2021, recompute "
        f"{est.layout.recompute})",
        f"  step time            {st.step_time_s:.3f} s = compute {st.compute_s:.3f} + TP {st.tp_s:.3f} + "
        f"PP {st.pp_s:.3f} + bubble {st.bubble_s:.3f} + exposed DP {st.dp_exposed_s:.3f}",
        f"  throughput           {st.tokens_per_s:,.0f} tokens/s, {st.samples_per_s:,.1f} samples/s",
        f"  MFU                  {st.mfu:.1%} (of {_rate(hw.peak_flops)} per GPU, efficiency "
        f"{hw.efficiency:.0%} of peak assumed for matmuls)",
        f"  pipeline bubble      {st.bubble_fraction:.1%} of the pipeline time ({st.bubble_share:.1%} of the step)",
        f"  communication        {sum(i.bytes for i in st.comm.items) / 1e9:.2f} GB per GPU per step, "
        f"{comm:.3f} s of transfers, {st.comm_share:.1%} of the step exposed",
    ]
    for item in st.comm.items:
        lines.append(f"    {item.name:<28} {item.bytes / 1e9:9.3f} GB over {item.link:<7} {item.time_s:.3f} s")
    return lines


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.0f} GFLOP/s"
