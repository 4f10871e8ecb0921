"""Fake CUDA: the GPU path of hpctrain executed on a CPU-only torch build, on tensors that say "cuda".

No GPU is lent to most sessions, and code that runs only on GPUs (streams, device threads, asynchronous copies,
NCCL's device-only groups) would otherwise be run first by a user. Here the CPU build of torch accepts
`device="cuda"` FakeTensors (shapes, dtypes, no storage, no kernels) forward and backward:

- `guard.cpp`, built with g++ against the installed torch (`build.py`, cached per torch version) and loaded BEFORE
  torch is imported (`load`), registers a CUDA device guard and ATen's CUDA hooks: autograd records graphs over
  "cuda" tensors and runs their backward on a device thread of its own, as on a GPU.
- `runtime.install` (after torch is imported) stands in for `torch.cuda`'s streams, events and device queries,
  recording each call (`runtime.CALLS`), and for pinned memory, which fake tensors lack.
- `rules.GpuRules` is a dispatch mode that fails a run where a GPU would go wrong (docs/gpu_path.md).
- `attention.GpuAttention` routes SDPA to the fused kernel a GPU would pick, whose meta functions then say what it
  saves for backward.

Keep it out of ordinary processes: once loaded, ATen answers that CUDA is the accelerator. `run_module` starts a
process of its own with the library loaded first.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hpctrain.simulate.fake_cuda.build import Unavailable, build

__all__ = ["Unavailable", "build", "load", "loaded", "run_module", "unavailable_reason"]

_LOADED: list[ctypes.CDLL] = []


def unavailable_reason() -> str | None:
    """None where fake CUDA can run here (building the library if need be), else why not."""
    try:
        build()
    except Unavailable as exc:
        return str(exc)
    return None


def load() -> None:
    """Load the library into this process, which must not have imported torch yet."""
    if _LOADED:
        return
    if "torch" in sys.modules:
        raise Unavailable("fake CUDA must be loaded before torch is imported (ATen reads its CUDA hooks then)")
    _LOADED.append(ctypes.CDLL(str(build()), mode=ctypes.RTLD_GLOBAL))


def loaded() -> bool:
    return bool(_LOADED)


BOOT = (
    "import sys; from hpctrain.simulate import fake_cuda; fake_cuda.load(); import importlib; "
    "sys.argv = sys.argv[1:]; importlib.import_module(sys.argv[0]).main()"
)


def command(module: str, args: Sequence[str] = ()) -> list[str]:
    """The command line that runs `module.main()` in a new Python with fake CUDA loaded before torch."""
    return [sys.executable, "-c", BOOT, module, *args]


def run_module(
    module: str, args: Sequence[str] = (), timeout: float | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `module.main()` (argv: `args`) under fake CUDA in a process of its own, from this checkout."""
    build()
    root = str(Path(__file__).resolve().parents[3])
    environ = dict(os.environ if env is None else env)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, (root, environ.get("PYTHONPATH"))))
    return subprocess.run(command(module, args), capture_output=True, text=True, timeout=timeout, env=environ)
