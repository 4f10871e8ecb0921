"""torch.cuda's Python side on fake CUDA: streams, events and device queries as recorded no-ops.

FSDP2, DeviceMesh, DTensor and hpctrain ask torch.cuda for the current device, streams and events; the CPU build
has none of them. Each stand-in appends its name to `CALLS`, so a test sees what a GPU run would have asked of the
CUDA runtime (a synchronisation among them: `SYNCS`). Call `install` once torch is imported, in a process that
loaded the library first (hpctrain.simulate.fake_cuda)."""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

CALLS: list[str] = []
SYNCS = frozenset({"synchronize", "Stream.synchronize", "Event.synchronize"})
TOTAL_MEMORY = 80 * 2**30  # an H100's, for code that sizes itself by the device


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        CALLS.append("Event.record")

    def wait(self, stream: Any = None) -> None:
        CALLS.append("Event.wait")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        CALLS.append("Event.synchronize")

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class Stream:
    """Every stream is one stream: ordering and overlap are what fake CUDA cannot show."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, other: Any) -> None:
        CALLS.append("Stream.wait_stream")

    def wait_event(self, event: Any) -> None:
        CALLS.append("Stream.wait_event")

    def record_event(self, event: Any = None) -> Event:
        CALLS.append("Stream.record_event")
        return event or Event()

    def synchronize(self) -> None:
        CALLS.append("Stream.synchronize")

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


DEFAULT_STREAM = Stream()


def _recorded(name: str, value: Any = None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        CALLS.append(name)
        return value

    return call


def _rng_state(name: str) -> torch.Tensor:
    """A Philox state's size (seed and offset), no values: fork_rng (pipelining's stage set-up) saves and restores."""
    CALLS.append(name)
    return torch.zeros(16, dtype=torch.uint8)


def install(capability: tuple[int, int] = (9, 0), devices: int = 8) -> None:
    """torch.cuda's stream, event and device functions as recorded no-ops; an H100 (compute capability 9.0)."""
    cuda = torch.cuda
    properties = types.SimpleNamespace(
        name="fake CUDA (H100)",
        major=capability[0],
        minor=capability[1],
        total_memory=TOTAL_MEMORY,
        multi_processor_count=132,
        uuid="fake",
    )
    cuda._lazy_init = _recorded("_lazy_init")
    cuda.init = _recorded("init")
    cuda.is_initialized = lambda: True
    cuda.is_available = lambda: True
    cuda.device_count = lambda: devices
    cuda.current_device = _recorded("current_device", 0)
    cuda.set_device = _recorded("set_device")
    cuda.synchronize = _recorded("synchronize")
    cuda.current_stream = _recorded("current_stream", DEFAULT_STREAM)
    cuda.default_stream = _recorded("default_stream", DEFAULT_STREAM)
    cuda.set_stream = _recorded("set_stream")
    cuda.Stream, cuda.Event = Stream, Event  # type: ignore[misc, assignment]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[misc, assignment]
    cuda.get_device_capability = _recorded("get_device_capability", capability)
    cuda.get_device_properties = _recorded("get_device_properties", properties)
    cuda.get_device_name = _recorded("get_device_name", properties.name)
    cuda.is_bf16_supported = lambda *args, **kwargs: True
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, _recorded(name, 0))
    cuda.memory_stats = _recorded("memory_stats", {})
    cuda.reset_peak_memory_stats = _recorded("reset_peak_memory_stats")
    cuda.empty_cache = _recorded("empty_cache")
    cuda.mem_get_info = _recorded("mem_get_info", (TOTAL_MEMORY, TOTAL_MEMORY))
    cuda.manual_seed = cuda.manual_seed_all = _recorded("manual_seed")
    cuda.seed = cuda.seed_all = _recorded("seed")
    cuda.initial_seed = _recorded("initial_seed", 0)
    cuda.get_rng_state = lambda device="cuda": _rng_state("get_rng_state")
    cuda.get_rng_state_all = lambda: [_rng_state("get_rng_state_all")]
    cuda.set_rng_state = _recorded("set_rng_state")
    cuda.set_rng_state_all = _recorded("set_rng_state_all")
    # Fake tensors run small constants (torch.tensor(...)) for real unless the target device cannot be initialised:
    # it cannot, whatever is_available now answers
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.avoid_device_init = property(lambda self: True)  # type: ignore[assignment,method-assign]
    _mesh_outside_fake_mode()
    _fake_pinning()
    _fake_host_buffers()


def _mesh_outside_fake_mode() -> None:
    """DeviceMesh's rank arithmetic is host data (nonzero, cat) that a fake mode cannot run, and FSDP2 slices meshes
    inside fully_shard, which must itself run under the mode on "cuda" (it makes device buffers)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__
    if getattr(init, "__fake_cuda__", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    __init__.__fake_cuda__ = True  # type: ignore[attr-defined]
    DeviceMesh.__init__ = __init__  # type: ignore[method-assign]


PINNED: set[int] = set()


def _fake_pinning() -> None:
    """torch 2.13's fake tensors have no `_pin_memory`: a pinned copy is a new CPU fake tensor, remembered as
    pinned so that `is_pinned` answers as on a GPU host. And `.item()` answers zero (torchao's FP8 weights test a
    tensor's truth when the memory tracker flattens them)."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    aten = torch.ops.aten

    def pin(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        with in_kernel_invocation_manager(fake_mode):
            meta = torch.empty_like(args[0], device="meta")
        out = FakeTensor(fake_mode, meta, torch.device("cpu"))
        PINNED.add(id(out))
        weakref.finalize(out, PINNED.discard, id(out))
        return out

    def is_pinned(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> bool:
        return id(args[0]) in PINNED

    def zero(fake_mode: Any, func: Any, tensor: torch.Tensor) -> Any:
        """`.item()` of a fake tensor: zero of its kind. The values are zeros throughout a simulation (its engine
        reads its step's as zeros); the step's own reads are counted by fake_cuda.rules before they get here."""
        return False if tensor.dtype == torch.bool else 0.0 if tensor.dtype.is_floating_point else 0

    fake_impls.op_implementations_dict[aten._pin_memory.default] = pin
    fake_impls.op_implementations_dict[aten.is_pinned.default] = is_pinned
    fake_impls.op_implementations_dict[aten._local_scalar_dense.default] = zero


def _fake_host_buffers() -> None:
    """`.numpy()` of a fake CPU tensor: a zeroed, page-aligned array of its size, so that host I/O staged through
    fake tensors (NVMe offload's O_DIRECT reads and writes) moves bytes that nobody reads back as values."""
    import numpy as np
    from torch._subclasses.fake_tensor import is_fake

    original = torch.Tensor.numpy
    if getattr(original, "__fake_cuda__", False):
        return

    @functools.wraps(original)
    def numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if is_fake(self):
            nbytes = self.numel() * self.element_size()
            raw = np.zeros(nbytes + 4096, dtype=np.uint8)  # 4 KiB-aligned: O_DIRECT's rule for user buffers
            pad = (-raw.ctypes.data) % 4096
            return raw[pad : pad + nbytes].view(f"u{self.element_size()}").reshape(tuple(self.shape))
        return original(self, *args, **kwargs)

    numpy.__fake_cuda__ = True  # type: ignore[attr-defined]
    torch.Tensor.numpy = numpy  # type: ignore[method-assign, assignment]
