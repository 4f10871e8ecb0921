"""The layout rules: what a layout's degrees (tp, pp, cp, ep, dp, virtual stages, micro-batch, accumulation, ZeRO)
must obey for a model on a cluster with a sequence length. Each rule is written once, here.

The checks (hpctrain.checks.config) report these findings and the layout search (hpctrain.plan.search, so
`parallel=auto`) obeys them, both by calling these functions: a layout the search returns is one the checks accept
(tests/plan/test_search_obeys_checks.py draws many to hold that). Each function takes the degrees it constrains and
the `Workload` (what the layout is for), and returns findings, (config key, what is wrong, the fix). The layout's
own rules, which need no model (ranges, schedules, HSDP's divisions), are hpctrain.config.layout.layout_problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hpctrain import schedules

Finding = tuple[str, str, str]  # (config key, what is wrong, the fix)

# Layout field -> the config key that sets it (the rest are parallel.<field>): the one place a key is spelled.
CONFIG_KEYS = {
    "zero_stage": "zero.stage",
    "micro_batch": "train.micro_batch",
    "grad_accum": "train.grad_accum",
    "gpus_per_node": "cluster.gpus_per_node",
    "dtype": "precision.dtype",
    "reduce_dtype": "precision.reduce_dtype",
    "fp8": "precision.fp8",
    "offload_optimizer": "zero.offload_optimizer",
    "offload_params": "zero.offload_params",
    "offload_device": "zero.offload_optimizer_device",
    "accumulate_unsharded": "zero.accumulate_unsharded",
}


def key_of(field: str) -> str:
    """The config key that sets Layout field `field` ("cp" -> "parallel.cp", "zero_stage" -> "zero.stage")."""
    return CONFIG_KEYS.get(field, f"parallel.{field}")


CP, EP, TP, PP = key_of("cp"), key_of("ep"), key_of("tp"), key_of("pp")
GRAD_ACCUM, ZERO_STAGE = key_of("grad_accum"), key_of("zero_stage")
SEQ_LEN, DROPOUT, COMPILE = "train.seq_len", "model.dropout", "parallel.compile"


class ShapeNumbers(Protocol):
    """What the rules read of a model's shape: the fields of hpctrain.models.family.Dims, its one owner (named
    here, not imported: the config layer sits below the models)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def ffn_hidden(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def kv_dim(self) -> int: ...


class FamilyTraits(Protocol):
    """What the rules read of a model family (hpctrain.models.family.Family)."""

    @property
    def name(self) -> str: ...
    @property
    def moe(self) -> bool: ...
    @property
    def grouped_query(self) -> bool: ...


@dataclass(frozen=True)
class Workload:
    """What a layout is for, as the rules read it: the model's shape and family, the sequence, the GPUs of a node,
    and the run's switches that constrain degrees (torch.compile). The checks build it from the config, the
    search from its ModelShape and Hardware (`Workload.of` both)."""

    dims: ShapeNumbers
    arch: str
    moe: bool
    grouped_query: bool
    seq_len: int
    gpus_per_node: int
    dropout: float = 0.0
    compile: bool = False
    simulate: bool = False  # dry_run=simulate: one rank of the layout is built on fake tensors

    @classmethod
    def of(
        cls,
        dims: ShapeNumbers,
        family: FamilyTraits,
        seq_len: int,
        gpus_per_node: int,
        dropout: float = 0.0,
        compile: bool = False,
        simulate: bool = False,
    ) -> Workload:
        """From a model's Dims and family (hpctrain.models.family): what both the checks and the search call."""
        return cls(
            dims, family.name, family.moe, family.grouped_query, seq_len, gpus_per_node, dropout, compile, simulate
        )


def expert_rules(ep: int, w: Workload) -> list[Finding]:
    """Expert parallelism splits an MoE layer's experts: a dense model has none, and each rank holds whole ones."""
    n = w.dims.n_experts
    if ep > 1 and not n:
        return [
            (
                EP,
                f"ep={ep} splits a Mixture-of-Experts layer's experts, but this model is dense (model.moe.n_experts=0)",
                "set parallel.ep=1, or pick an MoE model (model=mixtral_8x7b, ...)",
            )
        ]
    if n % ep:
        return [
            (
                EP,
                f"model.moe.n_experts={n} is not divisible by ep={ep}: each EP rank must hold the same number of "
                "whole experts",
                f"use an ep that divides {n}",
            )
        ]
    return []


def tensor_rules(tp: int, w: Workload) -> list[Finding]:
    """Each TP rank owns whole attention and key/value heads and an equal part of the MLP, and TP stays inside a
    node (its per-layer all-reduces on NVLink)."""
    d, gpus, out = w.dims, w.gpus_per_node, []
    if d.n_heads % tp:
        out.append(
            (
                TP,
                f"model.n_heads={d.n_heads} is not divisible by tp={tp}: each TP rank must own whole attention heads",
                f"use a tp that divides {d.n_heads}",
            )
        )
    if d.kv_heads != d.n_heads and d.kv_heads % tp:
        out.append(
            (
                TP,
                f"model.n_kv_heads={d.kv_heads} is not divisible by tp={tp}: each TP rank must "
                "own whole key/value heads (grouped-query attention)",
                f"use a tp that divides {d.kv_heads}, or more key/value heads (model.n_kv_heads)",
            )
        )
    if d.ffn_hidden % tp:
        out.append(
            (
                TP,
                f"the MLP hidden size {d.ffn_hidden} is not divisible by tp={tp}",
                "use a tp that divides the MLP hidden size (model.ffn_hidden)",
            )
        )
    if tp > gpus:
        out.append(
            (
                TP,
                f"tp={tp} is larger than cluster.gpus_per_node={gpus}: TP's "
                "per-layer all-reduces would cross the network instead of NVLink",
                f"use tp <= {gpus} and add pipeline stages (parallel.pp) to split the model further",
            )
        )
    elif gpus % tp:
        out.append(
            (
                TP,
                f"tp={tp} does not divide cluster.gpus_per_node={gpus}: some TP groups would straddle two nodes",
                f"use a tp that divides {gpus}",
            )
        )
    return out


def layer_split(n_layers: int, n_stages: int, first: int = 0, last: int = 0) -> tuple[int, ...] | None:
    """Layers of each of `n_stages` stages: `first` on the first and `last` on the last where set (> 0), the rest
    evenly over the stages not set; None where that is not a split into stages of at least one layer."""
    fixed = {0: first} if first else {}
    if last:
        fixed[n_stages - 1] = last
    if n_stages == 1:
        return (n_layers,) if not fixed or fixed == {0: n_layers} else None
    rest, free = n_layers - sum(fixed.values()), n_stages - len(fixed)
    if free == 0:
        return tuple(fixed[s] for s in range(n_stages)) if rest == 0 else None
    if rest < free or rest % free:
        return None
    return tuple(fixed.get(s, rest // free) for s in range(n_stages))


def stage_rules(pp: int, virtual_stages: int, first: int, last: int, w: Workload) -> list[Finding]:
    """The layers split into pp x virtual_stages stages: evenly, or with the first and last stage's layers set
    (parallel.first_stage_layers / last_stage_layers) and the rest even (hpctrain.config.layout.layer_split)."""
    n_layers, chunks = w.dims.n_layers, pp * virtual_stages
    if (first or last) and chunks == 1:
        return [
            (
                key_of("first_stage_layers" if first else "last_stage_layers"),
                "sets the layers of a pipeline stage, but there is one stage (pp x virtual_stages = 1)",
                "leave first_stage_layers and last_stage_layers at 0, or add pipeline stages (parallel.pp)",
            )
        ]
    if first or last:
        if layer_split(n_layers, chunks, first, last) is not None:
            return []
        free = chunks - bool(first) - bool(last)
        return [
            (
                key_of("first_stage_layers" if first else "last_stage_layers"),
                f"first_stage_layers={first} and last_stage_layers={last} leave {n_layers - first - last} of "
                f"model.n_layers={n_layers} layers for the other {free} of the {chunks} stages, which cannot take "
                "them in equal whole parts of at least one layer",
                f"choose them so that n_layers - first - last is a positive multiple of {free}"
                if free
                else "make first_stage_layers + last_stage_layers equal model.n_layers",
            )
        ]
    if n_layers % chunks:
        return [
            (
                PP,
                f"model.n_layers={n_layers} is not divisible by pp x virtual_stages = "
                f"{pp} x {virtual_stages} = {chunks}: stages would be unbalanced",
                "choose pp and virtual_stages whose product divides the number of layers, or set "
                "parallel.first_stage_layers / last_stage_layers (the stages holding the embedding and the "
                "head may take fewer)",
            )
        ]
    return []


def moe_context_rule(cp: int, ep: int, moe: bool, arch: str = "") -> list[Finding]:
    """Context parallelism is for dense models: an MoE model's load-balancing losses are computed over the tokens a
    rank routes, and the mesh has no CP dimension beside EP's. layout_problems asks it of a layout alone (ep > 1:
    an MoE model), the checks and the search of the model."""
    if cp == 1 or not moe:
        return []
    model = f"model.arch={arch} is" if arch else f"parallel.ep={ep} splits the experts of"
    message = (
        f"{model} a Mixture-of-Experts model: its load-balancing losses are computed over the tokens a rank "
        "routes, and context parallelism would cut them to parts of sequences (hpctrain's CP is tested equal to "
        "one process for the dense families only)"
    )
    if ep > 1:
        message += (
            f"; context parallelism (cp={cp}) with expert parallelism (ep={ep}) is not supported either: an EP group "
            "is made of DP ranks, and CP ranks would route the same sequences' tokens"
        )
    return [(CP, message, f"set {CP}=1 for MoE models, or use a dense family (model.arch=gpt or llama)")]


def context_rules(cp: int, ep: int, w: Workload) -> list[Finding]:
    """What context parallelism needs: a sequence that cuts into 2 x cp equal chunks (each CP rank takes one from
    each end, so the causal mask leaves no rank idle), no dropout, a dense model, and no torch.compile."""
    if cp == 1:
        return []
    out: list[Finding] = []
    if w.seq_len % (2 * cp):
        out.append(
            (
                SEQ_LEN,
                f"{w.seq_len} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks: context "
                "parallelism gives each CP rank two chunks (one from each end, so the causal mask leaves no rank "
                "idle)",
                f"use a train.seq_len that is a multiple of {2 * cp}, or a {CP} that divides "
                f"{w.seq_len // 2 if w.seq_len % 2 == 0 else w.seq_len}",
            )
        )
    if w.dropout > 0:
        out.append(
            (
                DROPOUT,
                f"{w.dropout} with cp={cp}: the CP attention computes each rank's chunks against "
                "keys gathered from the whole sequence and draws no attention-dropout masks",
                f"set model.dropout=0 (long-context pre-training uses none), or {CP}=1",
            )
        )
    out += moe_context_rule(cp, ep, w.moe, w.arch)
    if w.compile:
        out.append(
            (
                COMPILE,
                f"with cp={cp}: the CP attention's bottom-right causal mask (torch's "
                "CausalBias, which lets flash attention take a chunk against a longer key prefix) is a tensor "
                "subclass whose constructor torch 2.13's dynamo cannot trace, and blocks compile as one graph "
                "(fullgraph)",
                "set parallel.compile=false with context parallelism",
            )
        )
    return out


def schedule_rules(schedule: str, pp: int, dp: int, zero_stage: int) -> list[Finding]:
    """A schedule that computes weight gradients in a separate pass loses those of ZeRO-sharded parameters."""
    if not (schedules.get(schedule).split_backward and pp > 1 and dp > 1 and zero_stage >= 1):
        return []
    return [
        (
            key_of("schedule"),
            f"{schedule} computes weight gradients in a separate pass, which loses "
            f"gradients of ZeRO-sharded parameters (zero.stage={zero_stage}) in torch 2.13",
            "use zero.stage=0 with this schedule, or parallel.schedule=interleaved_1f1b",
        )
    ]


def microbatch_rules(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> list[Finding]:
    """Enough microbatches for the schedule's stages (else they sit idle), a multiple of pp where the schedule
    interleaves (torch's interleaved schedules)."""
    if pp == 1:
        return []
    entry = schedules.get(schedule)
    need = entry.min_microbatches(pp, virtual_stages)
    if microbatches < need:
        return [
            (
                GRAD_ACCUM,
                f"{microbatches} microbatches for {pp} pipeline stages: {schedule} needs at least "
                f"{'one microbatch per stage' if need == pp else f'{need} microbatches'}, or stages sit idle",
                f"use train.grad_accum >= {need} (best >= {4 * pp}), e.g. by lowering train.micro_batch",
            )
        ]
    if entry.microbatches_multiple_of_pp and microbatches % pp:
        return [
            (
                GRAD_ACCUM,
                f"interleaved schedules need microbatches ({microbatches}) to be a multiple of pp ({pp})",
                f"use train.grad_accum={(microbatches // pp + 1) * pp}",
            )
        ]
    return []


def zero_rules(zero_stage: int, dp_replicate: int, offload_optimizer: bool) -> list[Finding]:
    """The ZeRO stage what else is set needs: FSDP2's CPU offload of the optimizer (stage 2 or 3), HSDP (stage 2 or
    3). Parameter offload's stage 3 is the layout's own rule (layout_problems)."""
    out: list[Finding] = []
    if offload_optimizer and zero_stage < 2:
        out.append(
            (
                key_of("offload_optimizer"),
                f"optimizer offload is done with FSDP2's CPU offload, which needs stage 2 or 3, got stage {zero_stage}",
                "set zero.stage=2 (or zero=stage2_offload)",
            )
        )
    if dp_replicate > 1 and zero_stage < 2:
        out.append(
            (
                key_of("dp_replicate"),
                "HSDP (replicate across groups, shard inside) needs ZeRO stage 2 or 3",
                "set zero.stage=3, or parallel.dp_replicate=1",
            )
        )
    return out


def zero_idle_rules(
    zero_stage: int, zero_shard: int, cp: int, accumulate_unsharded: bool, pp: int, grad_accum: int
) -> list[Finding]:
    """ZeRO settings that change nothing (the checks warn; the search does not try them): a stage with one rank to
    shard over, and unsharded accumulation where ZeRO-1, PP or a single micro-batch accumulate unsharded anyway."""
    out: list[Finding] = []
    if zero_stage > 0 and zero_shard == 1:
        out.append(
            (
                ZERO_STAGE,
                f"ZeRO stage {zero_stage} with dp=1" + (" and cp=1" if cp == 1 else "") + " shards nothing",
                "use zero=stage0",
            )
        )
    if accumulate_unsharded and (zero_stage < 2 or pp > 1 or grad_accum == 1):
        out.append(
            (
                key_of("accumulate_unsharded"),
                "changes nothing here: it makes ZeRO-2/3 accumulate gradients unsharded "
                "over micro-batches, which ZeRO-1 and every stage under PP (torch's schedules) do anyway, and one "
                "micro-batch has nothing to accumulate",
                "leave zero.accumulate_unsharded=false",
            )
        )
    return out


FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: FP8 GEMM dimensions are multiples of 16


def simulation_rules(data_parallel: str, w: Workload) -> list[Finding]:
    """dry_run=simulate builds the layout's rank on fake tensors, which FSDP2 and DTensor take but DDP does not:
    `data_parallel` is the layout's wrapper (hpctrain.config.layout.data_parallel_kind)."""
    if not (w.simulate and data_parallel == "ddp"):
        return []
    return [
        (
            "dry_run",
            "simulate builds FSDP2 layouts; zero.stage=0 with DP alone runs DDP, whose C++ reducer "
            "needs real memory for its buckets, which fake tensors do not have",
            "dry_run=true gives DDP's memory (the planner's closed form); or simulate zero.stage=1 (FSDP2)",
        )
    ]


def fp8_rules(tp: int, fp8: str, w: Workload) -> list[Finding]:
    """With FP8 Linears (precision.fp8), every block Linear's TP shard has dimensions FP8 GEMMs can take."""
    if fp8 == "none":
        return []
    d = w.dims
    widths = {"model.d_model": d.d_model, "model.ffn_hidden": d.ffn_hidden}
    if w.grouped_query:
        widths["model.n_kv_heads"] = d.kv_dim  # K and V width (GQA)
    what = {
        "model.d_model": "d_model",
        "model.ffn_hidden": "the MLP hidden size",
        "model.n_kv_heads": "the key/value width (n_kv_heads x head_dim)",
    }
    out: list[Finding] = []
    for key, width in widths.items():
        if width % tp == 0 and (width // tp) % FP8_DIM_MULTIPLE == 0:
            continue
        shard = f" / tp {tp} = {width / tp:g}" if tp > 1 else ""
        out.append(
            (
                key,
                f"{what[key]} {width}{shard} is not a multiple of {FP8_DIM_MULTIPLE}: FP8 GEMMs "
                f"(torch._scaled_mm) need both dimensions of every block Linear's {'TP shard' if tp > 1 else 'weight'} "
                f"to be multiples of {FP8_DIM_MULTIPLE}",
                f"choose {key} so that it is a multiple of {FP8_DIM_MULTIPLE * tp}, or set precision.fp8=none",
            )
        )
    return out
