"""A first-order estimate of one training step's time, to rank layouts (not to promise numbers).

Model (all per GPU, the most loaded one):
  compute  = hardware FLOPs of the iteration (flops.py, with the layout's recomputation) / n_gpus
             / (peak * efficiency). Work is assumed evenly spread (the logit layer on the last stage is not).
             With precision.fp8 the blocks' Linear GEMMs run at the GPU's FP8 peak (Hardware.fp8_flops), the
             attention core and the logit layer at the bf16 peak (flops.compute_seconds). MFU and HFU stay
             against the bf16 peak, so they compare across precisions (an FP8 run can pass what bf16 could reach).
             Selective recomputation adds its element-wise rerun (norms, RoPE, activations: memory-bound, timed by
             HBM traffic, `selective_rerun_seconds`), so it is not free against `none`.
  busy     = compute + exposed TP traffic + exposed PP sends + expert parallelism. TP collectives sit between
             the matmuls of every layer and are taken as fully exposed; PP sends likewise by default. Expert
             parallelism (a Mixture of Experts with ep > 1): its all-to-alls (comm.py) sit between the router and
             the experts and between the experts and the combine, fully exposed, and every rank waits at the
             combine for the busiest one, whose experts run EXPERT_IMBALANCE x the mean rows: (imbalance - 1) x
             the experts' GEMM time (flops.expert_flops_per_iteration) on top of compute.
             Context parallelism's key/value all-gathers and gradient reduce-scatters (comm.py) are taken as fully
             exposed too: each layer's gather is needed by that layer's attention, right after its QKV projection.
             Compute per GPU is the iteration's FLOPs over all dp x tp x pp x cp GPUs: the causal load balancing
             gives every CP rank the same share of the attention.
  pipeline = busy / (1 - bubble_fraction): the bubble stretches everything a stage does per micro-batch.
  DP       = data-parallel / ZeRO traffic outside the pipeline. Traffic that can overlap compute hides
             at most (1 - dp_exposed) of itself and never more than the compute it can overlap with:
             the last micro-batch's backward for a once-per-step gradient reduction (ZeRO-0/1: the
             reduction waits for the pipeline flush), every backward for per-micro-batch
             reduce-scatters (ZeRO-2/3), the whole compute for ZeRO-3's prefetched all-gathers.
             The parameter all-gather after the optimizer step is exposed.
  offload  = with ZeRO offload (zero.offload_*), the CPU's optimizer step (with NVMe: the longer of it and the
             moments' NVMe traffic) and the PCIe copies of the parameter and gradient shards, none of it hidden
             behind compute (offload.py).
  step     = pipeline + exposed DP + offload.
Ignored: the GPU optimizer step (memory-bound, small once sharded), kernel launch and latency terms,
efficiency loss of small per-GPU matmuls at large TP, stragglers, data loading. Real runs are slower;
the ranking between layouts is what this is for.

Two constants carry the absolute numbers and no source pins them: the matmul efficiency (Hardware.efficiency,
0.6) and the exposed share of overlappable DP traffic (DP_EXPOSED, 0.5). `step_range` moves each over a
plausible interval (ASSUMED) and reports the span, so a plan shows a range, not a promise. Under expert parallelism
a third joins them: the routing's imbalance (activations.EXPERT_IMBALANCE, 1.25).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hpctrain.plan.activations import EXPERT_IMBALANCE
from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.comm import CommBreakdown, comm_per_step
from hpctrain.plan.flops import (
    compute_seconds,
    expert_flops_per_iteration,
    flops_per_iteration,
    fp8_flops_per_iteration,
    mfu,
)
from hpctrain.plan.memory import layer_activation_bytes, layers_on_stage
from hpctrain.plan.offload import OffloadCosts, offload_costs
from hpctrain.plan.types import Hardware, Layout, ModelShape

BACKWARD_SHARE = 2.0 / 3.0  # backward is ~2x forward: 2/3 of compute without recomputation
DP_EXPOSED = 0.5  # share of overlappable DP traffic left exposed: a middle guess, see ASSUMED


@dataclass(frozen=True)
class Assumption:
    """An unsourced constant of the estimate, the interval it plausibly takes, and why that interval."""

    name: str
    value: float
    low: float
    high: float
    why: str


# Intervals: Megatron-LM reached 44-52% of the A100's peak end to end (Narayanan et al. 2021, Table 1), so the
# matmuls alone run at no less than ~0.45; large single GEMMs reach ~0.75 (cuBLAS on A100/H100). DP traffic is
# hidden behind backward anywhere from mostly (bucketed overlap, 0.25 exposed) to not at all (1.0).
EFFICIENCY = (
    "matmul_efficiency",
    0.45,
    0.75,
    "fraction of peak FLOP/s the matmuls reach: Megatron's 44-52% "
    "end to end is a floor for the compute alone, large single GEMMs reach ~75%",
)
EXPOSED = (
    "dp_exposed_share",
    0.25,
    1.0,
    "share of overlappable data-parallel traffic not hidden behind compute: from bucketed overlap (0.25) to none (1.0)",
)
# The busiest EP rank's routed rows over the mean: 1.0 is a perfect balance, 2.0 the busiest rank's experts at twice
# the mean (a routing a balancing loss has not evened out yet). Both ends are assumptions, not measurements.
IMBALANCE = (
    "expert_imbalance",
    1.0,
    2.0,
    "routed rows the busiest expert-parallel rank receives over the mean "
    "(dropless routing): from perfectly balanced (1.0) to its hottest experts at twice the mean (2.0)",
)


@dataclass(frozen=True)
class StepEstimate:
    step_time_s: float
    compute_s: float  # pure matmul time, recomputation included
    tp_s: float  # exposed tensor-parallel traffic
    pp_s: float  # exposed pipeline sends
    bubble_s: float  # idle pipeline time
    dp_s: float  # all data-parallel / ZeRO traffic
    dp_exposed_s: float  # the part of it not hidden behind compute
    bubble_fraction: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    hfu: float  # hardware FLOPs utilisation: counts recomputation as useful work
    comm: CommBreakdown
    offload_s: float = 0.0  # exposed offload time: CPU optimizer step (and NVMe) + PCIe copies (offload.py)
    offload: OffloadCosts | None = None  # the offload's costs when the layout offloads
    ep_s: float = 0.0  # expert parallelism's all-to-alls (exposed)
    imbalance_s: float = 0.0  # the wait for the busiest EP rank's experts (module docstring)
    cp_s: float = 0.0  # context parallelism's key/value collectives (exposed)

    @property
    def offload_share(self) -> float:
        return self.offload_s / self.step_time_s

    @property
    def offload_slowdown(self) -> float:
        """How much longer the step is than the same layout without offload: offload_s / (step - offload_s)."""
        return self.offload_s / (self.step_time_s - self.offload_s)

    @property
    def comm_s(self) -> float:
        """Communication on the critical path (exposed)."""
        return self.tp_s + self.pp_s + self.ep_s + self.cp_s + self.dp_exposed_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_time_s

    @property
    def bubble_share(self) -> float:
        return self.bubble_s / self.step_time_s

    @property
    def compute_share(self) -> float:
        return self.compute_s / self.step_time_s


def selective_rerun_seconds(model: ModelShape, layout: Layout, hw: Hardware) -> float:
    """Time one GPU of the busiest pipeline rank spends per step rerunning selective recomputation's element-wise
    ops. They regenerate the tensors `none` keeps and the policy does not (activations.py counts both), each
    written once and its input read once (ASSUMED: 2x those bytes of HBM traffic, at the datasheet bandwidth)."""
    if layout.recompute != "selective":
        return 0.0
    rerun = layer_activation_bytes(model, layout, "none") - layer_activation_bytes(model, layout, "selective")
    return 2 * max(rerun, 0.0) * layers_on_stage(model, layout) * layout.microbatches / hw.hbm_bw


def _exposed_dp(comm: CommBreakdown, layout: Layout, compute_s: float, dp_exposed: float) -> float:
    """Exposed DP time: each overlappable item hides at most (1 - dp_exposed) of itself, and only within its window."""
    exposed = 0.0
    for item in comm.items:
        if item.kind != "dp":
            continue
        t = item.time_s
        if item.overlap == "compute":
            window = compute_s
        elif item.overlap == "backward":
            per_microbatch = layout.zero_stage >= 2
            window = BACKWARD_SHARE * compute_s / (1 if per_microbatch else layout.microbatches)
        else:
            exposed += t
            continue
        exposed += max(dp_exposed * t, t - window)
    return exposed


def estimate_step(
    model: ModelShape,
    layout: Layout,
    hw: Hardware,
    dp_exposed: float = DP_EXPOSED,
    tp_exposed: float = 1.0,
    pp_exposed: float = 1.0,
    imbalance: float = EXPERT_IMBALANCE,
) -> StepEstimate:
    """Estimated time of one optimizer step of `layout` on `hw`, with its breakdown (see module docstring)."""
    for name, value in (("dp_exposed", dp_exposed), ("tp_exposed", tp_exposed), ("pp_exposed", pp_exposed)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1]")
    if imbalance < 1.0:
        raise ValueError(f"imbalance is the busiest rank's rows over the mean: >= 1, got {imbalance}")
    n = layout.n_gpus
    flops = flops_per_iteration(model, layout.global_batch, layout.recompute, layout.tp)
    fp8_flops = fp8_flops_per_iteration(model, layout.global_batch, layout.recompute, layout.fp8, layout.tp)
    # a pipeline runs at its busiest rank's pace: with uneven stages the ranks holding more layers (1 when even)
    pace = layers_on_stage(model, layout) * layout.pp / model.dims.n_layers
    compute_s = pace * compute_seconds(
        flops, fp8_flops, n, hw.peak_flops, hw.fp8_flops, hw.efficiency
    ) + selective_rerun_seconds(model, layout, hw)
    comm = comm_per_step(model, layout, hw, imbalance=imbalance)
    tp_s = tp_exposed * comm.time_of("tp")
    pp_s = pp_exposed * comm.time_of("pp")
    ep_s = comm.time_of("ep")
    cp_s = comm.time_of("cp")
    imbalance_s = 0.0
    if layout.ep > 1:  # the experts' GEMMs (bf16: flops.fp8_flops_per_iteration leaves them out) on more rows
        experts = expert_flops_per_iteration(model, layout.global_batch, layout.recompute, layout.tp)
        imbalance_s = (imbalance - 1.0) * compute_seconds(experts, 0.0, n, hw.peak_flops, 0.0, hw.efficiency)
    busy = compute_s + tp_s + pp_s + ep_s + cp_s + imbalance_s
    frac = bubble_fraction(layout.pp, layout.microbatches, layout.virtual_stages, layout.schedule)
    pipeline_s = busy / (1.0 - frac)
    dp_s = comm.time_of("dp")
    dp_exp = _exposed_dp(comm, layout, compute_s, dp_exposed)
    costs = offload_costs(model, layout, hw)
    offload_s = costs.exposed_s
    step = pipeline_s + dp_exp + offload_s
    tokens_per_s = layout.global_batch * model.seq_len / step
    return StepEstimate(
        step_time_s=step,
        compute_s=compute_s,
        tp_s=tp_s,
        pp_s=pp_s,
        bubble_s=pipeline_s - busy,
        dp_s=dp_s,
        dp_exposed_s=dp_exp,
        bubble_fraction=frac,
        tokens_per_s=tokens_per_s,
        samples_per_s=layout.global_batch / step,
        mfu=mfu(tokens_per_s, model, n, hw.peak_flops),
        hfu=flops / step / (n * hw.peak_flops),
        comm=comm,
        offload_s=offload_s,
        offload=costs if costs.offloaded else None,
        ep_s=ep_s,
        imbalance_s=imbalance_s,
        cp_s=cp_s,
    )


@dataclass(frozen=True)
class StepRange:
    """The estimate at its assumptions; at each assumption's ends with the other held (`alone`, in the order of
    `assumptions`: (at low, at high)); and at the corners of both intervals (fastest and slowest)."""

    assumptions: tuple[Assumption, ...]
    point: StepEstimate
    alone: tuple[tuple[StepEstimate, StepEstimate], ...]
    fastest: StepEstimate
    slowest: StepEstimate


def step_range(model: ModelShape, layout: Layout, hw: Hardware, dp_exposed: float = DP_EXPOSED) -> StepRange:
    """The span of `estimate_step` when the efficiency and the exposed DP share (and, under expert parallelism,
    the routing's imbalance) move over their intervals."""
    given = [(EFFICIENCY, hw.efficiency), (EXPOSED, dp_exposed)]
    if layout.ep > 1 and model.moe:
        given.append((IMBALANCE, EXPERT_IMBALANCE))
    assumptions = tuple(
        Assumption(name, value, min(lo, value), max(hi, value), why) for (name, lo, hi, why), value in given
    )

    def at(values: tuple[float, ...]) -> StepEstimate:
        e, x, *rest = values
        return estimate_step(
            model, layout, replace(hw, efficiency=e), dp_exposed=x, imbalance=rest[0] if rest else EXPERT_IMBALANCE
        )

    point = tuple(a.value for a in assumptions)

    def moved(i: int, value: float) -> tuple[float, ...]:
        return point[:i] + (value,) + point[i + 1 :]

    corners = [at(c) for c in itertools.product(*((a.low, a.high) for a in assumptions))]
    return StepRange(
        assumptions=assumptions,
        point=at(point),
        alone=tuple((at(moved(i, a.low)), at(moved(i, a.high))) for i, a in enumerate(assumptions)),
        fastest=min(corners, key=lambda st: st.step_time_s),
        slowest=max(corners, key=lambda st: st.step_time_s),
    )
