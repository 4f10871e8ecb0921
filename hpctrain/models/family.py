"""A model family entry (a `Family`): everything hpctrain asks about an architecture before building it, and
what its torch module provides (`FamilyModule`).

The planner (parameters per stage and TP rank, FLOPs, activation bytes), the checks (the shape rules, what each
parallel dimension must divide), `parallel=auto`, the checkpoint fingerprint, the pipeline cut and the Hugging
Face converter all read the family entry and branch on no architecture name (tests/test_families.py holds them to
it), so a family is its own folder, hpctrain/models/<name>/ (the family entry in `entry.py`, torch-free: the login
node plans with it; the torch module in `model.py`), and one line in hpctrain/models/registry.py, as a pipeline
schedule is one entry of hpctrain/schedules.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from torch import nn

    from hpctrain.config.schema import ModelConfig

Shapes = dict[str, tuple[int, ...]]
# (model.* key at fault, what is wrong, the fix): a config check's finding, kept torch- and config-free here
ShapeProblem = tuple[str, str, str]


@dataclass(frozen=True)
class Dims:
    """The numbers a family's shape formulas read, resolved (key/value heads and the MLP width are never 0)."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int  # the tokenizer's; the embedding's rows are passed apart (padded for TP)
    context: int
    head_dim: int = 0  # 0: d_model / n_heads
    n_experts: int = 0  # Mixture-of-Experts: routed experts per layer (0: dense) ...
    top_k: int = 0  # ... of which each token uses top_k
    expert_hidden: int = 0  # each expert's hidden size (0: ffn_hidden)
    n_shared_experts: int = 0  # experts every token goes through (one SwiGLU n_shared_experts x expert_hidden wide)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_dim", self.head_dim or self.d_model // self.n_heads)
        object.__setattr__(self, "expert_hidden", self.expert_hidden or self.ffn_hidden)

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention output: n_heads x head_dim (d_model unless head_dim is set apart)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K and V: key/value heads x head_dim (q_dim without grouped-query attention)."""
        return self.kv_heads * self.head_dim

    @classmethod
    def of(cls, m: ModelConfig) -> Dims:
        """A config's `model` section: n_kv_heads 0 means n_heads, ffn_hidden 0 means ffn_mult x d_model, head_dim
        0 means d_model / n_heads."""
        moe = m.moe
        return cls(
            m.n_layers,
            m.d_model,
            m.n_heads,
            m.n_kv_heads or m.n_heads,
            m.ffn_hidden or m.ffn_mult * m.d_model,
            m.vocab_size,
            m.context,
            m.head_dim,
            moe.n_experts,
            moe.top_k if moe.n_experts else 0,
            moe.expert_hidden,
            moe.n_shared_experts,
        )


@dataclass(frozen=True)
class BlockActivations:
    """What the block saves for backward beyond GPT's (hpctrain.plan.activations reads these, measured per family
    in tests/plan/test_plan_activations.py)."""

    gated_mlp: bool = False  # SwiGLU: gate and up outputs (2 f) and silu's output (f) instead of GELU's f and f
    rope: bool = False  # the rotated Q and K that attention saves (V stays a view of the QKV output)
    norm_fp32_copy: bool = False  # RMSNorm keeps an fp32 copy of its input besides the normalised output
    head_norms: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    moe: bool = False  # the feed-forward is a Mixture of Experts (router, routed rows, top_k expert SwiGLUs)


@dataclass(frozen=True)
class HFSpec:
    """The family's Hugging Face transformers counterpart: its config.json and its weights, torch-free except
    `recipes`, which names the torch-side table (hpctrain weight -> HF tensors, hpctrain.models.common.recipes)."""

    model_type: str  # config.json's model_type
    class_name: str  # config.json's architectures[0], the *ForCausalLM class
    base_prefix: str  # the base model's prefix in *ForCausalLM files ("transformer.", "model.")
    tied_default: bool  # tie_word_embeddings when config.json leaves it out
    fields: Callable[[Mapping[str, Any]], dict[str, Any]]  # config.json -> model.* keys (HFMismatch if it cannot)
    config: Callable[[ModelConfig, str], dict[str, Any]]  # (model, dtype name) -> config.json
    compared: Callable[[ModelConfig, Mapping[str, Any]], dict[str, Any]]  # the run's values of keys HF also fixes
    weight_shapes: Callable[[Dims], Shapes]  # HF tensors by canonical name (a tied head is not saved)
    recipes: str  # "module:function" -> (model config) -> {hpctrain name: Recipe}, in the family's torch module
    dropout: dict[str, float] = field(default_factory=dict)  # config.json dropout keys and transformers' defaults
    not_weights: tuple[str, ...] = ()  # name endings of state-dict entries that are buffers, not weights


@dataclass(frozen=True)
class Family:
    """A family entry: one model architecture. `block_shapes`/`top_shapes` name every parameter as the torch
    module builds it (the tests count the meta-device models against them), so parameter counts per pipeline stage
    and TP rank, the HF converter and the memory model need no torch."""

    name: str  # model.arch
    summary: str
    builder: str  # "module:function" -> (model config, tp) -> the torch module (a FamilyModule), on the current device
    tied_embeddings: bool  # the output head is the token embedding (the last pipeline stage keeps a copy)
    grouped_query: bool  # n_kv_heads < n_heads allowed
    block_shapes: Callable[[Dims], Shapes]  # one block's parameters, names under `layers.<i>.`
    top_shapes: Callable[[Dims, int], Shapes]  # (dims, embedding rows) -> the parameters outside the blocks
    tp_dims: dict[str, int]  # parameter name suffix -> the dim TP splits (column-parallel 0, row-parallel 1)
    activations: BlockActivations
    shape_problems: Callable[[ModelConfig], list[ShapeProblem]]  # the family's own rules on model.*
    hf: HFSpec
    # top-level module -> "first" | "last" | "ends": the modules a pipeline stage may drop (hpctrain.parallel.pipeline)
    stage_modules: dict[str, str] = field(default_factory=dict)
    tp_head_norms: tuple[str, ...] = ()  # block modules normalising each head: whole weight, input split by heads
    # Mixture-of-Experts: parameter name suffix -> its expert dim, which expert parallelism splits (its experts
    # are then sharded by FSDP over the DP ranks an EP group leaves); these parameters are whole on every TP rank
    ep_dims: dict[str, int] = field(default_factory=dict)
    # block modules TP leaves whole (each TP rank computes them on the full sequence; under SP their input is
    # gathered and their output cut back to this rank's slice): the MoE layer, whose experts TP does not split
    tp_whole: tuple[str, ...] = ()

    @property
    def moe(self) -> bool:
        """Whether the family's feed-forward is a Mixture of Experts (model.moe.* applies, parallel.ep may be > 1)."""
        return bool(self.ep_dims)

    def build(self, model_cfg: ModelConfig, tp: int = 1) -> FamilyModule:
        """The torch module (imports torch): the family's builder, embedding padded for `tp`."""
        module: FamilyModule = resolve(self.builder)(model_cfg, tp)
        return module

    def expert_dim(self, name: str) -> int | None:
        """The dim expert parallelism splits parameter `name` along, None for a parameter every EP rank holds."""
        return next((d for suffix, d in self.ep_dims.items() if name.endswith(suffix)), None)

    def sharded_dim(self, name: str) -> int | None:
        """The dim TP splits parameter `name` along, None when it is replicated over TP."""
        return next((d for suffix, d in self.tp_dims.items() if name.endswith(suffix)), None)

    def block_tp_dims(self) -> dict[str, int]:
        """The block's parameters TP splits (names under `layers.<i>.`) and the dim of each: its TP plan."""
        names = self.block_shapes(Dims(1, 2, 1, 1, 2, 1, 1))  # the names do not depend on the sizes
        return {name: dim for name in names if (dim := self.sharded_dim(name)) is not None}

    def stage_holds(self, module: str, first: bool, last: bool) -> bool:
        """Whether a pipeline stage keeps top-level `module`: "first" (the embeddings), "last" (the final norm, an
        untied head), "ends" (a tied embedding: the last stage keeps the head's copy, Megatron's embedding
        group); a module the family does not list is on every stage."""
        where = self.stage_modules.get(module)
        return {"first": first, "last": last, "ends": first or last}.get(where or "", True)


@runtime_checkable
class FamilyModule(Protocol):
    """What hpctrain.parallel, hpctrain.train and the checkpoints rely on in the nn.Module a family's builder makes
    (tests/test_families.py checks every registered family's): no process groups, no DTensor, no rank logic; the
    layouts are applied from outside, by parameter name. It is an nn.Module, which a Protocol cannot say: torch's
    APIs get it through hpctrain.models.as_module."""

    family: str  # its family entry's name in hpctrain.models.registry
    tied_embeddings: bool  # the head is the token embedding (`Family.tied_embeddings`)

    @property
    def layers(self) -> nn.ModuleDict:
        """The blocks, keyed by their global index: a pipeline stage deletes those it does not own, and the
        parameter names (`layers.<i>.`) stay the single-process model's."""

    @property
    def tok_emb(self) -> nn.Embedding | None:
        """The token embedding; None on a pipeline stage that neither looks tokens up nor ties its head to it.
        Every top-level module the family entry's `stage_modules` lists may be set to None."""

    @property
    def norm_f(self) -> nn.Module | None:
        """The final norm, on the stage that computes the logits (None elsewhere)."""

    @property
    def embeds(self) -> bool:
        """Whether this part looks the tokens up (the whole model, or the first pipeline stage)."""

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (the first stage) or hidden states [B, T, d] (later stages) -> logits over the padded
        vocabulary (the stage holding `norm_f`) or hidden states."""

    def output_weight(self) -> torch.Tensor:
        """The head's weight (the token embedding's where tied)."""

    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter, the same in every layout (a model built on the meta device, then materialised)."""

    # nn.Module's own, which the layouts call on the model
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def modules(self, remove_duplicate: bool = True) -> Iterator[nn.Module]: ...

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> nn.Module: ...


class HFMismatch(ValueError):
    """An HF model that does not fit the run's model config; the message names each key, both values, the fix."""


def refuse(values: dict[str, tuple[Any, tuple[Any, ...]]], kind: str) -> None:
    """HFMismatch naming each config.json setting (value, the values hpctrain's model supports) not supported."""
    bad = [
        f"{k}={v!r} (hpctrain's model supports {', '.join(map(repr, ok))})"
        for k, (v, ok) in values.items()
        if v not in ok
    ]
    if bad:
        raise HFMismatch(f"this {kind} model cannot be represented by hpctrain's: " + "; ".join(bad))


def resolve(target: str) -> Any:
    """ "package.module:attr" -> the object (the torch side, imported only when asked for)."""
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)
