"""The plan's text sections: parameters per stage, the memory table, the step estimate with its assumptions and
range, and the layout search. Login side: the planner (hpctrain.plan) returns data, this turns it into lines.
"""

from __future__ import annotations

from typing import Any

from hpctrain.hardware import GB, GiB, Hardware
from hpctrain.plan.estimate import Estimates
from hpctrain.plan.search import Candidate, explain


def stage_lines(counts: dict[str, Any], tp: int, ep: int = 1) -> list[str]:
    """Parameters per pipeline rank and per GPU after the TP split, and with expert parallelism after the EP split
    of the experts (closed form, hpctrain.models.params)."""
    stages, ranks = counts["params_per_stage"], counts["stages_of_rank"]
    split = f"TP {tp}" + (f", EP {ep}" if ep > 1 else "")
    lines = [
        f"parameters per pipeline rank: {len(stages)} stages, {split} ({counts['last_stage_head']} on the last stage)"
    ]
    for r, (mine, per_gpu) in enumerate(zip(ranks, counts["params_per_gpu_before_zero"])):
        lines.append(
            f"  pipeline rank {r}: stage(s) {','.join(map(str, mine))} "
            f"{sum(stages[s] for s in mine):>16,} params, {per_gpu:>15,} per GPU after "
            + ("TP and EP" if ep > 1 else "TP")
        )
    return lines


def memory_lines(est: Estimates) -> list[str]:
    """The most loaded GPU's memory, column by column with its parts, and whether it fits."""
    mem, hw, g = est.memory, est.hw, GiB
    bar_total = max(mem.total, mem.usable)
    lines = [
        f"per-GPU memory (most loaded GPU: pipeline stage {mem.stage}; {hw.name}, "
        f"{hw.gpu_mem_bytes / g:.0f} GiB, {mem.usable / g:.1f} GiB usable after the reserve)"
    ]
    columns = (
        ("parameters", "params", mem.params),
        ("gradients", "grads", mem.grads),
        ("optimizer", "optimizer", mem.optimizer),
        ("buffers", "buffers", mem.buffers),
        ("activations", "activations", mem.activations),
        ("total", "", mem.total),
    )
    for name, kind, value in columns:
        bar = "#" * round(30 * value / bar_total) if bar_total else ""
        lines.append(f"  {name:<12} {value / g:9.2f} GiB  {bar}")
        lines += [f"  {'':<12} {p.bytes / g:9.2f} GiB    {p.name}" + _place(p) for p in mem.parts if p.kind == kind]
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    lines.append(
        f"  {verdict}: headroom {mem.headroom / g:.2f} GiB"
        + (f"; {mem.cpu_offload_bytes / g:.1f} GiB offloaded to CPU memory" if mem.cpu_offload_bytes else "")
        + (f", {mem.nvme_bytes / g:.1f} GiB to NVMe" if mem.nvme_bytes else "")
    )
    return lines + offload_memory_lines(est)


def _place(part: Any) -> str:
    return " (node-local NVMe)" if part.nvme else " (host memory)" if part.cpu else ""


def offload_memory_lines(est: Estimates) -> list[str]:
    """ZeRO offload's footprint per node (all its GPUs' shards) against the node's host memory and NVMe."""
    o, hw, g = est.step.offload, est.hw, GiB
    if o is None:
        return []
    lines = [
        f"  host memory per node  {o.host_bytes_per_node / g:9.2f} GiB of {hw.host_mem_bytes / g:.0f} GiB "
        f"({o.gpus_per_node} GPUs x {o.host_bytes_per_gpu / g:.2f} GiB):",
        f"  {'':<21} {o.host_terms()}",
    ]
    if o.device == "nvme":
        lines.append(
            f"  NVMe per node         {o.nvme_bytes_per_node / g:9.2f} GiB of {hw.nvme_bytes / 1e12:.1f} TB "
            f"(Adam moments: {o.gpus_per_node} GPUs x {o.nvme_bytes_per_gpu / g:.2f} GiB)"
        )
    return lines


def step_lines(est: Estimates) -> list[str]:
    """The step estimate, the assumptions it rests on and the range they span, then the traffic."""
    st, hw = est.step, est.hw
    comm = sum(i.time_s for i in st.comm.items)
    lines = [
        "step estimate",
        f"  FLOPs per iteration  {est.flops_per_iteration:.3e} (Narayanan et al. 2021, recompute "
        f"{est.layout.recompute})",
        f"  step time            {st.step_time_s:.3f} s = compute {st.compute_s:.3f} + TP {st.tp_s:.3f} + "
        f"PP {st.pp_s:.3f}"
        + (f" + EP all-to-all {st.ep_s:.3f} + expert imbalance {st.imbalance_s:.3f}" if est.layout.ep > 1 else "")
        + (f" + CP K/V {st.cp_s:.3f}" if est.layout.cp > 1 else "")
        + f" + bubble {st.bubble_s:.3f} + exposed DP {st.dp_exposed_s:.3f}"
        + (f" + offload {st.offload_s:.3f}" if st.offload is not None else ""),
        *offload_step_lines(est),
        f"  throughput           {st.tokens_per_s:,.0f} tokens/s, {st.samples_per_s:,.1f} samples/s",
        f"  MFU                  {st.mfu:.1%} (of {_rate(hw.peak_flops)} per GPU, efficiency "
        f"{hw.efficiency:.0%} of peak assumed for matmuls)",
        hardware_line(hw),
        *range_lines(est),
        f"  pipeline bubble      {st.bubble_fraction:.1%} of the pipeline time ({st.bubble_share:.1%} of the step)",
        f"  communication        {sum(i.bytes for i in st.comm.items) / 1e9:.2f} GB per GPU per step, "
        f"{comm:.3f} s of transfers, {st.comm_share:.1%} of the step exposed",
    ]
    for item in st.comm.items:
        lines.append(f"    {item.name:<28} {item.bytes / 1e9:9.3f} GB over {item.link:<7} {item.time_s:.3f} s")
    return lines


def hardware_line(hw: Hardware) -> str:
    """Whose figures the estimate used: the datasheet's (hpctrain/hardware.py) or the cluster's keys."""
    mine = set(hw.overridden)

    def whose(key: str) -> str:
        return f" ({key})" if key in mine else ""

    domain = f" across {hw.nvlink_gpus} GPUs" if hw.nvlink_gpus > hw.gpus_per_node else ""
    return (
        f"  hardware             {hw.name}: {_rate(hw.peak_flops)} dense BF16{whose('cluster.gpu_peak_tflops')}, "
        f"NVLink {hw.intra_node_bw / GB:,.0f} GB/s{domain}{whose('cluster.intra_node_gb_s')}, network "
        f"{hw.inter_node_bw / GB:,.0f} GB/s{whose('cluster.inter_node_gb_s')} per GPU each way; "
        + ("the figures in brackets are the cluster's, the rest" if mine else "all")
        + " from the datasheets (hpctrain/hardware.py)"
    )


def offload_step_lines(est: Estimates) -> list[str]:
    """Where the offload's time goes (hpctrain.plan.offload): PCIe copies, the CPU's Adam step, NVMe traffic."""
    st, hw = est.step, est.hw
    o = st.offload
    if o is None:
        return []
    lines = [
        f"  offload              {st.offload_s:.3f} s exposed = optimizer step on the CPU {o.optimizer_s:.3f} + "
        f"PCIe {o.pcie_s:.3f}: {st.offload_slowdown:.1%} slower than without offload",
        f"    PCIe per GPU       {o.pcie_bytes / 1e9:.3f} GB per step ({o.all_gathers} x "
        f"{o.h2d_bytes / max(o.all_gathers, 1) / 1e9:.3f} GB of parameter shard to the GPU, "
        f"{o.d2h_bytes / 1e9:.3f} GB of gradient shard back) at "
        f"{hw.pcie_bw / 1e9:.0f} GB/s",
        f"    CPU Adam           {o.shard_params / 1e6:,.1f}M parameters per rank at "
        f"{hw.adam_rate_per_gpu() / 1e9:.2f}e9 per second (the node's {hw.cpu_adam_rate / 1e9:.1f}e9 shared by "
        f"{o.gpus_per_node} ranks): "
        f"{o.cpu_adam_s:.3f} s",
    ]
    if o.device == "nvme":
        lines.append(
            f"    NVMe per node      {o.nvme_read_bytes / 1e9:.2f} GB read + {o.nvme_write_bytes / 1e9:.2f} GB "
            f"written per step at {hw.nvme_read_bw / 1e9:.0f}/{hw.nvme_write_bw / 1e9:.0f} GB/s: "
            f"{o.nvme_read_s:.3f} + {o.nvme_write_s:.3f} s, overlapping the update: "
            + ("the drives bound the optimizer step" if o.nvme_bound else "the CPU bounds the optimizer step")
        )
    return lines


def range_lines(est: Estimates) -> list[str]:
    """The unsourced constants (two; a third, the routing's imbalance, under expert parallelism), what each alone
    moves the estimate to, and the span of all of them together."""
    span = est.range
    n = len(span.assumptions)
    lines = [
        f"  assumptions          {'two' if n == 2 else 'three'} constants no source pins carry the absolute numbers:"
    ]
    for a, (low, high) in zip(span.assumptions, span.alone):
        lines.append(f"    {a.name} {a.value:g}, plausible {a.low:g}-{a.high:g}: {_samples(low, high)} ({a.why})")
    slow, fast = span.slowest, span.fastest
    lines.append(
        f"  range                {_samples(slow, fast)}, MFU {slow.mfu:.1%}-{fast.mfu:.1%}, step "
        f"{fast.step_time_s:.2f}-{slow.step_time_s:.2f} s with {'both' if n == 2 else 'all three'} over "
        "their intervals: the estimate ranks layouts, it does not predict a run"
    )
    return lines


def search_lines(candidates: list[Candidate], mine: Candidate, rank: int, top_k: int, where: str) -> list[str]:
    """The top layouts of the search and where the configured one ranks (`rank`), with what holds it back."""
    lines = [f"layout search: {len(candidates)} layouts fit on {where}, fastest first (estimates)"]
    lines += [f"  {i + 1:>3}. {c.why}" for i, c in enumerate(candidates[:top_k])]
    lines.append(f"  the configured layout ranks {rank} of {len(candidates)}:")
    lines += [f"    {line}" for line in explain(mine, candidates[0] if candidates else None).splitlines()]
    return lines


def _samples(a: Any, b: Any) -> str:
    low, high = sorted((a.samples_per_s, b.samples_per_s))
    return f"{low:,.1f}-{high:,.1f} samples/s"


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.0f} GFLOP/s"
