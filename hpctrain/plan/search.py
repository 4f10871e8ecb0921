"""Enumerate the 3D layouts a job could use, keep those that fit in memory, rank them by estimated speed.

Rules a candidate obeys (Megatron's, plus the global batch):
  * the model's shape rules, from their one owner (hpctrain.config.layout.model_fit_problems, which the checks
    report): tp divides gpus_per_node (TP stays on NVLink), n_heads, the key/value heads (each rank keeps whole
    K/V heads of grouped-query attention: Megatron's num_query_groups % tp) and the MLP hidden size; n_layers
    is divisible by pp * virtual_stages, or (no interleaving) splits with the first and the last stage one
    layer lighter than the others, which hold the embedding and the head (config.layout.lighter_ends: Llama 3
    405B's 126 layers on 16 stages);
  * dp = n_gpus / (tp * pp) is a whole number;
  * global_batch = micro_batch * grad_accum * dp, and microbatches (= grad_accum) >= pp;
  * interleaving (v > 1) needs pp >= 2 and microbatches divisible by pp;
  * a Mixture of Experts tries every expert-parallel degree ep that divides both dp (the ZeRO shard group: the
    search uses no HSDP) and n_experts, under FSDP2 (ZeRO >= 1: the experts' shards are cut over dp / ep ranks);
    a dense model keeps ep = 1 (model_fit_problems refuses ep > 1 on it). EP trades the experts' unsharded
    memory and DP traffic (/ ep) for all-to-alls and the wait for the busiest rank (comm.py, step_time.py), so
    only fitting layouts are kept and the estimate ranks them.
  * context parallelism (cp > 1: each sequence split over cp GPUs, which come out of DP) is tried for long
    sequences only, seq_len >= CP_MIN_SEQ_LEN, or where no layout without it fits: cp a power of two up to
    `max_context_parallel` that obeys the sequence's rules (config.layout.sequence_problems: seq_len a multiple of
    2 cp, no dropout) and leaves a whole dp; never with expert parallelism (ep = 1 when cp > 1, the layout's rule).
    CP moves keys and values over its group every layer (comm.py) for activations / cp (memory.py): it pays
    where the sequence's activations are what does not fit, which short sequences never are, so they keep their
    candidates (and the search its speed).
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
from types import SimpleNamespace

from hpctrain.config.layout import lighter_ends, model_fit_problems, sequence_problems
from hpctrain.plan.bubble import microbatches_for_efficiency
from hpctrain.plan.flops import mfu
from hpctrain.plan.memory import MemoryBreakdown, memory_per_gpu
from hpctrain.plan.step_time import StepEstimate, estimate_step
from hpctrain.plan.types import RECOMPUTE, GiB, Hardware, Layout, ModelShape

# Sequences at least this long also try context parallelism (Llama 3 used it from 131,072 tokens; at 16,384 a
# 70B-class layer's activations already take GiBs per micro-batch); shorter ones only when nothing fits without it.
CP_MIN_SEQ_LEN = 16384


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


def shape_problems(
    model: ModelShape,
    tp: int,
    pp: int,
    virtual_stages: int,
    gpus_per_node: int,
    ep: int = 1,
    first_stage_layers: int = 0,
    last_stage_layers: int = 0,
) -> list[str]:
    """What the model's shape rules (their one owner: config.layout.model_fit_problems) say of these degrees."""
    degrees = SimpleNamespace(
        tp=tp,
        pp=pp,
        virtual_stages=virtual_stages,
        gpus_per_node=gpus_per_node,
        ep=ep,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    return [
        message
        for _, message, _ in model_fit_problems(
            degrees, model.n_layers, model.n_heads, model.kv_heads, model.ffn, model.n_experts
        )
    ]


def context_degrees(model: ModelShape, gpus: int, max_cp: int) -> list[int]:
    """The cp > 1 degrees to try on `gpus` GPUs (n_gpus / tp): powers of two up to max_cp that divide them and obey
    the sequence's rules (config.layout.sequence_problems, its one owner)."""
    out, cp = [], 2
    while cp <= max_cp and gpus % cp == 0:
        if not sequence_problems(SimpleNamespace(cp=cp), model.seq_len, model.dropout):
            out.append(cp)
        cp *= 2
    return out


def expert_degrees(model: ModelShape, dp: int, zero_stage: int, cp: int = 1) -> list[int]:
    """The ep degrees to try: divisors of dp that divide n_experts, under FSDP2 (ZeRO >= 1); 1 for a dense model
    and under context parallelism (the layout's rule: CP and EP do not combine)."""
    if not model.moe or zero_stage == 0 or cp > 1:
        return [1]
    return [e for e in _divisors(dp) if model.n_experts % e == 0]


def rule_violations(model: ModelShape, layout: Layout, hw: Hardware, n_gpus: int, global_batch: int) -> list[str]:
    """The search rules `layout` breaks (empty when it is a legal candidate)."""
    bad = []
    if layout.n_gpus != n_gpus:
        bad.append(f"dp*tp*pp*cp = {layout.n_gpus} != {n_gpus} GPUs")
    bad += [message for _, message, _ in sequence_problems(layout, model.seq_len, model.dropout)]
    bad += shape_problems(
        model,
        layout.tp,
        layout.pp,
        layout.virtual_stages,
        hw.gpus_per_node,
        layout.ep,
        layout.first_stage_layers,
        layout.last_stage_layers,
    )
    if layout.global_batch != global_batch:
        bad.append(f"micro_batch*grad_accum*dp = {layout.global_batch} != global batch {global_batch}")
    if layout.pp > 1 and layout.microbatches < layout.pp:
        bad.append(f"{layout.microbatches} microbatches < {layout.pp} stages")
    if layout.virtual_stages > 1 and (layout.pp < 2 or layout.microbatches % layout.pp):
        bad.append("interleaving needs pp >= 2 and microbatches divisible by pp")
    return bad


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
    **step_kwargs: float,
) -> list[Candidate]:
    """All legal layouts of `model` on n_gpus that fit in memory, fastest first (see module docstring); gradients
    reduced in `reduce_dtype` (precision.reduce_dtype; None: in `dtype`), as the run will."""
    if seq_len is not None and seq_len != model.seq_len:
        model = replace(model, seq_len=seq_len)
    args = (model, n_gpus, hw, global_batch, dtype, reduce_dtype, zero_stages, max_micro_batch, max_virtual_stages)
    long = model.seq_len >= CP_MIN_SEQ_LEN
    out = _candidates(*args, True, long, max_context_parallel, step_kwargs)
    if not out and not long:  # nothing fits: the sequence's activations may, split over a CP group
        out = _candidates(*args, False, True, max_context_parallel, step_kwargs)
    out.sort(key=lambda c: (-c.tokens_per_s, c.memory.total))
    return out[:top_k] if top_k is not None else out


def _candidates(
    model: ModelShape,
    n_gpus: int,
    hw: Hardware,
    global_batch: int,
    dtype: str,
    reduce_dtype: str | None,
    zero_stages: tuple[int, ...],
    max_micro_batch: int,
    max_virtual_stages: int,
    plain: bool,
    split: bool,
    max_cp: int,
    step_kwargs: dict[str, float],
) -> list[Candidate]:
    """The fitting layouts (module docstring's rules): without CP where `plain`, with cp > 1 where `split`."""
    tps = [
        t
        for t in _divisors(hw.gpus_per_node)
        if n_gpus % t == 0 and not shape_problems(model, t, 1, 1, hw.gpus_per_node)
    ]
    out: list[Candidate] = []
    for tp in tps:
        cps = ([1] if plain else []) + (context_degrees(model, n_gpus // tp, max_cp) if split else [])
        for cp, pp in ((cp, pp) for cp in cps for pp in _divisors(n_gpus // (tp * cp))):
            # even stages, or the first and last one layer lighter (they hold the embedding and the head)
            ends = lighter_ends(model.n_layers, pp)
            if model.n_layers % pp and ends is None:
                continue
            dp = n_gpus // (tp * pp * cp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for micro in _divisors(per_replica):
                if micro > max_micro_batch:
                    break
                m = per_replica // micro
                if pp > 1 and m < pp:
                    continue
                vs = [1]
                if pp >= 2 and m % pp == 0 and ends is None:
                    vs += [v for v in range(2, max_virtual_stages + 1) if model.n_layers % (pp * v) == 0]
                for v in vs:
                    for z in zero_stages if dp * cp > 1 else (0,):
                        unsharded_options = (False, True) if z >= 2 and m > 1 and pp == 1 else (False,)
                        for ep, unsharded in itertools.product(expert_degrees(model, dp, z, cp), unsharded_options):
                            layout = Layout(
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                virtual_stages=v,
                                zero_stage=z,
                                micro_batch=micro,
                                grad_accum=m,
                                sequence_parallel=tp > 1,
                                schedule="interleaved_1f1b" if v > 1 else "1f1b",
                                dtype=dtype,
                                reduce_dtype=reduce_dtype,
                                accumulate_unsharded=unsharded,
                                ep=ep,
                                first_stage_layers=ends or 0,
                                last_stage_layers=ends or 0,
                                cp=cp,
                            )
                            cand = cheapest_fitting(model, layout, hw, **step_kwargs)
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
