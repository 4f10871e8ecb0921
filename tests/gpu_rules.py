"""GPU-rules mode: a CPU run fails, naming the rule, where the same run on GPUs with NCCL would fail.

On the CPU build none of CUDA's or NCCL's rules bite, so code that breaks them passes every CPU test and dies
on its first GPU run. This module makes the CPU run break them loudly instead (docs/gpu_path.md lists the
rules this covers and the ones only `tools/gpu_check.py` on a GPU can see):

- fork: CUDA initialised in a process that later forks. torch then poisons every forked child, whose first
  CUDA call raises "Cannot re-initialize CUDA in forked subprocess". The spies record the first call that
  would initialise CUDA (`torch.cuda.is_available` and `device_count` unless PYTORCH_NVML_BASED_CUDA_CHECK=1,
  `_lazy_init`, `init`, `set_device`, `current_device`, `synchronize`, ...); a child forked after one raises
  GpuRuleViolation at its first call of any spied function, naming where its parent initialised CUDA.
  (Stricter than a GPU by one step: a poisoned child's `is_available` raises too, where on a GPU the same
  code path raises one call later, at `set_device`.)
- threads: a collective on a device group (one that would be NCCL: the default group and every group that
  inherits its backends, the mesh's included) from a thread other than the one that created the default
  group or autograd's device thread. NCCL needs a communicator's collectives issued in one order on every
  rank: the main thread's forward and step, then backward's, which on a GPU runs on autograd's device thread
  (FSDP2's reduce-scatters, TP's and EP's collectives in backward); a thread of the code's own interleaves
  differently per rank and deadlocks. Background work belongs on a group made with backend="gloo". (On CPU,
  backward runs on the calling thread; fake CUDA runs it where a GPU does: hpctrain.simulate.fake_cuda.rules.)
- host syncs: more than one copy of a device value to the host (`item`, `tolist`, `cpu`, `float()`...) from
  hpctrain's own code in one Engine.step. Each is a full stop of the GPU's queue; the control plane's one
  `.tolist()` a step is the budget.
- CPU tensors on a device-only group: a group created as "cuda:gloo" rejects them as NCCL does (the harness's
  `backend=` argument; tests/parallel/test_control_plane.py), and the collective count per step is pinned
  there too.

Turned on by HPCTRAIN_GPU_RULES=1: in ranks of tests.distributed_harness, and through `site_dir()` (a
sitecustomize that installs the rules once torch is imported) in every Python process a test starts, the
command line's submitit tasks, elastic agents and forked workers included.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV = "HPCTRAIN_GPU_RULES"
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"

# torch.cuda functions that initialise CUDA (or need it initialised); the first two only without NVML_CHECK.
QUERIES = ("is_available", "device_count")
INITIALISING = (
    "_lazy_init",
    "init",
    "set_device",
    "current_device",
    "synchronize",
    "get_device_properties",
    "get_device_name",
    "get_device_capability",
    "mem_get_info",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "empty_cache",
    "memory_allocated",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "current_stream",
    "Stream",
    "Event",
)
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "monitored_barrier",
)
FUNCTIONAL = (
    "all_reduce",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
)
HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
SYNCS_PER_STEP = 1


class GpuRuleViolation(RuntimeError):
    """The CPU run did what fails on GPUs; the message names the rule, the place and the fix."""


class _State:
    cuda_initialised_at: str | None = None  # where this process first initialised CUDA
    poisoned_by: str | None = None  # set in a child forked after its parent initialised CUDA
    owner_thread: int | None = None  # the thread that created the default group
    gloo_groups: set[str] = set()  # names of groups made with backend="gloo": background work may use them
    step_frame: Any = None  # the Engine.step whose host syncs step_syncs counts
    step_syncs: list[str] = []
    installed = False


STATE = _State()


def _where(skip: int = 2) -> str:
    frames = traceback.extract_stack()[:-skip]
    own = [f for f in frames if "/hpctrain/" in f.filename or "/tests/" in f.filename] or frames
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(own[-4:]))


# ---- fork after CUDA ------------------------------------------------------------------------------------


def _spy(name: str, original: Callable[..., Any], query: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def spied(*args: Any, **kwargs: Any) -> Any:
        if STATE.poisoned_by is not None:
            raise GpuRuleViolation(
                f"GPU rule (fork after CUDA): torch.cuda.{name} in process {os.getpid()}, forked after its parent "
                f"initialised CUDA ({STATE.poisoned_by}). On a GPU this process's first CUDA call raises "
                "'Cannot re-initialize CUDA in forked subprocess'. Fix: no CUDA call in a process before it forks "
                f"(set {NVML_CHECK}=1 before torch.cuda.is_available/device_count, or ask after the fork)"
            )
        if STATE.cuda_initialised_at is None and not (query and os.environ.get(NVML_CHECK) == "1"):
            STATE.cuda_initialised_at = f"pid {os.getpid()}: torch.cuda.{name} at {_where()}"
        return original(*args, **kwargs)

    spied.__gpu_rules__ = True  # type: ignore[attr-defined]
    return spied


def _after_fork_in_child() -> None:
    STATE.poisoned_by, STATE.cuda_initialised_at = STATE.cuda_initialised_at, None
    STATE.owner_thread = None  # a forked child has one thread; its own group, if any, is made anew


def cuda_initialised_at() -> str | None:
    return STATE.cuda_initialised_at


# ---- collectives from other threads ---------------------------------------------------------------------


def _group_name(group: Any) -> str | None:
    if group is None:
        return None
    return getattr(group, "group_name", None)


def _check_thread(api: str, group: Any) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or STATE.owner_thread in (None, threading.get_ident()):
        return
    import torch

    if torch._C._current_graph_task_id() != -1:  # backward, on autograd's device thread (as on a GPU)
        return
    if isinstance(group, tuple):  # a functional collective's (mesh, dim): a mesh group inherits the default's
        group = None
    name = _group_name(group)
    if name is not None and name in STATE.gloo_groups:
        return
    raise GpuRuleViolation(
        f"GPU rule (one thread per device group): {api} on {'the default group' if name is None else 'group ' + name} "
        f"from thread {threading.current_thread().name!r}, not the thread that owns it. On GPUs that group is "
        "NCCL, and collectives issued from two threads on one communicator interleave differently per rank and "
        f"deadlock. Fix: give the background work a group of its own, dist.new_group(backend='gloo') (at {_where()})"
    )


def _watch_collective(module: Any, name: str, functional: bool, aliases: tuple[Any, ...] = ()) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "__gpu_rules__", False):
        return
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return
    key = (
        "group"
        if "group" in signature.parameters
        else "process_group"
        if "process_group" in signature.parameters
        else None
    )
    api = f"{'funcol.' if functional else 'dist.'}{name}"

    @functools.wraps(original)
    def watched(*args: Any, **kwargs: Any) -> Any:
        group = None
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            group = ops[0].group if ops else None
        elif key is not None:
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get(key)
            except TypeError:
                group = kwargs.get(key)
        _check_thread(api, group)
        return original(*args, **kwargs)

    watched.__gpu_rules__ = True  # type: ignore[attr-defined]
    for owner in (module, *aliases):  # one object everywhere: torch compares ops by identity (P2POp's isend)
        if getattr(owner, name, None) is original:
            setattr(owner, name, watched)


def _watch_groups(dist: Any) -> None:
    c10d = dist.distributed_c10d
    init, new_group = c10d.init_process_group, c10d.new_group

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        STATE.owner_thread = threading.get_ident()
        STATE.gloo_groups.clear()
        return init(*args, **kwargs)

    @functools.wraps(new_group)
    def made_group(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "gloo" and _group_name(group):
            STATE.gloo_groups.add(_group_name(group))
        return group

    for module in (dist, c10d):
        module.init_process_group, module.new_group = init_process_group, made_group


# ---- host syncs per step --------------------------------------------------------------------------------


def _engine_step_frame(frame: Any) -> Any:
    """The frame of the Engine.step this call runs in, if any."""
    while frame is not None:
        if frame.f_code.co_name == "step" and frame.f_globals.get("__name__") == "hpctrain.parallel.engine":
            return frame
        frame = frame.f_back
    return None


# An MoE layer's reads of its routing's sizes, one per layer forward where it needs them: expert parallelism's
# all-to-all split sizes (host lists), and the per-expert loop where no grouped GEMM serves (CPU; not on H100/B200
# in bf16). A GPU run pays them as torchtitan's does; tests/parallel/test_host_syncs.py pins their number.
ROUTING_SYNCS = {
    ("hpctrain.models.common.moe", "_dispatch"),
    ("hpctrain.models.common.moe", "run_experts"),
    ("hpctrain.models.common.moe", "_fake_host_read"),
}  # the same reads, made on fake tensors (simulate)


def _count_syncs(torch: Any) -> None:
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)
        if getattr(original, "__gpu_rules__", False):
            continue

        def counted(self: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            routing = (module, caller.f_code.co_name) in ROUTING_SYNCS
            if module.startswith("hpctrain.") and not module.startswith("hpctrain.data.") and not routing:
                step = _engine_step_frame(caller)
                if step is not None:
                    if STATE.step_frame is not step:
                        STATE.step_frame, STATE.step_syncs = step, []
                    STATE.step_syncs.append(f"Tensor.{__name} at {module}:{caller.f_lineno}")
                    if len(STATE.step_syncs) > SYNCS_PER_STEP:
                        raise GpuRuleViolation(
                            f"GPU rule (host syncs per step): {len(STATE.step_syncs)} copies of device values to "
                            f"the host in one Engine.step ({'; '.join(STATE.step_syncs)}); the step's budget is "
                            f"{SYNCS_PER_STEP} (the control plane's one .tolist()). Each stops the GPU's queue: "
                            "fold the value into the step's reduction (hpctrain/train/control.py)"
                        )
            return __original(self, *args, **kwargs)

        counted.__gpu_rules__ = True  # type: ignore[attr-defined]
        setattr(torch.Tensor, name, counted)


@contextlib.contextmanager
def recording_host_reads(events: list[str]) -> Iterator[None]:
    """Append "host read: <what> at <where>" to `events` for every read of a tensor's values by the host while
    inside, from any code, torch's own included (the rule above sees hpctrain's calls only): every
    `aten._local_scalar_dense` (`item`, `float()`, `int()`, `bool()`, `if tensor:`), seen by a dispatch mode
    below every tensor subclass, and `Tensor.tolist`/`numpy`, which copy without an aten op. On a GPU each is
    a stop of the launch queue. Tests pin the count per step (tests/parallel/test_host_syncs.py)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    def where() -> str:  # the code that read, past this recorder's frames and torch's decorators
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename == __file__
            or frame.f_globals.get("__name__", "").startswith(
                ("torch.utils._python_dispatch", "torch._dynamo", "torch._compile", "torch.distributed.c10d_logger")
            )
        ):
            frame = frame.f_back
        return (
            f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno} in {frame.f_code.co_name}"
            if frame is not None
            else "?"
        )

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                events.append(f"host read: {func} at {where()}")
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def copying(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(f"host read: Tensor.{name} at {where()}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, copying(name, original))
    try:
        with Reads():
            yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


# ---- installing -----------------------------------------------------------------------------------------


def install() -> None:
    """Every rule, in this process and (inherited through fork) its children."""
    if STATE.installed:
        return
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    for name in QUERIES + INITIALISING:
        original = getattr(torch.cuda, name, None)
        if original is not None and not getattr(original, "__gpu_rules__", False):
            setattr(torch.cuda, name, _spy(name, original, name in QUERIES))
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _watch_groups(dist)
    for name in COLLECTIVES:
        _watch_collective(dist, name, functional=False, aliases=(dist.distributed_c10d,))
    for name in FUNCTIONAL:
        _watch_collective(funcol, name, functional=True)
    _count_syncs(torch)
    STATE.installed = True


def launched_by_test() -> None:
    """This forked process was started by the test (pytest, standing in for a launcher that execs): CUDA calls
    the test process made before forking do not count against it."""
    STATE.poisoned_by = None


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` has been imported completely (its top-level code has run)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            execute(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, then: Callable[[Any], None]) -> None:
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        then(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def install_on_import() -> None:
    """Install once torch is imported: processes that never import torch (the login side) stay as fast."""
    after_import("torch", lambda _: install())


def site_dir() -> str:
    """A directory whose sitecustomize installs the rules in every Python process that has it on PYTHONPATH."""
    return str(Path(__file__).resolve().parent / "gpu_rules_site")


def environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with the rules on for every Python process started with it (and for the harness's ranks)."""
    repo = str(Path(__file__).resolve().parent.parent)
    paths = [site_dir(), repo, *filter(None, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep))]
    return {**env, ENV: "1", "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
