"""What a checkpoint must share with the run that loads it: a named structure, saved in its manifest.

The model's shape must match for the weights to load at all: its family and every field of its
`hpctrain.models.family.Dims` (the one owner of a model's shape: layers, widths, heads, vocabulary, context and the
Mixture of Experts' experts, top_k, expert width and shared experts), so a field Dims gains is in the fingerprint
without a line here. The batch, sequence length, seed and data must match for the resume to continue the same
training exactly (else it is refused unless forced). The manifest holds `Fingerprint.to_dict()`: the model as
`{"arch": ..., **Dims}`, with key/value heads, the MLP width, the head width and the expert width resolved, so the
same weights give the same fingerprint however the config spells them.

Older manifests still resume (`ModelFingerprint.from_value`, `upgrade_fingerprint`), comparing equal to today's
fingerprint of the same run:
- before the fields had names, the model and the data were positional lists: the model as
  [n_layers, d_model, n_heads, vocab_size, context, ffn_mult] (`LEGACY_ORDER`);
- named models before this one spelled key/value heads `n_kv_heads` and kept `ffn_mult` beside `ffn_hidden`;
- those before the model had an architecture lack `arch`, `n_kv_heads` and `ffn_hidden`: they were GPT runs,
  multi-head attention with an MLP of ffn_mult x d_model; those before `head_dim` had heads of d_model / n_heads;
- none recorded the Mixture of Experts: a dense family's read as dense. An MoE family's cannot tell its experts,
  so `upgrade_fingerprint` takes them from the run it is compared with; the checkpoint's tensor shapes are held
  to the run's all the same (`CheckpointManager._check_shapes`: the experts, their width, the shared experts),
  and only a change of top_k goes unseen for such a checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from hpctrain.models import registry
from hpctrain.models.family import Dims
from hpctrain.models.params import built_dims

if TYPE_CHECKING:
    from hpctrain.config.schema import DataConfig, ModelConfig, TrainConfig

DIMS = tuple(f.name for f in fields(Dims))
EXPERTS = ("n_experts", "top_k", "expert_hidden", "n_shared_experts")  # the Dims fields no manifest had before
LEGACY_ORDER = ("n_layers", "d_model", "n_heads", "vocab_size", "context", "ffn_mult")  # the positional manifests
LEGACY_NAMES = frozenset({"n_kv_heads", "ffn_mult"})  # named manifests' fields that Dims holds resolved
# The config key that sets each fingerprint field, where it is not `model.<field>` (the checks name it in a refusal).
CONFIG_KEYS = {"kv_heads": "model.n_kv_heads", **{name: f"model.moe.{name}" for name in EXPERTS}}


def config_key(name: str) -> str:
    """The `model.*` key that sets fingerprint field `name` (a Dims field, or arch)."""
    return CONFIG_KEYS.get(name, f"model.{name}")


@dataclass(frozen=True)
class ModelFingerprint:
    """What decides the shape of every weight: the model's family and its Dims (the tokenizer's vocabulary,
    before padding)."""

    arch: str
    dims: Dims

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **asdict(self.dims)}

    @classmethod
    def from_value(cls, value: dict[str, Any] | list[int], like: ModelFingerprint | None = None) -> ModelFingerprint:
        """From a manifest: named fields (today's, or an older manifest's: module docstring), or the positional
        list of the oldest. `like`: the run it is compared with, whose experts stand in for those an MoE family's
        manifest did not record (module docstring)."""
        if not isinstance(value, dict):
            value = dict(zip(LEGACY_ORDER, value, strict=True))
        arch = str(value.get("arch", "gpt"))  # manifests from before the architecture was recorded: GPT runs
        d_model, n_heads = int(value["d_model"]), int(value["n_heads"])
        kv_heads = value.get("kv_heads", value.get("n_kv_heads"))
        named = {name: int(value[name]) for name in DIMS if name in value}
        dims = Dims(
            **{
                **dict.fromkeys(EXPERTS, 0),  # dense, unless the manifest says otherwise
                **named,
                "kv_heads": int(kv_heads or n_heads),
                "ffn_hidden": int(value.get("ffn_hidden") or int(value.get("ffn_mult", 4)) * d_model),
            }
        )
        if like is not None and like.arch == arch and registry.get(arch).moe and not set(EXPERTS) & set(value):
            dims = replace(dims, **{name: getattr(like.dims, name) for name in EXPERTS})
        return cls(arch, dims)


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
    model: ModelFingerprint
    global_batch: int
    seq_len: int
    seed: int
    data: DataSource

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model": self.model.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fingerprint:
        return cls(
            ModelFingerprint.from_value(d["model"]),
            int(d["global_batch"]),
            int(d["seq_len"]),
            int(d["seed"]),
            DataSource.from_value(d["data"]),
        )


def fingerprint_of(model: ModelConfig, train: TrainConfig, data: DataConfig) -> Fingerprint:
    """The fingerprint of a run's config sections: the model as its family builds it (`built_dims`)."""
    kind = getattr(data.kind, "value", data.kind)
    family, dims = built_dims(model)
    source = {"text_bytes": data.max_bytes, "indexed": data.blend}.get(kind, data.path)
    if data.valid_fraction:  # the held-out part is not trained on: another split is other training data
        source = f"{source} valid_fraction={data.valid_fraction:g}"
    return Fingerprint(
        ModelFingerprint(family.name, dims), train.global_batch, train.seq_len, train.seed, DataSource(kind, source)
    )


def upgrade_fingerprint(saved: dict[str, Any], ours: dict[str, Any] | None = None) -> dict[str, Any]:
    """A manifest's fingerprint in today's named form, field by field (old positional lists converted, older named
    models translated, anything else kept as it is: a field this code does not know makes the comparison fail), so
    that it compares equal to `Fingerprint.to_dict()` of the same run. `ours`: the run's own (upgraded)
    fingerprint, whose experts stand in for those an older MoE manifest did not record (module docstring)."""
    out = dict(saved)
    like = None
    if ours is not None and isinstance(ours.get("model"), dict):
        try:
            like = ModelFingerprint.from_value(ours["model"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            like = None
    model, data = out.get("model"), out.get("data")
    try:
        if isinstance(model, (list, tuple)):
            out["model"] = ModelFingerprint.from_value(list(model)).to_dict()
        elif isinstance(model, dict):
            unknown = {k: v for k, v in model.items() if k not in {"arch", *DIMS, *LEGACY_NAMES}}
            out["model"] = {**ModelFingerprint.from_value(model, like).to_dict(), **unknown}
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        pass  # not a fingerprint this code wrote: left for the comparison to report
    try:
        if isinstance(data, (list, tuple)):
            out["data"] = asdict(DataSource.from_value(list(data)))
    except (KeyError, TypeError, ValueError):
        pass
    return out
