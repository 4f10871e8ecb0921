"""Token sources: a flat array of token ids, memory-mapped.

- text_bytes: the Python standard library's own .py sources as bytes (vocabulary 256). Real text that
  exists on every machine, so the CPU default needs no download. Built once into a cached file.
- tokens: a pre-tokenised flat .bin of uint16/uint32 (nanoGPT / Megatron style).
- synthetic: random tokens, generated per sample (see sampler), for throughput runs.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import numpy as np

from hpctrain.config.schema import DataConfig, DataKind


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in a fixed order (tests excluded: they hold odd encodings). Installed
    packages (site-packages, often inside the library's directory) are never walked into."""
    files = []
    for directory, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "test")]
        files += [Path(directory, n) for n in names if n.endswith(".py")]
    return sorted(files)


def default_cache_dir() -> Path:
    return Path(os.environ.get("HPCTRAIN_CACHE", Path.home() / ".cache" / "hpctrain"))


def build_text_bytes(max_bytes: int, cache_dir: Path | None = None) -> Path:
    """Write the corpus once; concurrent tasks race safely (write to a temp name, then rename). The cache key
    names the interpreter's exact version and its standard library's place, not the files in it: listing
    them walks the whole library (0.6 s), which every restarted worker would pay again."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    identity = f"{platform.python_version()}:{sysconfig.get_paths()['stdlib']}:{max_bytes}"
    target = cache_dir / f"text_bytes-{hashlib.sha1(identity.encode()).hexdigest()[:12]}.bin"
    if target.exists():
        return target
    files = stdlib_sources()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    written = 0
    with open(tmp, "wb") as out:
        for path in files:
            data = path.read_bytes()[: max_bytes - written]
            out.write(data)
            written += len(data)
            if written >= max_bytes:
                break
            out.write(b"\n\n")
            written += 2
    os.replace(tmp, target)
    return target


def open_tokens(data_cfg: DataConfig) -> np.ndarray | None:
    """The token array for a data config (None for synthetic data, which has no file)."""
    if data_cfg.kind == DataKind.synthetic:
        return None
    if data_cfg.kind == DataKind.text_bytes:
        path = build_text_bytes(data_cfg.max_bytes, Path(data_cfg.path) if data_cfg.path else None)
        return np.memmap(path, dtype=np.uint8, mode="r")
    assert data_cfg.path is not None  # data=tokens without a path is refused before submission (hpctrain.checks)
    return np.memmap(data_cfg.path, dtype=np.dtype(data_cfg.token_dtype), mode="r")
