"""What a checkpoint must share with the run that loads it: a named structure, saved in its manifest.

The model shape must match for the weights to load at all; the batch, sequence length, seed and data must
match for the resume to continue the same training exactly (else it is refused unless forced). The manifest
holds `Fingerprint.to_dict()`. Manifests written before the fields had names hold the model and the data as
positional lists; `from_dict` still reads those, and only there is a position meaningful. Manifests written
before the model had an architecture lack `arch`, `n_kv_heads` and `ffn_hidden`: they were GPT runs, and read
as such (multi-head attention, an MLP of ffn_mult x d_model), equal to today's fingerprint of the same run; those
before `head_dim` had heads of d_model / n_heads.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from hpctrain.models import registry

if TYPE_CHECKING:
    from hpctrain.config.schema import DataConfig, ModelConfig, TrainConfig


@dataclass(frozen=True)
class ModelShape:
    """What decides the shape of every weight (the vocabulary is the tokenizer's, before padding).

    n_kv_heads, ffn_hidden and head_dim are stored resolved (0 in a config means n_heads, ffn_mult x d_model,
    d_model / n_heads), so the same weights give the same fingerprint however the config spells them, and a GPT
    run's equals its older one's."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    context: int
    ffn_mult: int
    arch: str = "gpt"
    n_kv_heads: int = 0
    ffn_hidden: int = 0
    head_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_kv_heads", int(self.n_kv_heads) or self.n_heads)
        object.__setattr__(self, "ffn_hidden", int(self.ffn_hidden) or self.ffn_mult * self.d_model)
        object.__setattr__(self, "head_dim", int(self.head_dim) or self.d_model // self.n_heads)

    @classmethod
    def from_value(cls, value: dict[str, Any] | list[int]) -> ModelShape:
        """From a manifest: named fields (those added later may be absent), or the positional list of older
        manifests (same field order)."""
        if isinstance(value, dict):
            return cls(
                **{
                    f.name: (str if f.type == "str" else int)(value[f.name])
                    for f in fields(cls)
                    if f.name in value or f.default is MISSING
                }
            )
        return cls(*(int(v) for v in value))


@dataclass(frozen=True)
class DataSource:
    """Which token stream: its kind and what identifies it (the file, the blend of indexed datasets, or the
    corpus size for text_bytes), with the validation split when one is held out."""

    kind: str
    source: str | int | None

    @classmethod
    def from_value(cls, value: dict[str, Any] | list[Any]) -> DataSource:
        if isinstance(value, dict):
            return cls(value["kind"], value["source"])
        kind, source = value
        return cls(kind, source)


@dataclass(frozen=True)
class Fingerprint:
    model: ModelShape
    global_batch: int
    seq_len: int
    seed: int
    data: DataSource

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fingerprint:
        return cls(
            ModelShape.from_value(d["model"]),
            int(d["global_batch"]),
            int(d["seq_len"]),
            int(d["seed"]),
            DataSource.from_value(d["data"]),
        )


def fingerprint_of(model: ModelConfig, train: TrainConfig, data: DataConfig) -> Fingerprint:
    """The fingerprint of a run's config sections."""
    kind = getattr(data.kind, "value", data.kind)
    family = registry.family_of(model)
    kv_heads = model.n_kv_heads if family.grouped_query else 0  # no key/value groups: as many as query heads
    shape = ModelShape(
        model.n_layers,
        model.d_model,
        model.n_heads,
        model.vocab_size,
        model.context,
        model.ffn_mult,
        family.name,
        kv_heads,
        model.ffn_hidden,
        model.head_dim,
    )
    source = {"text_bytes": data.max_bytes, "indexed": data.blend}.get(kind, data.path)
    if data.valid_fraction:  # the held-out part is not trained on: another split is other training data
        source = f"{source} valid_fraction={data.valid_fraction:g}"
    return Fingerprint(shape, train.global_batch, train.seq_len, train.seed, DataSource(kind, source))


def upgrade_fingerprint(saved: dict[str, Any]) -> dict[str, Any]:
    """A manifest's fingerprint in today's named form, field by field (old positional lists converted, named
    models completed with the fields added since, anything else kept as it is), so that it compares equal to
    `Fingerprint.to_dict()` of the same run."""
    out = dict(saved)
    for key, kind in (("model", ModelShape), ("data", DataSource)):
        value = out.get(key)
        try:
            if isinstance(value, (list, tuple)):
                out[key] = asdict(kind.from_value(list(value)))
            elif key == "model" and isinstance(value, dict):
                out[key] = {**asdict(ModelShape.from_value(value)), **value}
        except (KeyError, TypeError, ValueError):
            pass  # not a fingerprint this code wrote: left for the comparison to report
    return out
