"""Hugging Face model directories: export a checkpoint as one, start a run from one (continued pretraining).

A directory is config.json and the weights in safetensors, one file or several with model.safetensors.index.json,
as `save_pretrained` writes them and `AutoModelForCausalLM.from_pretrained` reads them. Only safetensors are
read: a pickle (pytorch_model.bin) runs code when it is loaded. The tensor conversion is hpctrain.models.hf.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hpctrain.checkpoint.inspect import (
    CheckpointError,
    DamagedCheckpoint,
    ExportFailed,
    like_a_normal_file,
    make_parents,
    model_tensors,
    out_of_room,
    write_failure,
)
from hpctrain.checkpoint.reshard import legacy_source, load_state
from hpctrain.checkpoint.storage import Committed
from hpctrain.models.family import HFMismatch
from hpctrain.models.hf import (
    VOCAB_ROWS,
    canonical_name,
    check_hf_shapes,
    hf_config,
    iter_from_hf,
    mismatches,
    recipes,
    to_hf,
)
from hpctrain.models.registry import family_of
from hpctrain.records.paths import RunPaths

if TYPE_CHECKING:
    from hpctrain.config.schema import ModelConfig

log = logging.getLogger("hpctrain")

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")


def run_model_config(run_dir: Path) -> ModelConfig:
    """The typed model config of a run (its config.yaml)."""
    from omegaconf import OmegaConf

    from hpctrain.bounded import Unreadable, read_text
    from hpctrain.config.schema import ModelConfig

    path = RunPaths(run_dir).config
    try:
        typed = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(read_text(path)).model)
        return cast(ModelConfig, typed)  # a DictConfig of the ModelConfig schema reads as one
    except Unreadable as err:
        raise CheckpointError(f"the run's config cannot be read: {err}") from None
    except Exception as exc:  # noqa: BLE001  (not YAML, no model section, a model this version does not know)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{path} holds no model config this hpctrain reads ({type(exc).__name__}: {first})"
        ) from None


# ---------------------------------------------------------------- export


def export_hf(c: Committed, m: ModelConfig, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """A checkpoint (any layout) -> the HF model directory `out`, read one safetensors file's weights at a time:
    the host never holds more of the model than one file (a 405B model does not fit in one node's memory).
    A checkpoint in older weight names (a Llama's interleaved `mlp.fc.weight`) is read in today's names."""
    tensors = _named_as_today(model_tensors(c), m)

    def read(names: list[str]) -> dict[str, torch.Tensor]:  # inspect.consolidated_model, in today's names
        from hpctrain.checkpoint.reader import CorruptCheckpoint

        state = {k: torch.empty(tensors[k].shape, dtype=tensors[k].dtype) for k in names}
        try:
            load_state({"train": {"model": state}}, str(c.path), None, no_dist=True)  # converts older weight names
        except CorruptCheckpoint as err:
            raise DamagedCheckpoint(f"the checkpoint {c.path} is damaged: {err}") from None
        return state

    return _write(tensors, read, m, out, max_shard_bytes)


def _named_as_today(saved: Mapping[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors (meta) under the config's weight names, those an older checkpoint holds under
    another name (reshard.legacy_source) converted on the meta device; names no weight of the config takes are
    kept, for `to_hf` to report."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in recipes(m):
        source = legacy_source(name) if name not in saved else None
        if source is not None and source[0] in saved:
            out[name] = source[1](saved[source[0]])
            used.add(source[0])
        elif name in saved:
            out[name] = saved[name]
    return {**out, **{k: v for k, v in saved.items() if k not in out and k not in used}}


def save_hf(
    state: Mapping[str, torch.Tensor], m: ModelConfig, out: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """A full hpctrain model state in memory -> the HF model directory `out`, the same files export_hf writes."""
    return _write(state, lambda names: {k: state[k] for k in names}, m, out, max_shard_bytes)


def _write(
    tensors: Mapping[str, torch.Tensor],
    read: Callable[[list[str]], Mapping[str, torch.Tensor]],
    m: ModelConfig,
    out: Path,
    max_shard_bytes: int,
) -> list[Path]:
    """config.json and the safetensors file(s) of the model whose weights `tensors` names and shapes (meta
    tensors will do) and `read` gives, group by group; written whole or not at all (into a sibling directory
    first, renamed into place). `out` must not hold anything yet."""
    from safetensors.torch import save_file

    if out.exists() and not out.is_dir():
        raise ExportFailed(f"{out} is a file: an HF export is a directory (give a new directory's path)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: export into a new directory (or remove this one first)")
    table = recipes(m)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}
    hf_meta = to_hf(meta, m)  # names and shapes checked against the config before anything is read
    config = hf_config(m, next(iter(hf_meta.values())).dtype)  # and what HF cannot represent, refused before too
    nbytes = {name: sum(hf_meta[k].numel() * hf_meta[k].element_size() for k in table[name].hf_names) for name in table}
    groups = _groups(nbytes, max_shard_bytes)
    files = (
        [WEIGHTS]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    made = make_parents(partial)
    try:
        partial.mkdir()
        weight_map: dict[str, str] = {}
        for file, group in zip(files, groups):
            state = read(group)
            hf = {k: v for name in group for k, v in zip(table[name].hf_names, table[name].split(state[name]))}
            save_file(hf, str(partial / file), metadata={"format": "pt"})  # HF refuses files without "format"
            weight_map.update(dict.fromkeys(hf, file))
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
            (partial / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(INDEX)
        (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for file in files:  # save_file writes 0600: the weights get config.json's mode (0644 under the usual umask)
            like_a_normal_file(partial / file, partial / CONFIG)
        if out.exists():
            out.rmdir()  # empty (checked above): the rename replaces it
        os.replace(partial, out)
    except BaseException as exc:  # written whole or not at all: a failed write (a full disk) leaves nothing
        code = out_of_room(exc, out)  # before the clean-up frees the space
        shutil.rmtree(partial, ignore_errors=True)
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
        if isinstance(exc, OSError) or _a_write(exc) or code is not None:
            raise write_failure(exc, out, code, sum(nbytes.values())) from None
        raise
    return [out / CONFIG, *(out / name for name in files)]


def _a_write(exc: BaseException) -> bool:
    """safetensors' own error type for a write that failed (a RuntimeError-like without an errno)."""
    return type(exc).__name__ == "SafetensorError"


def _groups(nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Consecutive weights, a new file whenever the next one would take it past max_bytes (save_pretrained's
    rule, per hpctrain weight: a fused qkv's q, k and v stay in one file; one larger than max_bytes gets a file of
    its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, n in nbytes.items():
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


# ---------------------------------------------------------------- import


class HFWeights(Mapping[str, torch.Tensor]):
    """An HF directory's tensors by canonical name, read on access from the memory-mapped safetensors file(s)."""

    def __init__(self, path: Path, m: ModelConfig) -> None:
        from safetensors import safe_open

        index = path / INDEX
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / WEIGHTS).exists():
            files = [WEIGHTS]
        else:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
            raise FileNotFoundError(
                f"no {WEIGHTS} or {INDEX} in {path}"
                + (
                    f" (found {', '.join(pickles)}: pickles are never read, "
                    "they can run code; convert them once, where you trust them, with transformers: "
                    "AutoModelForCausalLM.from_pretrained(...).save_pretrained(OUT, safe_serialization=True))"
                    if pickles
                    else ""
                )
            )
        self._files = {f: safe_open(str(path / f), framework="pt", device="cpu") for f in files}
        self._where = {canonical_name(k, m): (f, k) for f, handle in self._files.items() for k in handle.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        file, key = self._where[name]
        return self._files[file].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._files[f].get_slice(k).get_shape()) for name, (f, k) in self._where.items()}


def open_hf(path: str | Path, m: ModelConfig) -> tuple[HFWeights, bool]:
    """The weights of an HF model directory, checked against the run's model config (HFMismatch naming each
    difference and the fix), and whether its head is tied to the embedding."""
    path = Path(path).expanduser()
    config_file = path / CONFIG
    if not config_file.exists():
        raise FileNotFoundError(
            f"model.init_from={path}: no {CONFIG} there (a Hugging Face model directory, as "
            "save_pretrained or `tools/checkpoint.py export RUN --format hf OUT` writes it, "
            "holds one)"
        )
    hf = json.loads(config_file.read_text())
    try:
        differ = mismatches(m, hf)
    except HFMismatch as err:  # a model hpctrain has no architecture for
        raise HFMismatch(f"model.init_from={path}: {err}") from None
    if differ:
        rows = "\n".join(
            f"  {key}: the run's config has {ours!r}, {config_file} has {theirs!r}" for key, ours, theirs in differ
        )
        sets = " ".join(f"{key}={theirs}" for key, _, theirs in differ if theirs is not None)
        raise HFMismatch(
            f"model.init_from={path} does not match the run's model config (model={m.name}):\n{rows}\n"
            f"Fix: set {sets} (or pick the model config of this checkpoint), or point "
            "model.init_from at a model of this config's shape"
        )
    tied = bool(hf.get("tie_word_embeddings", family_of(m).hf.tied_default))
    weights = HFWeights(path, m)
    problems = check_hf_shapes(weights.shapes(), m, str(path), tied)
    if problems:
        raise HFMismatch(
            f"model.init_from={path}: its weights do not match the run's model config (model={m.name})"
            f" although config.json does:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... {len(problems) - 20} more" if len(problems) > 20 else "")
            + "\nFix: re-export or re-download the directory; its config.json and weights disagree"
        )
    return weights, tied


@torch.no_grad()
def load_hf(parts: Sequence[nn.Module], path: str | Path, m: ModelConfig) -> None:
    """Load an HF model directory into the model parts of an engine, whatever the layout.

    Each part takes the tensors it holds (a pipeline stage its own layers): each is read whole from the
    memory-mapped file, converted, padded to the part's vocabulary rows, cut locally to this rank's shard (no
    communication: every rank reads the same files) and copied in, one tensor at a time, so a rank never holds
    more than one full tensor beyond its model. Every tensor of the part is loaded (the names come from it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor, distribute_tensor

    weights, tied = open_hf(path, m)
    known = recipes(m)
    for part in parts:
        own: dict[str, Any] = get_model_state_dict(part)  # this rank's shards, by the model's own names (no wrappers)
        unknown = [k for k in own if k not in known]
        if unknown:
            raise HFMismatch(
                f"the model holds {unknown[:5]}, which no Hugging Face {family_of(m).name} weight converts to"
            )
        rows = next((own[k].shape[0] for k in VOCAB_ROWS if k in own), None)  # this layout's padded vocabulary
        for name, full in iter_from_hf(weights, m, rows, list(own), tied):
            target = own[name]
            full = full.to(device=target.device, dtype=target.dtype)
            value = (
                distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                if isinstance(target, DTensor)
                else full
            )
            # One tensor per call: a DTensor's shard may be a view of the full tensor, freed only after the copy.
            set_model_state_dict(part, {name: value}, options=StateDictOptions(strict=False))
    log.info("loaded the Hugging Face model in %s", path)
