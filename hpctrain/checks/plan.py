"""The checks that need the planner: they read the plan's estimates (memory per GPU against the GPU, the pipeline
bubble with the micro-batch count the plan finds faster, context parallelism where nothing fits without it, ZeRO
offload against the node's host memory and NVMe). hpctrain.checks.runner runs them after the config's own rules
(hpctrain.checks.config), in PLAN_CHECKS' order: `_bubble` reads the estimate `_memory` leaves in the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hpctrain.checks.config import workload
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout
from hpctrain.config.rules import CP, expert_rules, key_of, microbatch_rules
from hpctrain.config.schema import SCHEDULES, Config
from hpctrain.plan.auto import better_microbatches, context_for_fit
from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.estimate import estimate
from hpctrain.plan.memory import memory_per_gpu
from hpctrain.plan.offload import offload_costs
from hpctrain.plan.types import KNOWN_HARDWARE, GiB


def _bubble(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Few microbatches for the pipeline: the bubble's share of the step, and a count the plan finds faster (after
    `_memory`, whose estimate it reads)."""
    p = cfg.parallel
    if lay.pp == 1 or r.errors or p.schedule not in SCHEDULES:
        return
    mb = lay.microbatches
    if microbatch_rules(p.schedule, lay.pp, lay.virtual_stages, mb):
        return  # an error of the config's checks
    bubble = bubble_fraction(lay.pp, mb, lay.virtual_stages, p.schedule)
    if mb < 4 * lay.pp and r.estimates is not None:
        r.warn(
            "train.grad_accum",
            f"{mb} microbatches on {lay.pp} stages: the pipeline bubble is {bubble:.1%} of each step",
            _microbatch_fix(r.estimates, lay.zero_stage),
        )


def _microbatch_fix(est: Any, zero_stage: int) -> str:
    """Only a count the plan's own estimate finds faster (more microbatches re-gather ZeRO-3's weights)."""
    tip = better_microbatches(est.model, est.layout, est.hw)
    if tip is not None:
        return (
            f"use train.micro_batch={tip.micro_batch} ({tip.microbatches} microbatches, bubble "
            f"{tip.bubble_fraction:.1%}): the plan estimates {tip.step_time_s:.1f} s per step instead of "
            f"{tip.current_step_time_s:.1f} s"
        )
    return (
        "no other number of microbatches makes this layout faster by the plan's estimate"
        + (" (under ZeRO-3 each one re-gathers the weights)" if zero_stage == 3 else "")
        + "; plan.search=5 ranks faster layouts (e.g. interleaved schedules)"
    )


# gpu_type=cpu: an estimate this many times the cpu entry's (placeholder) memory is an error, not a warning: 7 TiB
# per process, which no machine holds (a CPU run of a model a few times over the placeholder may still fit).
CPU_BEYOND = 1000


def _memory(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Estimate memory per GPU (planner) once the layout is valid; on GPUs a layout that cannot fit is an error, on
    gpu_type=cpu one past CPU_BEYOND times the placeholder memory (a warning below that)."""
    if cfg.cluster.gpu_type not in KNOWN_HARDWARE:
        r.error(
            "cluster.gpu_type",
            f"unknown GPU type {cfg.cluster.gpu_type!r}",
            f"use one of {', '.join(sorted(KNOWN_HARDWARE))}",
        )
        return
    if r.errors:
        return
    r.estimates = est = estimate(cfg, lay)
    mem = est.memory
    if mem.fits:
        if mem.headroom < 0.05 * mem.usable:
            r.warn(
                "parallel",
                f"estimated {mem.total / GiB:.1f} GiB per GPU leaves under 5% headroom of "
                f"{mem.usable / GiB:.1f} GiB usable",
                "expect fragmentation OOMs; consider more recompute or sharding",
            )
        return
    fixes = []
    if cfg.parallel.recompute.value != "full":
        fixes.append("parallel.recompute=" + ("selective" if cfg.parallel.recompute.value == "none" else "full"))
    if lay.zero_stage < 3 and lay.dp > 1:
        fixes.append(f"zero.stage={lay.zero_stage + 1}")
    if lay.micro_batch > 1:
        fixes.append(f"train.micro_batch={lay.micro_batch // 2}")
    w = workload(cfg, lay)  # a wider ep that the layout rules allow (none on a dense model)
    wider = [e for e in range(lay.ep + 1, lay.dp_shard + 1) if lay.dp_shard % e == 0 and not expert_rules(e, w)]
    if wider:
        fixes.append(f"parallel.ep={wider[0]} (each GPU holds 1/{wider[0]} of the experts)")
    fixes.append("more pipeline stages (parallel.pp) or tensor parallelism (parallel.tp)")
    message = (
        f"estimated {mem.total / GiB:.1f} GiB per GPU (params {mem.params / GiB:.1f}, grads "
        f"{mem.grads / GiB:.1f}, optimizer {mem.optimizer / GiB:.1f}, buffers {mem.buffers / GiB:.1f}, "
        f"activations {mem.activations / GiB:.1f}) "
        f"exceeds the {mem.usable / GiB:.1f} GiB usable on each {cfg.cluster.gpu_type} GPU"
    )
    if cfg.cluster.gpu_type == "cpu" and mem.total <= CPU_BEYOND * mem.usable:
        r.warn("parallel", message, "try: " + ", or ".join(fixes))  # the cpu entry's memory is a placeholder
    elif cfg.cluster.gpu_type == "cpu":
        r.error(
            "parallel",
            f"{message}, {mem.total / mem.usable:,.0f} times over: no machine holds that per "
            f"process (the cpu entry's {mem.usable / GiB:.1f} GiB is a placeholder, so up to {CPU_BEYOND:,} "
            "times over is only a warning)",
            "try: " + ", or ".join(fixes),
        )
    else:
        r.error("parallel", message, "try: " + ", or ".join(fixes))


def _context(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """A layout that does not fit, where splitting each sequence over more GPUs (context parallelism: the activations
    are per local token) would: the smallest CP degree that fits and that the layout rules allow (plan.auto's
    context_for_fit: never for an MoE model), its GPUs taken from DP (after `_memory`)."""
    est = r.estimates
    if est is None or est.memory.fits:
        return
    fit = context_for_fit(est.model, lay, est.hw, compile=cfg.parallel.compile)
    if fit is None:
        return
    wider, mem = fit
    r.warn(
        CP,
        f"the activations of {cfg.train.seq_len}-token sequences ({est.memory.activations / GiB:.1f}"
        f" GiB per GPU at cp={lay.cp}) leave {est.memory.total / GiB:.1f} GiB, over the {mem.usable / GiB:.1f} "
        f"GiB usable; cp={wider.cp} splits each sequence over {wider.cp} GPUs: {mem.total / GiB:.1f} GiB "
        f"(activations {mem.activations / GiB:.1f})",
        f"set {CP}={wider.cp} {key_of('dp')}={wider.dp} (the same GPUs and global batch, "
        f"{wider.grad_accum} micro-batches per DP rank)",
    )


HOST_MEMORY_WARN = 0.8  # offloaded state above this share of a node's host memory leaves too little for the rest
OFFLOAD_SHARE_WARN = 0.10  # exposed offload time above this share of the step: warn


def _offload(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """ZeRO offload against the node (hpctrain.plan.offload): host memory and NVMe space per node, and whether the
    step is bound by the offload (the NVMe traffic, or the CPU step and copies), with the predicted slowdown."""
    est = r.estimates
    if est is None or est.step.offload is None:
        return
    st, hw, o = est.step, est.hw, est.step.offload
    gpu = cfg.cluster.gpu_type
    report = r.warn if gpu == "cpu" else r.error  # the cpu entry's host figures are placeholders
    shards = f"{o.gpus_per_node} GPUs x {o.shard_params / 1e6:,.0f}M parameters per rank"
    bigger_dp = (
        f"more nodes or a larger DP (now {lay.dp}; each rank's shard is 1/{lay.zero_shard} of its GPU's parameters)"
    )
    slowdown = f"{st.offload_slowdown:.0%} slower than the same layout without offload"
    host, have = o.host_bytes_per_node, hw.host_mem_bytes
    if host > have or host > HOST_MEMORY_WARN * have:
        fix = bigger_dp + (
            ""
            if o.device == "nvme"
            else ", or zero.offload_optimizer_device=nvme (Adam's moments, "
            "half of the offloaded shards, go to node-local NVMe) with zero.nvme_path"
        )
        if o.host.tiers:
            fix += (
                f", or fewer checkpoint tiers (each keeps a staged copy of every rank's state in host memory: "
                f"{o.host.staging_per_tier * o.gpus_per_node / GiB:,.1f} GiB per node)"
            )
        message = (
            f"offload keeps {host / GiB:,.1f} GiB per node in host memory ({shards}: {o.host_terms()}), "
            f"{host / have:.0%} of the {have / GiB:,.0f} GiB a {gpu} node has (hpctrain/hardware.py)"
        )
        if host > have:
            report("zero.offload_optimizer", message, fix)
        else:
            r.warn(
                "zero.offload_optimizer",
                message + ": too little is left for the OS, data loaders and pinned buffers",
                fix,
            )
    if o.device == "nvme" and o.nvme_bytes_per_node > hw.nvme_bytes:
        report(
            "zero.nvme_path",
            f"Adam's moments take {o.nvme_bytes_per_node / 1e12:,.2f} TB of NVMe per node "
            f"({shards}, 8 bytes each), more than the {hw.nvme_bytes / 1e12:.2f} TB a {gpu} node has",
            bigger_dp + ", or zero.offload_optimizer_device=cpu if host memory allows",
        )
    if o.device == "nvme" and o.nvme_bound:
        # CPU offload: the moments resident in host memory instead of read back for a save
        need = (o.host_bytes_per_gpu - o.host.save_readback + o.nvme_bytes_per_gpu) * o.gpus_per_node
        r.warn(
            "zero.offload_optimizer_device",
            f"the NVMe traffic bounds the optimizer step: "
            f"{o.nvme_read_bytes / 1e9:.2f} GB read + {o.nvme_write_bytes / 1e9:.2f} GB written per node and "
            f"step take {o.nvme_s:.2f} s, the CPU's Adam {o.cpu_adam_s:.2f} s; offload adds {st.offload_s:.2f} s "
            f"to a {st.step_time_s:.2f} s step: {slowdown}",
            f"{bigger_dp}; zero.offload_optimizer_device=cpu if host memory allows ({need / GiB:,.1f} GiB per "
            f"node of {hw.host_mem_bytes / GiB:,.0f}); or a faster NVMe (zero.nvme_path on more drives)",
        )
    elif st.offload_share > OFFLOAD_SHARE_WARN:
        r.warn(
            "zero.offload_optimizer",
            f"offload adds {st.offload_s:.2f} s to a {st.step_time_s:.2f} s step "
            f"(CPU Adam {o.cpu_adam_s:.2f} s"
            + (f", NVMe {o.nvme_s:.2f} s" if o.device == "nvme" else "")
            + f", PCIe copies {o.pcie_s:.2f} s): {slowdown}",
            _offload_fix(cfg, lay, est, bigger_dp),
        )
    threads = cfg.train.threads_per_rank
    slow = offload_costs(est.model, lay, hw, threads_per_rank=threads)
    if slow.cpu_adam_s > 1.25 * o.cpu_adam_s:
        enough = -(-hw.adam_rate_per_gpu() // hw.cpu_adam_core_rate)
        r.warn(
            "train.threads_per_rank",
            f"each rank's CPU AdamW step runs on {threads} thread(s): "
            f"{slow.cpu_adam_s:.2f} s per step instead of the {o.cpu_adam_s:.2f} s the plan assumes with the "
            f"rank's share of the node's {hw.cpu_cores} cores",
            f"set train.threads_per_rank={enough:.0f} and cluster.cpus_per_task>={enough:.0f}",
        )


def _offload_fix(cfg: Config, lay: Layout, est: Any, bigger_dp: str) -> str:
    """The fixes for a step bound by offload; without offload only if the plan finds it fits on the GPU."""
    fixes = [bigger_dp]
    plain = memory_per_gpu(
        est.model, replace(lay, offload_optimizer=False, offload_params=False, offload_device="cpu"), est.hw
    )
    if plain.fits:
        fixes.append(
            f"no offload (zero=stage{lay.zero_stage}): the plan puts it at {plain.total / GiB:.1f} GiB per "
            f"GPU of {plain.usable / GiB:.1f} usable"
        )
    if est.step.offload.device == "nvme":
        fixes.append("zero.offload_optimizer_device=cpu if host memory allows")
    return "; or ".join(fixes)


PLAN_CHECKS: list[Callable[[Config, Layout, CheckReport], None]] = [_memory, _context, _offload, _bubble]
