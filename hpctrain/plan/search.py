"""Enumerate the 3D layouts a job could use, keep those that fit in memory, rank them by estimated speed.

Every layout returned obeys the layout rules the checks report, by calling the same functions
(hpctrain.config.rules; config.layout.layout_rules runs them all on each layout before its memory is estimated), so
`parallel=auto` never picks what the checks refuse (tests/plan/test_search_obeys_checks.py). The rules also prune
the enumeration, each where its degree is chosen:
  * tp divides gpus_per_node (TP stays on NVLink), n_heads, the key/value heads (Megatron's num_query_groups % tp)
    and the MLP hidden size, and with precision.fp8 leaves FP8-sized shards (rules.tensor_rules, fp8_rules);
  * n_layers splits into pp * virtual_stages stages, evenly or with the first and the last stage one layer lighter
    than the others, which hold the embedding and the head (config.layout.lighter_ends: Llama 3 405B's 126 layers
    on 16 stages, or on 16 x 4 interleaved chunks as 1 + 62 x 2 + 1; rules.stage_rules);
  * dp = n_gpus / (tp * pp * cp) and global_batch = micro_batch * grad_accum * dp are whole numbers;
  * the schedule's microbatches (= grad_accum): 1F1B at least pp, interleaving (v > 1) a multiple of pp
    (rules.microbatch_rules); no ZeRO stage that has nothing to shard or that the schedule loses gradients of
    (rules.zero_idle_rules, schedule_rules);
  * a Mixture of Experts tries every expert-parallel degree ep that divides both dp (the ZeRO shard group: the
    search uses no HSDP) and n_experts (rules.expert_rules, which refuse ep > 1 on a dense model), under FSDP2
    (ZeRO >= 1: the experts' shards are cut over dp / ep ranks). EP trades the experts' unsharded memory and DP
    traffic (/ ep) for all-to-alls and the wait for the busiest rank (comm.py, step_time.py), so only fitting
    layouts are kept and the estimate ranks them.
  * context parallelism (cp > 1: each sequence split over cp GPUs, which come out of DP) is tried for long
    sequences only, seq_len >= CP_MIN_SEQ_LEN, or where no layout without it fits: cp a power of two up to
    `max_context_parallel` that leaves a whole dp and that rules.context_rules allow (seq_len a multiple of
    2 cp, no dropout, a dense model, no torch.compile). CP moves keys and values over its group every layer
    (comm.py) for activations / cp (memory.py): it pays where the sequence's activations are what does not fit,
    which short sequences never are, so they keep their candidates (and the search its speed).
Pruning that keeps a 4096-GPU search well under a second, and why it loses nothing:
  * sequence parallelism is always on when tp > 1: it moves the same bytes as TP alone (comm.py)
    and stores less (memory.py), so layouts without it are dominated;
  * for each layout only the cheapest recomputation that fits is kept (none < selective < full): a more
    expensive one is slower for the same layout;
  * micro-batches above `max_micro_batch` and more than `max_virtual_stages` chunks are not tried;
  * zero.accumulate_unsharded (one reduce-scatter a step for whole reduce-dtype gradients) is tried for ZeRO-2/3
    with accumulation and no pipeline only: elsewhere it changes nothing (ZeRO-1 and PP accumulate unsharded
    anyway, one micro-batch has nothing to accumulate).
Candidates are ranked by estimated tokens/s (step_time.py), ties by lower memory.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from hpctrain import schedules
from hpctrain.config.layout import layout_rules, lighter_ends
from hpctrain.config.rules import (
    Workload,
    context_rules,
    expert_rules,
    fp8_rules,
    microbatch_rules,
    schedule_rules,
    stage_rules,
    tensor_rules,
    zero_idle_rules,
)
from hpctrain.plan.bubble import microbatches_for_efficiency
from hpctrain.plan.flops import mfu
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu
from hpctrain.plan.step_time import StepEstimate, estimate_step
from hpctrain.plan.types import RECOMPUTE, GiB, Hardware, Layout, ModelShape

# Sequences at least this long also try context parallelism (Llama 3 used it from 131,072 tokens; at 16,384 a
# 70B-class layer's activations already take GiBs per micro-batch); shorter ones only when nothing fits without it.
CP_MIN_SEQ_LEN = 16384
INTERLEAVED = "interleaved_1f1b"  # the schedule of the layouts with virtual stages (1F1B without)


@dataclass(frozen=True)
class Candidate:
    """A layout with its memory and time estimates and a one-line reason for its standing."""

    layout: Layout
    memory: MemoryBreakdown
    step: StepEstimate
    why: str

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending; sqrt(n) trials (a global batch of 2**31 - 1 is searched in milliseconds)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def workload(model: ModelShape, hw: Hardware, compile: bool = False, simulate: bool = False) -> Workload:
    """What the layout rules read of a search (config.rules.Workload): the model's Dims and family, its sequence
    and dropout, the GPUs of a node, and whether the run compiles or is simulated (the checks build the same from
    the config)."""
    return Workload.of(model.dims, model.family, model.seq_len, hw.gpus_per_node, model.dropout, compile, simulate)


def context_degrees(w: Workload, gpus: int, max_cp: int, ep: int = 1) -> list[int]:
    """The cp > 1 degrees to try on `gpus` GPUs (n_gpus / tp): powers of two up to max_cp that divide them and
    that the context rules allow with expert parallelism `ep` (config.rules.context_rules: none for an MoE model)."""
    out, cp = [], 2
    while cp <= max_cp and gpus % cp == 0:
        if not context_rules(cp, ep, w):
            out.append(cp)
        cp *= 2
    return out


def expert_degrees(w: Workload, dp: int, zero_stage: int) -> list[int]:
    """The ep degrees to try: divisors of dp that the expert rules allow (config.rules.expert_rules: divisors of
    n_experts; 1 for a dense model), under FSDP2 (ZeRO >= 1) only."""
    if zero_stage == 0:
        return [1]
    return [e for e in _divisors(dp) if not expert_rules(e, w)]


def _why(layout: Layout, mem: MemoryBreakdown, step: StepEstimate, recompute_needed: bool = False) -> str:
    """One line: the layout and what costs it most."""
    parts = [
        f"tp{layout.tp} pp{layout.pp}"
        + (f"x{layout.virtual_stages}" if layout.virtual_stages > 1 else "")
        + (f" cp{layout.cp}" if layout.cp > 1 else "")
        + f" dp{layout.dp}"
        + (f" ep{layout.ep}" if layout.ep > 1 else "")
        + f" mb{layout.micro_batch} m{layout.microbatches} zero{layout.zero_stage}"
        + ("+accumulate_unsharded" if layout.accumulate_unsharded else "")
        + f" rc={layout.recompute}",
        f"{step.tokens_per_s:,.0f} tok/s, MFU {step.mfu:.0%}",
        f"bubble {step.bubble_fraction:.0%} of pipeline",
        f"exposed comm {step.comm_share:.0%}",
        f"mem {mem.total / GiB:.0f}/{mem.usable / GiB:.0f} GiB",
    ]
    if recompute_needed and layout.recompute != "none":
        parts.append(f"needs {layout.recompute} recompute to fit")
    if layout.zero_stage == 3 and layout.microbatches > 1:
        parts.append(f"ZeRO-3 regathers weights {layout.microbatches}x")
    return "; ".join(parts)


def evaluate(model: ModelShape, layout: Layout, hw: Hardware, **step_kwargs: float) -> Candidate:
    """Memory and time of any layout, legal or not (for ranking a layout someone proposes)."""
    mem = memory_per_gpu(model, layout, hw)
    step = estimate_step(model, layout, hw, **step_kwargs)
    return Candidate(layout, mem, step, _why(layout, mem, step))


def cheapest_fitting(model: ModelShape, layout: Layout, hw: Hardware, **step_kwargs: float) -> Candidate | None:
    """`layout` with the least recomputation that fits (None if even full recomputation does not)."""
    for rc in RECOMPUTE:
        trial = replace(layout, recompute=rc)
        mem = memory_per_gpu(model, trial, hw)
        if mem.fits:
            step = estimate_step(model, trial, hw, **step_kwargs)
            return Candidate(trial, mem, step, _why(trial, mem, step, recompute_needed=True))
    return None


def search_layouts(
    model: ModelShape,
    n_gpus: int,
    hw: Hardware,
    global_batch: int,
    seq_len: int | None = None,
    dtype: str = "bf16",
    reduce_dtype: str | None = None,
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    max_micro_batch: int = 16,
    max_virtual_stages: int = 8,
    top_k: int | None = None,
    max_context_parallel: int = 32,
    compile: bool = False,
    fp8: str = "none",
    simulate: bool = False,
    **step_kwargs: float,
) -> list[Candidate]:
    """All legal layouts of `model` on n_gpus that fit in memory, fastest first (see module docstring); gradients
    reduced in `reduce_dtype` (precision.reduce_dtype; None: in `dtype`), the blocks' Linears in `fp8`
    (precision.fp8), as the run will; `compile` (parallel.compile) rules out what torch.compile cannot take,
    `simulate` (dry_run=simulate) what fake tensors cannot build."""
    if seq_len is not None and seq_len != model.seq_len:
        model = replace(model, seq_len=seq_len)
    space = _Space(
        model,
        workload(model, hw, compile, simulate),
        n_gpus,
        hw,
        global_batch,
        dtype,
        reduce_dtype,
        fp8,
        zero_stages,
        max_micro_batch,
        max_virtual_stages,
        max_context_parallel,
        step_kwargs,
    )
    long = model.seq_len >= CP_MIN_SEQ_LEN
    out = _candidates(space, True, long)
    if not out and not long:  # nothing fits: the sequence's activations may, split over a CP group
        out = _candidates(space, False, True)
    out.sort(key=lambda c: (-c.tokens_per_s, c.memory.total))
    return out[:top_k] if top_k is not None else out


@dataclass(frozen=True)
class _Space:
    """What one search enumerates: the model and its workload, the job, and the bounds of the enumeration."""

    model: ModelShape
    w: Workload
    n_gpus: int
    hw: Hardware
    global_batch: int
    dtype: str
    reduce_dtype: str | None
    fp8: str
    zero_stages: tuple[int, ...]
    max_micro_batch: int
    max_virtual_stages: int
    max_cp: int
    step_kwargs: dict[str, float]


def _candidates(space: _Space, plain: bool, split: bool) -> list[Candidate]:
    """The fitting layouts (module docstring's rules): without CP where `plain`, with cp > 1 where `split`. Each
    degree is pruned by its rule where it is chosen; each whole layout passes them all (layout_rules) before its
    memory is estimated."""
    w, n_gpus = space.w, space.n_gpus
    tps = [
        t for t in _divisors(w.gpus_per_node) if n_gpus % t == 0 and not tensor_rules(t, w) + fp8_rules(t, space.fp8, w)
    ]
    out: list[Candidate] = []
    for tp in tps:
        cps = ([1] if plain else []) + (context_degrees(w, n_gpus // tp, space.max_cp) if split else [])
        for cp, pp in ((c, p) for c in cps for p in _divisors(n_gpus // (tp * c))):
            cuts = _chunk_cuts(w, pp, space.max_virtual_stages)
            if not cuts:
                continue
            dp = n_gpus // (tp * pp * cp)
            if space.global_batch % dp:
                continue
            per_replica = space.global_batch // dp
            for micro in _divisors(per_replica):
                if micro > space.max_micro_batch:
                    break
                m = per_replica // micro
                if microbatch_rules("1f1b", pp, 1, m):
                    continue
                for v, ends in cuts:
                    if v == 1 or not microbatch_rules(INTERLEAVED, pp, v, m):
                        out += _layouts(space, dp, tp, pp, cp, v, micro, m, ends)
    return out


def _chunk_cuts(w: Workload, pp: int, max_virtual_stages: int) -> list[tuple[int, int]]:
    """(virtual stages, layers of the first and of the last chunk; 0: even) for each way the layers cut into pp x v
    chunks: evenly, or with the first and the last chunk one layer lighter, which hold the embedding and the head.
    Llama 3's 405B ran that cut interleaved (Grattafiori et al. 2024, sec. 3.3.2: "we reduce one Transformer layer
    each from the first and the last stages" with "V pipeline stages on one pipeline rank"): 126 layers as 7 + 14 x 8
    + 7 on 16 stages, 1 + 62 x 2 + 1 on 16 x 4 chunks."""
    out = []
    for v in range(1, max_virtual_stages + 1):
        if v > 1 and schedules.get(INTERLEAVED).chunk_problem(pp, v):
            continue
        ends = lighter_ends(w.dims.n_layers, pp * v) or 0
        if not stage_rules(pp, v, ends, ends, w):
            out.append((v, ends))
    return out


def _layouts(
    space: _Space, dp: int, tp: int, pp: int, cp: int, v: int, micro: int, m: int, ends: int
) -> list[Candidate]:
    """The fitting candidates of one split of the GPUs and the batch: over ZeRO stages, ep and unsharded
    accumulation, each with the cheapest recomputation that fits."""
    w, schedule, out = space.w, INTERLEAVED if v > 1 else "1f1b", []
    stages = [z for z in space.zero_stages if not zero_idle_rules(z, dp * cp, cp, False, pp, m)] or [0]
    for z in stages:
        if schedule_rules(schedule, pp, dp, z):
            continue
        unsharded_options = [u for u in (False, True) if not zero_idle_rules(z, dp * cp, cp, u, pp, m)]
        for ep, unsharded in itertools.product(expert_degrees(w, dp, z), unsharded_options):
            layout = Layout(
                dp=dp,
                tp=tp,
                pp=pp,
                virtual_stages=v,
                zero_stage=z,
                micro_batch=micro,
                grad_accum=m,
                sequence_parallel=tp > 1,
                schedule=schedule,
                dtype=space.dtype,
                reduce_dtype=space.reduce_dtype,
                accumulate_unsharded=unsharded,
                ep=ep,
                first_stage_layers=ends,
                last_stage_layers=ends,
                cp=cp,
                fp8=space.fp8,
            )
            if layout_rules(layout, w):  # the checks' rules, whole: what the search returns, they accept
                continue
            cand = cheapest_fitting(space.model, layout, space.hw, **space.step_kwargs)
            if cand is not None:
                out.append(cand)
    return out


def rank_of(
    layout: Layout, candidates: list[Candidate], model: ModelShape | None = None, hw: Hardware | None = None
) -> int:
    """1-based rank `layout` takes among `candidates` by tokens/s (evaluated afresh if it is not among them)."""
    for i, c in enumerate(candidates):
        if c.layout == layout:
            return i + 1
    if model is None or hw is None:
        raise ValueError("layout is not among the candidates: pass model and hw to evaluate it")
    speed = evaluate(model, layout, hw).tokens_per_s
    return 1 + sum(1 for c in candidates if c.tokens_per_s > speed)


def explain(candidate: Candidate, best: Candidate | None = None) -> str:
    """A few lines on where a candidate's memory and time go, and what would help (vs `best` if given)."""
    lay, mem, st = candidate.layout, candidate.memory, candidate.step
    g = GiB
    lines = [
        candidate.why,
        f"memory (GPU of stage {mem.stage}): params {mem.params / g:.1f} + grads {mem.grads / g:.1f}"
        f" + optimizer {mem.optimizer / g:.1f} + buffers {mem.buffers / g:.1f}"
        f" + activations {mem.activations / g:.1f}"
        f" = {mem.total / g:.1f} GiB of {mem.usable / g:.1f} usable"
        + (f"; {mem.cpu_offload_bytes / g:.1f} GiB offloaded to CPU" if mem.cpu_offload_bytes else "")
        + (f", {mem.nvme_bytes / g:.1f} GiB to NVMe" if mem.nvme_bytes else ""),
        f"step {st.step_time_s:.2f} s = compute {st.compute_s:.2f} + TP {st.tp_s:.2f} + PP {st.pp_s:.2f}"
        + (f" + EP {st.ep_s:.2f} + imbalance {st.imbalance_s:.2f}" if lay.ep > 1 else "")
        + (f" + CP {st.cp_s:.2f}" if lay.cp > 1 else "")
        + f" + bubble {st.bubble_s:.2f} + exposed DP {st.dp_exposed_s:.2f}"
        + (f" + offload {st.offload_s:.2f}" if st.offload is not None else "")
        + f" ({st.samples_per_s:.1f} samples/s, MFU {st.mfu:.1%}, HFU {st.hfu:.1%})",
    ]
    if lay.pp > 1:
        target = microbatches_for_efficiency(lay.pp, 0.9, lay.virtual_stages, lay.schedule)
        lines.append(
            f"pipeline: {lay.microbatches} microbatches on {lay.pp} stages"
            + (f" x {lay.virtual_stages} chunks" if lay.virtual_stages > 1 else "")
            + f" idle {st.bubble_fraction:.1%} of the pipeline time ({st.bubble_share:.0%} of the step);"
            f" 90% efficiency needs >= {target} microbatches"
        )
    for item in st.comm.items:
        lines.append(f"comm: {item.name} {item.bytes / 1e9:.1f} GB/step over {item.link} = {item.time_s:.2f} s")
    if st.imbalance_s:
        lines.append(
            f"expert parallelism: the busiest of the {lay.ep} EP ranks' experts run more rows than the "
            f"mean, {st.imbalance_s:.2f} s of waiting per step (an assumed imbalance)"
        )
    if lay.zero_stage == 3 and lay.microbatches > 1:
        lines.append(
            f"ZeRO-3 all-gathers the weights in forward and backward of each of the {lay.microbatches}"
            " microbatches; ZeRO-1 would gather once per step"
        )
    if lay.zero_stage >= 2 and lay.pp > 1:
        lines.append("note: DeepSpeed rejects ZeRO-2/3 with pipeline parallelism; Megatron offers ZeRO-1 only")
    if best is not None and best is not candidate:
        ratio = best.tokens_per_s / st.tokens_per_s
        lines.append(f"best found is {ratio:.2f}x faster: {best.why}")
    return "\n".join(lines)


def measured_mfu(samples_per_s: float, model: ModelShape, n_gpus: int, hw: Hardware) -> float:
    """MFU of a reported throughput (e.g. the design article's 120 samples/s on 4096 A100s)."""
    return mfu(samples_per_s * model.seq_len, model, n_gpus, hw.peak_flops)
