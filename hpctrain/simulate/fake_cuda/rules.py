"""The GPU's rules, checked on fake CUDA: a dispatch mode that fails a step where the same step on GPUs with NCCL
would crash, race or stall, naming the rule, the op and the code that issued it (docs/gpu_path.md).

- devices: a CPU tensor and a CUDA tensor in one op (a 0-d CPU tensor is a scalar and allowed, as CUDA kernels
  allow it); a CPU tensor handed to a collective of a would-be NCCL group (every group but those made with
  backend="gloo").
- asynchronous copies: a `non_blocking` device-to-host copy returns before its data lands; the host reading the
  result before a synchronisation (an event, stream or device sync, or a blocking copy or `.item()`) reads
  whatever the buffer held (`pending` follows the result through views).
- host syncs: every op that stops the host until the GPU's queue drains: `.item()`/`.tolist()`/`.cpu()` (a
  blocking device-to-host copy or `_local_scalar_dense`), the data-dependent shapes (`nonzero`, boolean indexing,
  `masked_select`, `unique`...), torch.cuda's synchronisations. Counted in `syncs`; a data-dependent shape is
  refused outright (it cannot run on fake tensors, and a training step needs none).
- threads: a device group's collective from a thread that is neither the main thread nor autograd's device
  thread (backward on a GPU runs there, and FSDP2's, TP's and EP's collectives with it).
"""

from __future__ import annotations

import threading
import traceback
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hpctrain.simulate.fake_cuda import runtime

aten = torch.ops.aten
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
COPIES = (aten._to_copy.default, aten.copy_.default)
PYTHON_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
)
METADATA = (
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_pinned.default,
    aten._pin_memory.default,
)


class GpuRuleViolation(RuntimeError):
    """What a GPU would do wrong with this step: the rule, the op, where it was issued and the fix."""


PLUMBING = (
    "/simulate/fake_cuda/",
    "/simulate/memory.py",
    "/simulate/collectives.py",
    "/torch/_ops.py",
    "/torch/_compile.py",
    "/torch/_dynamo/",
    "/torch/utils/_python_dispatch.py",
    "/torch/autograd/profiler.py",
    "/torch/distributed/_tools/",
    "/torch/_subclasses/",
    "/torch/utils/_stats.py",
    "/torch/_tensor.py",
    "/contextlib.py",
)


def where(frames: int = 6) -> str:
    """The innermost frames that issued the current op, past this module's, the simulator's and torch's dispatch
    plumbing."""
    stack = [f for f in traceback.extract_stack()[:-1] if not any(part in f.filename for part in PLUMBING)]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-frames:]))


def _short(filename: str) -> str:
    for root in ("/hpctrain/", "/torch/"):
        if root in filename:
            return root.strip("/") + "/" + filename.rsplit(root, 1)[1]
    return Path(filename).name


def _thread() -> str:
    if threading.current_thread() is threading.main_thread():
        return "main"
    return "autograd" if torch._C._current_graph_task_id() != -1 else threading.current_thread().name


class GpuRules(TorchDispatchMode):
    """Enter inside the FakeTensorMode (`with mode, GpuRules():`) so it sees every op first."""

    def __init__(self, gloo_groups: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.gloo_groups = gloo_groups
        self.pending: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self.syncs: list[str] = []
        self.collectives: Counter[tuple[str, str]] = Counter()  # (op, thread: main / autograd / other)
        self._calls_seen = len(runtime.CALLS)
        self._lock = threading.Lock()  # backward's device thread dispatches too

    def __enter__(self) -> GpuRules:
        """Also watch torch.distributed's Python API: a thread this mode is not entered on (one the code started
        itself) dispatches below it, and its collectives would go unseen."""
        self._originals = {name: getattr(dist, name) for name in PYTHON_COLLECTIVES if hasattr(dist, name)}
        for name, original in self._originals.items():
            setattr(dist, name, self._watched(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        super().__exit__(*exc)

    def _watched(self, name: str, original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            thread = _thread()
            group = kwargs.get("group")
            if thread not in ("main", "autograd") and _group_name((group,)) not in self.gloo_groups:
                raise GpuRuleViolation(_other_thread(name, group, thread))
            return original(*args, **kwargs)

        return collective

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with self._lock:
            self._cuda_syncs()
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func.namespace in COLLECTIVE_NAMESPACES and not func.__name__.startswith("wait"):
                self._collective(func, args, tensors)
            elif func.namespace != "prim" and func not in METADATA and not getattr(func, "is_view", False):
                self._reads(func, tensors, kwargs)
            if torch.Tag.data_dependent_output in func.tags:
                self._sync(f"{func} (a host read)")
            if torch.Tag.dynamic_output_shape in func.tags and _data_dependent(func, args, kwargs):
                raise GpuRuleViolation(
                    f"GPU rule (host sync): {func} has a data-dependent output shape, so the host waits for the "
                    f"GPU to learn it, every call, at {where()}. Fix: keep shapes static (sort and pad, or pass "
                    "output_size), as the MoE's capacity path does"
                )
        try:
            out = func(*args, **kwargs)
        except FakeTensorDeviceMismatchError as exc:
            raise GpuRuleViolation(
                f"GPU rule (one device per op): {func} mixes CPU and CUDA tensors at {where()}: {exc}. Fix: move "
                "the CPU tensor to the device first (or keep the work on one side)"
            ) from None
        if func in COPIES:
            with self._lock:
                self._copy(func, args, kwargs, out)
        elif getattr(func, "is_view", False) and isinstance(out, torch.Tensor):
            with self._lock:  # a view of an unlanded copy is unlanded too
                source = next((t for t in tensors if id(t) in self.pending), None)
                if source is not None:
                    self.pending[id(out)] = (weakref.ref(out), self.pending[id(source)][1])
        return out

    # ---- the rules --------------------------------------------------------------------------------------

    def _cuda_syncs(self) -> None:
        new = runtime.CALLS[self._calls_seen :]
        self._calls_seen = len(runtime.CALLS)
        for call in new:
            if call in runtime.SYNCS:
                self._sync(f"torch.cuda {call}")

    def _sync(self, what: str) -> None:
        self.syncs.append(f"{what} at {where()}")
        self.pending.clear()

    def _reads(self, func: Any, tensors: list[torch.Tensor], kwargs: dict) -> None:
        for t in tensors:
            entry = self.pending.get(id(t))
            if entry is None or entry[0]() is not t:
                continue
            to_device = func is aten._to_copy.default and getattr(kwargs.get("device"), "type", None) == "cuda"
            if to_device or (func is aten.copy_.default and tensors[0].device.type == "cuda"):
                continue  # copied back to the device: ordered after the copy on its stream
            raise GpuRuleViolation(
                f"GPU rule (asynchronous copy read too early): {func} at {where()} reads the result of a "
                f"non_blocking device-to-host copy ({entry[1]}) before any synchronisation: on a GPU the copy may "
                "not have landed, and the host reads stale memory. Fix: read the value after the step's host sync "
                "(or copy with non_blocking=False)"
            )

    def _copy(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        source = args[1] if func is aten.copy_.default else args[0]
        target = args[0] if func is aten.copy_.default else out
        if not (isinstance(target, torch.Tensor) and source.device.type == "cuda" and target.device.type == "cpu"):
            return
        blocking = not (args[2] if func is aten.copy_.default and len(args) > 2 else kwargs.get("non_blocking"))
        if blocking:
            self._sync(f"{func} (a blocking device-to-host copy)")
        else:
            self.pending[id(target)] = (weakref.ref(target), f"made at {where()}")

    def _collective(self, func: Any, args: tuple, tensors: list[torch.Tensor]) -> None:
        op = func.__name__.split(".")[0]
        thread = _thread()
        self.collectives[(op, thread)] += 1
        group = _group_name(args)
        if group in self.gloo_groups:
            return
        if thread not in ("main", "autograd"):
            raise GpuRuleViolation(_other_thread(op, group, thread))
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if cpu:
            raise GpuRuleViolation(
                f"GPU rule (CPU tensor on an NCCL group): {op} on group {group} gets a CPU tensor "
                f"{tuple(cpu[0].shape)} {cpu[0].dtype} at {where()}; NCCL takes device tensors only. Fix: move it "
                "to the device first, or use a group made with backend='gloo'"
            )


def _other_thread(op: str, group: Any, thread: str) -> str:
    return (
        f"GPU rule (one thread per device group): {op} on group {group} from thread {thread!r} at {where()}. "
        "NCCL needs a communicator's collectives in one order on every rank; only the main thread and "
        "autograd's device thread (backward) issue them. Fix: give background work a group made with "
        "backend='gloo'"
    )


def _group_name(args: tuple) -> str | None:
    for arg in args:
        if isinstance(arg, str):
            return arg
        if isinstance(arg, dist.ProcessGroup):
            return arg.group_name
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in arg._type().qualified_name():
            return dist.ProcessGroup.unbox(arg).group_name
    return None


def _data_dependent(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    if func.__name__.startswith("repeat_interleave"):
        return kwargs.get("output_size") is None
    return True


def gloo_group_names() -> frozenset[str]:
    """The groups of this world made with backend="gloo" (background work may use them from any thread)."""
    c10d = dist.distributed_c10d
    names = set()
    for group, name in c10d._world.pg_names.items():
        backend = c10d._world.pg_map.get(group, (None,))[0]
        if str(backend).lower() == "gloo":
            names.add(name)
    return frozenset(names)
