"""What the checks since MoE observe in a step, from outside hpctrain's code: which aten ops ran (a dispatch
mode's op log), how many times the host read device values (a dispatch mode on the CPU; CUDA's own sync debug
mode on a GPU), and small helpers to compare tensors and build one-rank meshes."""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

# aten ops whose result the host must wait for: a value read (`item`, `float()`, `if t:`) or an output whose size
# depends on the values (nonzero, boolean indexing, masked_select, unique). On a GPU each is a full stop of the
# launch queue, which CUDA's sync debug mode reports; on the CPU this list stands in for it.
SYNCING_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "repeat_interleave",
)
SYNC_WARNING = "synchronizing CUDA operation"  # torch's warning text under set_sync_debug_mode("warn")


class OpLog:
    """`with OpLog() as log:` counts every op that runs inside by name (forward and, through autograd's
    thread-local state, backward on the device thread): `log.ops`, e.g. {"aten._grouped_mm": 6, ...}. It can be
    entered again (the counts add up)."""

    def __init__(self) -> None:
        self.ops: dict[str, int] = {}
        self._mode: Any = None

    def __enter__(self) -> OpLog:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                name = str(func.overloadpacket).replace("::", ".").removeprefix("torch.ops.")
                ops[name] = ops.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def count(self, name: str) -> int:
        """Calls of ops whose name ends with `name` ("_grouped_mm": aten._grouped_mm)."""
        return sum(n for op, n in self.ops.items() if op.split(".")[-1] == name or op.endswith(name))

    def ran(self, name: str) -> bool:
        return self.count(name) > 0


def _is_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        getattr(i, "dtype", None) is not None and str(i.dtype) in ("torch.bool", "torch.uint8")
        for i in (indices or ())
        if i is not None
    )


@contextlib.contextmanager
def host_reads(events: list[str]) -> Iterator[None]:
    """Append "<what> at <module>:<line>" to `events` for every read of tensor values by the host inside: the
    syncing aten ops (SYNCING_OPS, boolean indexing), seen by a dispatch mode, and `Tensor.tolist`/`numpy`,
    which copy without an aten op. The CPU's stand-in for CUDA's sync debug mode (tests/gpu_rules.py's
    recording_host_reads does the same for the test suite, without the value-dependent shapes)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def where() -> str:
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename == __file__
            or frame.f_globals.get("__name__", "").startswith(("torch.", "contextlib"))
        ):
            frame = frame.f_back
        return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno}" if frame is not None else "?"

    class _Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name in SYNCING_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
                events.append(f"aten.{name} at {where()}")
            elif name in ("index", "index_put", "index_put_") and _is_bool_index(args):
                events.append(f"aten.{name} (boolean mask) at {where()}")
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def copying(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(f"Tensor.{name} at {where()}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, copying(name, original))
    try:
        with _Reads():
            yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def cuda_sync_warnings(found: list[str]) -> Iterator[None]:
    """Inside, torch.cuda.set_sync_debug_mode("warn"): every synchronizing CUDA call (a device-to-host copy, a
    stream or device synchronize, nonzero...) warns; their messages are appended to `found`."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(w.message).splitlines()[0] for w in caught if SYNC_WARNING in str(w.message))


def max_rel_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (want 0: the absolute error), in float64 on the CPU."""

    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    return err / scale if scale > 0 else err


def one_rank_mesh(device: Any, names: tuple[str, ...]) -> Any:
    """A DeviceMesh of this one-rank world with a dim of size 1 per name, on the device's type (its groups are
    the default group's backends: NCCL for CUDA tensors in a "cpu:gloo,cuda:nccl" world)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, tuple(1 for _ in names), mesh_dim_names=names)


def full_weights(model: Any) -> dict[str, Any]:
    """A model's full weights (DTensors gathered), on the CPU in float64, by parameter name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().double().cpu()
    return out


def grads_of(model: Any) -> dict[str, Any]:
    """A model's gradients (DTensors gathered), on the CPU in float64, by parameter name (None where absent)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            g = (g.full_tensor() if isinstance(g, DTensor) else g).detach().double().cpu()
        out[name] = g
    return out
