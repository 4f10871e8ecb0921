"""Parameter counts of the GPT family, as pure arithmetic.

The plan prints these before anything is built, so they must not need torch.
They match `sum(p.numel())` of `hpctrain.models.gpt.GPT` exactly (tested).
"""

from __future__ import annotations


def padded_vocab(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """The embedding's row count: the vocabulary rounded up to a multiple of `multiple` x TP.

    GPU matmuls run at full speed when the output dimension is a multiple of 64 (tensor-core tiles), and each
    TP rank then holds an equal, aligned slice of the vocabulary (Megatron's make-vocab-size-divisible-by).
    The extra rows are never looked up and their logits are cut off before the loss: the loss is the
    unpadded model's. `multiple` <= 1 disables padding.
    """
    step = max(1, multiple) * max(1, tp) if multiple > 1 else 1
    return -(-vocab_size // step) * step


def ffn_hidden_size(d_model: int, ffn_mult: int = 4) -> int:
    return ffn_mult * d_model


def layer_params(d_model: int, ffn_hidden: int) -> int:
    """One pre-LN transformer block: QKV + proj + 2 MLP matrices, their biases, 2 LayerNorms.

    With ffn_hidden = 4d this is the standard 12 d^2 + 13 d.
    """
    attn = 3 * d_model * d_model + 3 * d_model + d_model * d_model + d_model
    mlp = 2 * d_model * ffn_hidden + ffn_hidden + d_model
    norms = 2 * 2 * d_model
    return attn + mlp + norms


def embedding_params(d_model: int, vocab_size: int, seq_len: int) -> int:
    """Token embedding (tied with the output head) + learned positions."""
    return vocab_size * d_model + seq_len * d_model


def param_count(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    seq_len: int,
    ffn_hidden: int | None = None,
    tied_embeddings: bool = True,
) -> int:
    """Total parameters: 12 l d^2 (1 + 13/(12 d) + (V + s)/(12 l d)) + final LayerNorm (Narayanan et al. 2021)."""
    ffn = ffn_hidden if ffn_hidden is not None else ffn_hidden_size(d_model)
    total = n_layers * layer_params(d_model, ffn) + embedding_params(d_model, vocab_size, seq_len)
    total += 2 * d_model  # final LayerNorm
    if not tied_embeddings:
        total += vocab_size * d_model
    return total
