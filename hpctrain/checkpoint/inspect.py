"""Reading checkpoints outside a run: list them per tier, verify one, export a consolidated model state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.integrity import METADATA, UnsafeCheckpoint, check_files, read_metadata
from hpctrain.checkpoint.storage import CORRUPT, Committed, broken_in, committed_in, step_of, tier_path, verify
from hpctrain.records.fingerprint import ModelShape
from hpctrain.records.paths import RunPaths


def run_tiers(run_dir: Path) -> list[tuple[str, Path]]:
    """The tiers a run was configured with, resolved to directories (from its config.yaml)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(RunPaths(run_dir).config)
    return [(t.name, tier_path(t.path, run_dir, str(cfg.run.id))) for t in cfg.checkpoint.tiers]


def list_checkpoints(run_dir: Path) -> list[Committed]:
    return [c for name, path in run_tiers(run_dir) for c in committed_in(path, name)]


def find(run_dir: Path, step: int | None = None, tier: str | None = None) -> Committed:
    """A committed checkpoint of a run: the newest, or the one at `step` (in `tier` if given)."""
    found = [c for c in list_checkpoints(run_dir) if (tier is None or c.tier == tier)
             and (step is None or c.step == step)]
    if not found:
        raise FileNotFoundError(f"no committed checkpoint in {run_dir}" + (f" at step {step}" if step else "")
                                + (f" in tier {tier}" if tier else ""))
    return max(found, key=lambda c: c.step)


def describe(c: Committed, content: bool = False) -> dict[str, Any]:
    """A checkpoint's facts and problems: structural ones (files missing or of the wrong size), and with
    `content` every byte against its CRC32C, naming the records a damaged file holds."""
    m = c.manifest
    problems = verify(c)
    if content:
        damage = check_files(c.path, m)
        problems += [str(d) for d in damage] + (
            _metadata_problems(c.path) if not any(d.file == METADATA for d in damage) else [])
    return {"tier": c.tier, "step": c.step, "time": m.get("time"), "bytes": sum(m.get("files", {}).values()),
            "world_size": m.get("world_size"), "consumed_samples": m.get("consumed_samples"),
            "path": str(c.path), "problems": list(dict.fromkeys(problems))}


def _metadata_problems(path: Path) -> list[str]:
    """Why a checkpoint's `.metadata`, whose bytes are those its manifest sums, cannot be loaded: a pickle that
    asks for more than DCP's metadata classes (crafted: its sums updated to match), or one that does not unpickle."""
    if not (path / METADATA).is_file():
        return []  # said by `verify`
    try:
        read_metadata(path / METADATA)
    except UnsafeCheckpoint as err:
        return [f"{METADATA}: {err.reason}"]
    except Exception as err:  # a pickle that is not one fails in many ways
        return [f"{METADATA}: cannot be unpickled ({type(err).__name__}: {err})"]
    return []


def unusable(run_dir: Path) -> list[dict[str, Any]]:
    """Checkpoints no resume will load: a manifest that cannot be trusted, or quarantined by a resume."""
    rows = []
    for name, path in run_tiers(run_dir):
        rows += [{"tier": name, "step": step_of(sub), "path": str(sub), "problems": [why]}
                 for sub, why in broken_in(path)]
        rows += [{"tier": name, "step": step_of(sub), "path": str(sub),
                  "problems": ["quarantined: a resume found it damaged"]} for sub in sorted(path.glob(f"*{CORRUPT}"))]
    return rows


MODEL_PREFIX = "train.model."  # where a checkpoint holds the model's weights (the engine's state under "train")


def model_tensors(c: Committed) -> dict[str, Any]:
    """A checkpoint's model weights as empty tensors on the meta device, by name, with their whole shapes and
    dtypes, whatever layout saved them and whatever the model's architecture (from the checkpoint's own
    metadata); the vocabulary-row tensors cut to the tokenizer's vocabulary: TP padding is not part of the model."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpctrain.checkpoint.reader import FastReader
    from hpctrain.models.hf import VOCAB_ROWS

    vocab = ModelShape.from_value(c.manifest["fingerprint"]["model"]).vocab_size
    out = {}
    for key, item in FastReader(str(c.path)).read_metadata().state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            name, size = key[len(MODEL_PREFIX):], list(item.size)
            if name in VOCAB_ROWS:
                size[0] = vocab
            out[name] = torch.empty(size, dtype=item.properties.dtype, device="meta")
    return dict(sorted(out.items()))


def consolidated_model(c: Committed, names: list[str] | None = None) -> dict[str, Any]:
    """A checkpoint's model weights (`names` of them, all when None), whole, read from any layout (DCP reshards),
    shaped as `model_tensors` says."""
    import torch

    from hpctrain.checkpoint.reshard import load_state

    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model_tensors(c).items()
             if names is None or k in names}
    load_state({"train": {"model": state}}, str(c.path), None, no_dist=True)
    return state


def export_model(c: Committed, out: Path) -> list[Path]:
    """Consolidate the model weights into one file, torch.save's and safetensors' (the latter loads without
    unpickling anything)."""
    import torch
    from safetensors.torch import save_file

    state = consolidated_model(c)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    safe = out.with_suffix(".safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(safe), metadata={"step": str(c.step)})
    like_a_normal_file(safe, out)
    return [out, safe]


def like_a_normal_file(path: Path, normal: Path) -> None:
    """Give `path` the permissions of `normal`, a file created the ordinary way beside it (0644 under the usual
    umask): safetensors' save_file creates its file 0600, whatever the umask."""
    os.chmod(path, normal.stat().st_mode & 0o777)
