"""Build the fake-CUDA library (guard.cpp) with g++ against the installed torch, once per torch and source.

The library links the wheel's own libc10 and libtorch_cpu with its headers, so it is built where it runs, for the
torch it runs with: cached under `<cache>/fake_cuda/<torch version>-<source hash>/`, where <cache> is
$HPCTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/hpctrain, else ~/.cache/hpctrain. Nothing here imports torch: the
process that loads the library must not have imported it yet."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("guard.cpp")
LIBRARY = "libhpctrain_fake_cuda.so"


class Unavailable(RuntimeError):
    """Fake CUDA cannot run here; the message says why (no g++, no torch headers, a CUDA build of torch...)."""


def torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("torch is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir() -> Path:
    if os.environ.get("HPCTRAIN_CACHE_DIR"):
        return Path(os.environ["HPCTRAIN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpctrain"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def library_path() -> Path:
    """Where the library for this torch and this source lives (built or not)."""
    version = importlib.metadata.version("torch")
    key = hashlib.sha256(SOURCE.read_bytes() + str(torch_dir()).encode()).hexdigest()[:12]
    return cache_dir() / "fake_cuda" / f"{version}-{key}" / LIBRARY


def build() -> Path:
    """The library's path, built first if the cache lacks it (about 3 s with g++ on 2 cores)."""
    path = library_path()
    if path.is_file():
        return path
    cxx = compiler()
    if cxx is None:
        raise Unavailable("no C++ compiler (g++) to build the fake-CUDA library: apt-get install g++")
    torch = torch_dir()
    if (torch / "lib" / "libtorch_cuda.so").exists():
        raise Unavailable("this torch is a CUDA build: run on a GPU instead of fake CUDA")
    if not (torch / "include" / "c10").is_dir():
        raise Unavailable(f"torch's C++ headers are missing under {torch / 'include'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / LIBRARY
        command = [
            cxx,
            "-O1",
            "-std=c++17",
            "-shared",
            "-fPIC",
            f"-I{torch / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi(torch)}",
            str(SOURCE),
            "-o",
            str(out),
            f"-L{torch / 'lib'}",
            "-Wl,--no-as-needed",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch / 'lib'}",
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"building the fake-CUDA library failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
        os.replace(out, path)  # atomic: a concurrent build of the same key writes the same file
    return path


def _cxx11_abi(torch: Path) -> int:
    """The wheel's C++ ABI, from its CMake config (a mismatch fails at load with undefined symbols)."""
    config = torch / "share" / "cmake" / "Caffe2" / "Caffe2Targets.cmake"
    if config.is_file() and "_GLIBCXX_USE_CXX11_ABI=0" in config.read_text(errors="replace"):
        return 0
    return 1
