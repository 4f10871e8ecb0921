"""Plain value types the planner's pure functions share: a model's shape, a parallel layout, a GPU.

They are frozen dataclasses with no torch import, so `--dry-run` can build and compare thousands of
them in well under a second. Validation happens here once, so the math modules can assume sane input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property

from hpctrain.config.layout import DTYPES, RECOMPUTE, Layout, dtype_bytes  # noqa: F401 (the planner's types)
from hpctrain.hardware import GB, KNOWN_HARDWARE, GiB, Hardware, hardware  # noqa: F401 (the planner's types)
from hpctrain.models import registry
from hpctrain.models.family import Dims, Family
from hpctrain.models.params import (
    dims_active_param_count,
    dims_param_count,
    expert_layer_params,
    ffn_hidden_size,
    padded_vocab,
)


@dataclass(frozen=True)
class ModelShape:
    """A model's shape: what the memory, FLOP and communication formulas need (h = d_model, a = n_heads). Derived
    figures are computed once per shape (cached properties): the layout search reads them thousands of times.

    `arch` names the model family (hpctrain.models.registry): which parameters exist (its block_shapes and
    top_shapes), whether the head is tied, what the block saves for backward, whether grouped-query attention
    (n_kv_heads < n_heads: K and V `kv_dim` wide) is allowed, whether its feed-forward is a Mixture of Experts
    (n_experts of expert_hidden each, top_k of them per token)."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int | None = None  # None: 4 * d_model
    vocab_pad_multiple: int = 1  # embedding rows: vocab_size padded to a multiple of this x TP (<= 1: none)
    dropout: float = 0.0  # > 0: dropout masks are stored for backward (memory.py)
    arch: str = "gpt"
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: n_heads
    head_dim: int = 0  # each head's width; 0: d_model / n_heads
    n_experts: int = 0  # Mixture of Experts (a family with `Family.moe`): experts per layer ...
    top_k: int = 0  # ... each token goes through top_k of them
    expert_hidden: int = 0  # each expert's SwiGLU width; 0: ffn_hidden
    n_shared_experts: int = 0  # experts every token goes through

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelShape.dropout must be in [0, 1), got {self.dropout}")
        family = registry.get(self.arch)  # ValueError naming the families
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if not family.grouped_query and self.kv_heads != self.n_heads:
            raise ValueError(f"grouped-query attention (n_kv_heads < n_heads) is not the {self.arch} family's")
        if family.moe != (self.n_experts > 0):
            raise ValueError(
                f"the {self.arch} family is {'a Mixture of Experts' if family.moe else 'dense'}: "
                f"n_experts={self.n_experts}"
            )
        if family.moe and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts = {self.n_experts}]")

    @property
    def family(self) -> Family:
        return registry.get(self.arch)

    @property
    def tied_embeddings(self) -> bool:
        """The family ties the output head to the token embedding (a copy on the last pipeline stage)."""
        return self.family.tied_embeddings

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else ffn_hidden_size(self.d_model)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @cached_property
    def dims(self) -> Dims:
        """The numbers the family's shape formulas read (its embedding: the tokenizer's vocabulary)."""
        return Dims(
            self.n_layers,
            self.d_model,
            self.n_heads,
            self.kv_heads,
            self.ffn,
            self.vocab_size,
            self.seq_len,
            self.head_dim,
            self.n_experts,
            self.top_k,
            self.expert_hidden,
            self.n_shared_experts,
        )

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention's output: n_heads x head_dim (d_model unless head_dim is set apart)."""
        return self.dims.q_dim

    @property
    def kv_dim(self) -> int:
        """Width of K and V: kv_heads x head_dim (d_model without grouped-query attention)."""
        return self.dims.kv_dim

    @cached_property
    def block_matmul_params(self) -> int:
        """The block's matrix elements each token is multiplied by: its 2-D weights, and top_k / n_experts of its
        stacked expert weights (a token runs top_k experts)."""
        return sum(self._token_matmul_params(name, shape) for name, shape in self.block_shapes().items())

    @cached_property
    def whole_matmul_params(self) -> int:
        """The part of `block_matmul_params` in the modules TP leaves whole (`Family.tp_whole`: the MoE layer),
        which every TP rank computes on the full sequence; 0 for a dense family."""
        return sum(
            self._token_matmul_params(name, shape) for name, shape in self.block_shapes().items() if self.tp_whole(name)
        )

    @cached_property
    def expert_matmul_params(self) -> int:
        """The experts' part of `block_matmul_params`: top_k / n_experts of the expert weights (their grouped
        GEMMs, which the busiest EP rank runs on more rows than the mean: step_time.py)."""
        return self.expert_layer_params * self.top_k // max(self.n_experts, 1)

    @cached_property
    def expert_layer_params(self) -> int:
        """One block's expert weights (the family's `ep_dims`: what expert parallelism splits over ep ranks)."""
        return expert_layer_params(self.arch, self.dims)

    def tp_whole(self, name: str) -> bool:
        """Whether block parameter `name` is in a module TP leaves whole (`Family.tp_whole`)."""
        return any(name.startswith(module + ".") for module in self.family.tp_whole)

    def _token_matmul_params(self, name: str, shape: tuple[int, ...]) -> int:
        """Elements of block parameter `name` one token is multiplied by (none for a vector)."""
        if self.family.expert_dim(name) is not None:
            return math.prod(shape) * self.top_k // self.n_experts
        return math.prod(shape) if len(shape) == 2 else 0

    @property
    def moe(self) -> bool:
        """The feed-forward is a Mixture of Experts (model.moe; parallel.ep may split its experts)."""
        return self.family.moe

    @property
    def gated(self) -> bool:
        """A gated (SwiGLU) MLP: three d x f matrices instead of two (the family's)."""
        return self.family.activations.gated_mlp

    @cached_property
    def params(self) -> int:
        """The model's own parameter count, with the tokenizer's vocabulary (the family's shapes summed).

        Padding rows are left out (see `padding_params`): this is the count papers publish (GPT-3 175B).
        """
        return dims_param_count(self.arch, self.dims)

    @cached_property
    def active_params(self) -> int:
        """The parameters a token goes through (hpctrain.models.params.dims_active_param_count: a Mixture of
        Experts counts top_k / n_experts of its expert weights; `params` for a dense model). MFU's N."""
        return dims_active_param_count(self.arch, self.dims)

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """One block's parameters and shapes, as the family builds them (a copy of the cached table: the layout
        search asks thousands of times)."""
        return dict(_block_shapes(self.arch, self.dims))

    def top_shapes(self, tp: int = 1) -> dict[str, tuple[int, ...]]:
        """The parameters outside the blocks, the embedding (and an untied head) padded for `tp`."""
        return self.family.top_shapes(self.dims, self.vocab_rows(tp))

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding (and columns of the logits) as built: the vocabulary padded for TP
        (hpctrain.models.params.padded_vocab, Megatron's make-vocab-size-divisible-by). Memory and FLOPs use it."""
        return padded_vocab(self.vocab_size, self.vocab_pad_multiple, tp)

    def padding_params(self, tp: int = 1) -> int:
        """Parameters the padding rows add: (rows - vocab) x d_model, twice with an untied output head."""
        extra = (self.vocab_rows(tp) - self.vocab_size) * self.d_model
        return extra if self.tied_embeddings else 2 * extra


@cache
def _block_shapes(arch: str, dims: Dims) -> dict[str, tuple[int, ...]]:
    return registry.get(arch).block_shapes(dims)
