"""Plain value types the planner's pure functions share: a model's shape, a parallel layout, a GPU.

They are frozen dataclasses with no torch import, so `--dry-run` can build and compare thousands of
them in well under a second. Validation happens here once, so the math modules can assume sane input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from hpctrain.config.layout import DTYPES, RECOMPUTE, Layout, dtype_bytes
from hpctrain.hardware import GB, KNOWN_HARDWARE, GiB, Hardware, hardware
from hpctrain.models.family import Dims, Family, Shapes
from hpctrain.models.params import active_param_count, built_dims, expert_layer_params, padded_vocab, param_count

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

# The planner's types, from here: the model's shape, and the layout and the GPU it is planned on.
__all__ = [
    "DTYPES",
    "GB",
    "KNOWN_HARDWARE",
    "RECOMPUTE",
    "GiB",
    "Hardware",
    "Layout",
    "ModelShape",
    "dtype_bytes",
    "hardware",
]


@dataclass(frozen=True)
class ModelShape:
    """The model as the planner sees it: its family and its `Dims` (hpctrain.models.family, the one owner of the
    shape: layers, widths, heads, vocabulary, experts), with what the formulas need besides the shape: the trained
    sequence length, the vocabulary's padding and the dropout. Read the shape as `model.dims.d_model` and so on;
    what the family adds (which parameters exist, whether the head is tied, what the block saves for backward) is
    asked of `family`, and the figures derived from both are computed once per model (cached properties: the
    layout search reads them thousands of times).

    Build it from a config with `ModelShape.of(cfg.model, cfg.train.seq_len)`, or from a family and a Dims."""

    family: Family = field(hash=False)  # unhashable (its tables): hashed by `dims`, still compared whole
    dims: Dims
    seq_len: int  # train.seq_len: the tokens of a sequence (the activations', FLOPs' and traffic's s)
    vocab_pad_multiple: int = 1  # embedding rows: vocab_size padded to a multiple of this x TP (<= 1: none)
    dropout: float = 0.0  # > 0: dropout masks are stored for backward (memory.py)

    def __post_init__(self) -> None:
        d, name = self.dims, self.family.name
        for key in ("n_layers", "d_model", "n_heads", "vocab_size", "context", "kv_heads", "ffn_hidden", "head_dim"):
            if getattr(d, key) < 1:
                raise ValueError(f"Dims.{key} must be >= 1, got {getattr(d, key)}")
        if self.seq_len < 1:
            raise ValueError(f"ModelShape.seq_len must be >= 1, got {self.seq_len}")
        if d.d_model % d.n_heads and d.head_dim == d.d_model // d.n_heads:  # no head width of its own
            raise ValueError(f"d_model {d.d_model} is not divisible by n_heads {d.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelShape.dropout must be in [0, 1), got {self.dropout}")
        if d.n_heads % d.kv_heads:
            raise ValueError(f"n_heads {d.n_heads} is not a multiple of kv_heads {d.kv_heads}")
        if not self.family.grouped_query and d.kv_heads != d.n_heads:
            raise ValueError(f"grouped-query attention (kv_heads < n_heads) is not the {name} family's")
        if self.family.moe != (d.n_experts > 0):
            kind = "a Mixture of Experts" if self.family.moe else "dense"
            raise ValueError(f"the {name} family is {kind}: n_experts={d.n_experts}")
        if self.family.moe and not 1 <= d.top_k <= d.n_experts:
            raise ValueError(f"top_k {d.top_k} must be in [1, n_experts = {d.n_experts}]")

    @classmethod
    def of(cls, m: ModelConfig, seq_len: int) -> ModelShape:
        """A config's model trained on sequences of `seq_len` tokens: its family (model.arch) and the Dims it
        builds (hpctrain.models.params.built_dims), its vocabulary padding and dropout."""
        family, dims = built_dims(m)
        return cls(family, dims, seq_len, m.vocab_pad_multiple, m.dropout)

    @property
    def tied_embeddings(self) -> bool:
        """The family ties the output head to the token embedding (a copy on the last pipeline stage)."""
        return self.family.tied_embeddings

    @property
    def moe(self) -> bool:
        """The feed-forward is a Mixture of Experts (model.moe; parallel.ep may split its experts)."""
        return self.family.moe

    @property
    def gated(self) -> bool:
        """A gated (SwiGLU) MLP: three d x f matrices instead of two (the family's)."""
        return self.family.activations.gated_mlp

    @cached_property
    def _block_shapes(self) -> Shapes:
        return self.family.block_shapes(self.dims)

    def block_shapes(self) -> Shapes:
        """One block's parameters and shapes, as the family builds them (a copy of the cached table: the layout
        search asks thousands of times)."""
        return dict(self._block_shapes)

    def top_shapes(self, tp: int = 1) -> Shapes:
        """The parameters outside the blocks, the embedding (and an untied head) padded for `tp`."""
        return self.family.top_shapes(self.dims, self.vocab_rows(tp))

    @cached_property
    def block_matmul_params(self) -> int:
        """The block's matrix elements each token is multiplied by: its 2-D weights, and top_k / n_experts of its
        stacked expert weights (a token runs top_k experts)."""
        return sum(self._token_matmul_params(name, shape) for name, shape in self._block_shapes.items())

    @cached_property
    def whole_matmul_params(self) -> int:
        """The part of `block_matmul_params` in the modules TP leaves whole (`Family.tp_whole`: the MoE layer),
        which every TP rank computes on the full sequence; 0 for a dense family."""
        return sum(
            self._token_matmul_params(name, shape) for name, shape in self._block_shapes.items() if self.tp_whole(name)
        )

    @cached_property
    def expert_matmul_params(self) -> int:
        """The experts' part of `block_matmul_params`: top_k / n_experts of the expert weights (their grouped
        GEMMs, which the busiest EP rank runs on more rows than the mean: step_time.py)."""
        return self.expert_layer_params * self.dims.top_k // max(self.dims.n_experts, 1)

    @cached_property
    def expert_layer_params(self) -> int:
        """One block's expert weights (the family's `ep_dims`: what expert parallelism splits over ep ranks)."""
        return expert_layer_params(self.family, self.dims)

    def tp_whole(self, name: str) -> bool:
        """Whether block parameter `name` is in a module TP leaves whole (`Family.tp_whole`)."""
        return any(name.startswith(module + ".") for module in self.family.tp_whole)

    def _token_matmul_params(self, name: str, shape: tuple[int, ...]) -> int:
        """Elements of block parameter `name` one token is multiplied by (none for a vector)."""
        if self.family.expert_dim(name) is not None:
            return math.prod(shape) * self.dims.top_k // self.dims.n_experts
        return math.prod(shape) if len(shape) == 2 else 0

    @cached_property
    def params(self) -> int:
        """The model's own parameter count, with the tokenizer's vocabulary (the family's shapes summed).

        Padding rows are left out (see `padding_params`): this is the count papers publish (GPT-3 175B).
        """
        return param_count(self.family, self.dims)

    @cached_property
    def active_params(self) -> int:
        """The parameters a token goes through (hpctrain.models.params.active_param_count: a Mixture of Experts
        counts top_k / n_experts of its expert weights; `params` for a dense model). MFU's N."""
        return active_param_count(self.family, self.dims)

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding (and columns of the logits) as built: the vocabulary padded for TP
        (hpctrain.models.params.padded_vocab, Megatron's make-vocab-size-divisible-by). Memory and FLOPs use it."""
        return padded_vocab(self.dims.vocab_size, self.vocab_pad_multiple, tp)

    def padding_params(self, tp: int = 1) -> int:
        """Parameters the padding rows add: (rows - vocab) x d_model, twice with an untied output head."""
        extra = (self.vocab_rows(tp) - self.dims.vocab_size) * self.dims.d_model
        return extra if self.tied_embeddings else 2 * extra
