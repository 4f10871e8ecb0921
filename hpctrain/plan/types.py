"""Plain value types the planner's pure functions share: a model's shape, a parallel layout, a GPU.

They are frozen dataclasses with no torch import, so `--dry-run` can build and compare thousands of
them in well under a second. Validation happens here once, so the math modules can assume sane input.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.layout import DTYPES, RECOMPUTE, Layout, dtype_bytes  # noqa: F401 (the planner's types)
from hpctrain.models.params import ffn_hidden_size, padded_vocab, param_count


from hpctrain.hardware import GB, GiB, KNOWN_HARDWARE, Hardware, hardware  # noqa: F401 (the planner's types)


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape: what the memory, FLOP and communication formulas need (h = d_model, a = n_heads)."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int | None = None  # None: 4 * d_model
    tied_embeddings: bool = True
    vocab_pad_multiple: int = 1  # embedding rows: vocab_size padded to a multiple of this x TP (<= 1: none)
    dropout: float = 0.0  # > 0: dropout masks are stored for backward (memory.py)

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelShape.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else ffn_hidden_size(self.d_model)

    @property
    def params(self) -> int:
        """The model's own parameter count, with the tokenizer's vocabulary (hpctrain.models.params.param_count).

        Padding rows are left out (see `padding_params`): this is the count papers publish (GPT-3 175B).
        """
        return param_count(
            self.n_layers, self.d_model, self.vocab_size, self.seq_len, self.ffn, self.tied_embeddings
        )

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding (and columns of the logits) as built: the vocabulary padded for TP
        (hpctrain.models.params.padded_vocab, Megatron's make-vocab-size-divisible-by). Memory and FLOPs use it."""
        return padded_vocab(self.vocab_size, self.vocab_pad_multiple, tp)

    def padding_params(self, tp: int = 1) -> int:
        """Parameters the padding rows add: (rows - vocab) x d_model, twice with an untied output head."""
        extra = (self.vocab_rows(tp) - self.vocab_size) * self.d_model
        return extra if self.tied_embeddings else 2 * extra


