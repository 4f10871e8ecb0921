"""Reading checkpoints outside a run: list them per tier, verify one, export a consolidated model state.

What a damaged run directory or checkpoint, or a failed write, does to these comes back as a `CheckpointError`
whose message names the file and what is wrong with it (tools/checkpoint.py prints it): never a traceback.
An export is written whole or not at all: a failed one (a full disk...) leaves nothing behind.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hpctrain.bounded import Unreadable, read_text
from hpctrain.checkpoint.integrity import (
    METADATA,
    UnsafeCheckpoint,
    check_files,
    read_metadata,
)
from hpctrain.checkpoint.storage import (
    CORRUPT,
    Committed,
    broken_in,
    committed_in,
    step_of,
    tier_path,
    verify,
)
from hpctrain.records.fingerprint import ModelFingerprint
from hpctrain.records.paths import RunPaths


class CheckpointError(Exception):
    """A run directory, its config or a checkpoint that cannot be used: the message names the file and why."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, cut short, or do not unpickle or match their checksums."""


class ExportFailed(CheckpointError):
    """Writing an export failed (a full disk, a quota, a file size limit, a path that cannot be created); what was
    written of it is removed. `full`: out of space (or of file size)."""

    def __init__(self, message: str, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


def run_tiers(run_dir: Path) -> list[tuple[str, Path]]:
    """The tiers a run was configured with, resolved to directories (from its config.yaml). FileNotFoundError
    when there is no run there; CheckpointError when its config.yaml cannot be read or is not a run's."""
    from omegaconf import OmegaConf

    config = RunPaths(run_dir).config
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"{run_dir} " + ("is not a directory: give a run directory" if run_dir.exists() else "does not exist")
        )
    if not config.exists():
        raise FileNotFoundError(f"{run_dir} is not an hpctrain run directory: it has no {config.name}")
    try:
        cfg = OmegaConf.create(read_text(config))
        return [(str(t.name), tier_path(str(t.path), run_dir, str(cfg.run.id))) for t in cfg.checkpoint.tiers]
    except Unreadable as err:
        raise CheckpointError(f"the run's config cannot be read: {err}") from None
    except Exception as exc:  # noqa: BLE001  (not YAML, not a mapping, no checkpoint.tiers or run.id)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{config} is not an hpctrain run config ({type(exc).__name__}: {first})") from None


def list_checkpoints(run_dir: Path) -> list[Committed]:
    return [c for name, path in run_tiers(run_dir) for c in committed_in(path, name)]


def find(run_dir: Path, step: int | None = None, tier: str | None = None) -> Committed:
    """A committed checkpoint of a run: the newest, or the one at `step` (in `tier` if given)."""
    found = [
        c for c in list_checkpoints(run_dir) if (tier is None or c.tier == tier) and (step is None or c.step == step)
    ]
    if not found:
        raise FileNotFoundError(
            f"no committed checkpoint in {run_dir}"
            + (f" at step {step}" if step else "")
            + (f" in tier {tier}" if tier else "")
        )
    return max(found, key=lambda c: c.step)


def describe(c: Committed, content: bool = False) -> dict[str, Any]:
    """A checkpoint's facts and problems: structural ones (files missing or of the wrong size), and with
    `content` every byte against its CRC32C, naming the records a damaged file holds."""
    m = c.manifest
    problems = verify(c)
    if content:
        damage = check_files(c.path, m)
        problems += [str(d) for d in damage] + (
            _metadata_problems(c.path) if not any(d.file == METADATA for d in damage) else []
        )
    return {
        "tier": c.tier,
        "step": c.step,
        "time": m.get("time"),
        "bytes": sum(m.get("files", {}).values()),
        "world_size": m.get("world_size"),
        "consumed_samples": m.get("consumed_samples"),
        "path": str(c.path),
        "problems": list(dict.fromkeys(problems)),
    }


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
        rows += [
            {"tier": name, "step": step_of(sub), "path": str(sub), "problems": [why]} for sub, why in broken_in(path)
        ]
        rows += [
            {
                "tier": name,
                "step": step_of(sub),
                "path": str(sub),
                "problems": ["quarantined: a resume found it damaged"],
            }
            for sub in sorted(path.glob(f"*{CORRUPT}"))
        ]
    return rows


MODEL_PREFIX = "train.model."  # where a checkpoint holds the model's weights (the engine's state under "train")


def model_tensors(c: Committed) -> dict[str, Any]:
    """A checkpoint's model weights as empty tensors on the meta device, by name, with their whole shapes and
    dtypes, whatever layout saved them and whatever the model's architecture (from the checkpoint's own
    metadata); the vocabulary-row tensors cut to the tokenizer's vocabulary: TP padding is not part of the model."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hpctrain.models.hf import VOCAB_ROWS

    try:
        vocab = ModelFingerprint.from_value(c.manifest["fingerprint"]["model"]).dims.vocab_size
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedCheckpoint(
            f"{c.path / 'manifest.json'} has no usable model fingerprint ({type(exc).__name__}: {exc})"
        ) from None
    out = {}
    for key, item in _metadata(c).state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(item, TensorStorageMetadata):
            name, size = key[len(MODEL_PREFIX) :], list(item.size)
            if name in VOCAB_ROWS:
                size[0] = vocab
            out[name] = torch.empty(size, dtype=item.properties.dtype, device="meta")
    return dict(sorted(out.items()))


def _metadata(c: Committed) -> Any:
    """The checkpoint's DCP metadata; DamagedCheckpoint, naming the file, when `.metadata` is missing, empty, or
    not a pickle of DCP's metadata (UnsafeCheckpoint for one that asks for more: crafted)."""
    from hpctrain.checkpoint.reader import FastReader

    path = c.path / METADATA
    try:
        return FastReader(str(c.path)).read_metadata()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} is missing: the checkpoint cannot be read") from None
    except Exception as exc:  # noqa: BLE001  (a pickle that is not one fails in many ways)
        size = path.stat().st_size if path.is_file() else 0
        what = "is empty (0 bytes)" if size == 0 else f"({size} bytes) is not DCP metadata"
        raise DamagedCheckpoint(
            f"{path} {what}: the checkpoint cannot be read ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def check_readable(c: Committed) -> None:
    """Before an export: the checkpoint's files as its manifest lists them (present, of their sizes) and a
    `.metadata` that loads; DamagedCheckpoint naming what is not. (`verify` checks every byte.)"""
    problems = verify(c)
    if problems:
        raise DamagedCheckpoint(
            f"the checkpoint {c.path} (tier {c.tier}, step {c.step}) is damaged: "
            + "; ".join(problems)
            + " (tools/checkpoint.py verify says more; --step exports "
            "another)"
        )
    _metadata(c)


def consolidated_model(c: Committed, names: list[str] | None = None) -> dict[str, Any]:
    """A checkpoint's model weights (`names` of them, all when None), whole, read from any layout (DCP reshards),
    shaped as `model_tensors` says."""
    import torch

    from hpctrain.checkpoint.reader import CorruptCheckpoint
    from hpctrain.checkpoint.reshard import load_state

    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model_tensors(c).items() if names is None or k in names}
    try:
        load_state({"train": {"model": state}}, str(c.path), None, no_dist=True)
    except CorruptCheckpoint as err:
        raise DamagedCheckpoint(f"the checkpoint {c.path} is damaged: {err}") from None
    return state


def export_model(c: Committed, out: Path) -> list[Path]:
    """Consolidate the model weights into one file, torch.save's and safetensors' (the latter loads without
    unpickling anything). Both are written under temporary names and renamed into place: a failed write (a full
    disk) raises ExportFailed and leaves neither."""
    import torch
    from safetensors.torch import save_file

    safe = out.with_suffix(".safetensors")
    if out.is_dir() or safe.is_dir():
        raise ExportFailed(
            f"{out if out.is_dir() else safe} is a directory: give the export a file name "
            f"({out / 'model.pt'}), or use --format hf for a model directory"
        )
    state = consolidated_model(c)
    made = make_parents(out)
    temps = [out.with_name(f".{out.name}.partial"), safe.with_name(f".{safe.name}.partial")]
    try:
        with open(temps[0], "wb") as f:  # a Python file: a failed write raises with its errno (ENOSPC...)
            torch.save(state, f)
        save_file({k: v.contiguous() for k, v in state.items()}, str(temps[1]), metadata={"step": str(c.step)})
        like_a_normal_file(temps[1], temps[0])
        os.replace(temps[0], out)
        os.replace(temps[1], safe)
    except BaseException as exc:
        code = out_of_room(exc, out)  # before the clean-up frees the space
        for temp in temps:
            temp.unlink(missing_ok=True)
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)
        if isinstance(exc, Exception):
            raise write_failure(exc, out, code, 2 * sum(v.numel() * v.element_size() for v in state.values())) from None
        raise
    return [out, safe]


def make_parents(out: Path) -> list[Path]:
    """Create `out`'s missing parent directories; the outermost created (empty when none), for a failed export to
    remove. ExportFailed when one cannot be created (a file in the way, no permission, a full disk)."""
    missing = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        for directory in missing[-1:]:
            shutil.rmtree(directory, ignore_errors=True)
        blocker = next((p for p in [out.parent, *out.parent.parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise ExportFailed(f"cannot create {out.parent}: {blocker} is a file, not a directory") from None
        raise write_failure(exc, out, out_of_room(exc, out)) from None
    return missing[-1:]


# A write that failed for want of room: the errno in the exception or its chain, else these words of it.
_FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "a file is larger than this process may write",
}
_FULL_WORDS = (
    (r"No space left on device|os error 28", errno.ENOSPC),
    (r"Disk quota exceeded|os error 122", errno.EDQUOT),
    (r"File too large|os error 27", errno.EFBIG),
)


def out_of_room(exc: BaseException, out: Path) -> int | None:
    """The errno (ENOSPC, EDQUOT, EFBIG) when writing `out` failed for want of room: from the exception or its
    chain, else from its words; for torch's own writer, which says only "unexpected pos", from the file system
    having no byte free (so call it before the partial files are removed)."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    code = next((x.errno for x in chain if isinstance(x, OSError) and x.errno in _FULL), None)
    if code is None:
        text = " ".join(str(x) for x in chain)
        code = next((c for words, c in _FULL_WORDS if re.search(words, text)), None)
    if code is None and isinstance(exc, RuntimeError) and _free_bytes(_existing(out)) == 0:
        code = errno.ENOSPC
    return code


def write_failure(exc: BaseException, out: Path, code: int | None, needed: int | None = None) -> ExportFailed:
    """Why writing `out` failed, in words that say where: out of room (`code`, from `out_of_room`): the file
    system holding it, what is free there now (the partial export removed) and what the export needs; or the
    system's own reason."""
    if code == errno.EFBIG:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = f"ulimit -f allows {_size(soft)}" if soft != resource.RLIM_INFINITY else "the file system's limit"
        return ExportFailed(
            f"writing {out} failed: {_FULL[code]}: {limit}; the partial export was removed. Raise "
            "the limit (ulimit -f unlimited), or export to another file system",
            full=True,
        )
    if code is not None:
        where = _existing(out).resolve()
        room = ""
        try:
            st = os.statvfs(where)
            room = f": {_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)}"
        except OSError:
            pass
        need = f", the export needs about {_size(needed)}" if needed else ""
        return ExportFailed(
            f"writing {out} failed: {_FULL[code]} on the file system of {where}{room}{need}; the "
            "partial export was removed. Free space there, or export to another disk",
            full=True,
        )
    chain = [exc, exc.__cause__ or exc.__context__]
    oserror = next((x for x in chain if isinstance(x, OSError)), None)
    reason = (oserror.strerror or str(oserror)) if oserror is not None else f"{type(exc).__name__}: {exc}"
    return ExportFailed(f"writing {out} failed: {reason}; the partial export was removed")


def _existing(path: Path) -> Path:
    """The nearest directory at or above `path`'s parent that exists."""
    return next((p for p in [path.parent, *path.parent.parents] if p.is_dir()), Path("/"))


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def like_a_normal_file(path: Path, normal: Path) -> None:
    """Give `path` the permissions of `normal`, a file created the ordinary way beside it (0644 under the usual
    umask): safetensors' save_file creates its file 0600, whatever the umask."""
    os.chmod(path, normal.stat().st_mode & 0o777)
