"""torch's own memory accounting of one rank's step, by category, in the planner's five columns.

torch.distributed._tools' MemTracker counts every storage a dispatched op creates (fake tensors have sizes,
so this works on them) and names each by its role; FSDPMemTracker adds FSDP2's roles (sharded and unsharded
parameters and gradients, all-gather and reduce-scatter buffers). Three gaps of torch 2.13's FSDPMemTracker
are filled here, nothing else:
- it follows one root module and one optimizer: a rank with several pipeline stages has a root and an
  optimizer per stage;
- it refuses a root's second forward ("multiple iterative calls"): gradient accumulation and every pipeline
  schedule run several micro-batches per step, so a root's module statistics (which nothing here reads) are
  reset before each of its forwards; the peak snapshot is kept whole;
- the unsharded gradients FSDP2 accumulates in its reduce dtype across micro-batches
  (`FSDPParam.unsharded_accumulated_grad`) are made during backward and would count as temporaries: they are
  named unsharded gradients once their layer's post-backward has made them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._tools import fsdp2_mem_tracker as fsdp_tools
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.utils.weak import WeakIdKeyDictionary

# torch's categories -> the planner's columns (hpctrain.plan.memory.MemoryBreakdown): FSDP2's all-gather and
# reduce-scatter staging are "buffers", apart from the model states, as in the planner (states.py, "Columns");
# "Buffer" is a module's registered buffer (torch's _MemRefType.BUFFER), held like a parameter
COLUMNS = {
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "Buffer": "params",
    "Parameter": "params",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Gradient": "grads",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Other": "activations",
}


class _ColumnPeaks(MemTracker):
    """Also the most each planner column (`column_peaks`) and each of torch's categories (`category_peaks`) held
    at any point of the step: the peak snapshot holds them at the moment of the total's peak, when, say, the
    gradients may be past theirs."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        # torch's own walks every tracked module after every op, for per-module peaks nothing here reads: O(ops x
        # modules), which made a 94-layer MoE step (some 2,000 modules) take tens of minutes. The rank's peak is
        # kept as torch keeps it.
        for dev, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[dev] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snapshot)
        peaks: dict[str, int] = self.__dict__.setdefault("column_peaks", {})
        by_category: dict[str, int] = self.__dict__.setdefault("category_peaks", {})
        for dev, snapshot in self._curr_mem_snap.items():
            if not on(dev, self.__dict__.get("device_type", "cpu")):
                continue
            named = {str(getattr(name, "value", name)): b for name, b in snapshot.items()}
            named.pop("Total", None)
            for column, b in columns(named).items():
                peaks[column] = max(peaks.get(column, 0), b)
            for name, b in named.items():
                by_category[name] = max(by_category.get(name, 0), b)


class _FSDPStepTracker(_ColumnPeaks, fsdp_tools.FSDPMemTracker):
    """FSDPMemTracker over several roots and optimizers, several forwards a step (module docstring)."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        MemTracker.__init__(self)  # FSDPMemTracker's own __init__ takes one FSDP root
        self._root_mod = nn.ModuleList(parts)  # type: ignore[assignment]  # several roots where torch has one
        self._roots = {id(p) for p in parts}
        self._optm = None
        self._optimizers = optimizers
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = fsdp_tools._FSDPState.PRE_FW
        self._ref_class = fsdp_tools._FSDPRefType

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def next_microbatch(*args: Any, **kwargs: Any) -> Any:
            if id(fsdp_mod) in self._roots and not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return next_microbatch

    def _fsdp_param_group_post_backward(self, fsdp_mod: FSDPModule, orig: Any) -> Any:
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def name_accumulated(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else ():
                if param.unsharded_accumulated_grad is not None:
                    self._update_and_maybe_create_winfos(
                        param.unsharded_accumulated_grad, fsdp_tools._FSDPRefType.UNSHARDED_GRAD, update_existing=True
                    )
            return out

        return name_accumulated

    def _instrument_optimizer(self) -> None:
        handles: list[Any] = []
        for optimizer in self._optimizers:
            self._optm = optimizer
            super()._instrument_optimizer()
            assert self._optimizer_hook_handles is not None  # set by the call above
            handles += self._optimizer_hook_handles
        self._optimizer_hook_handles = tuple(handles)


class _StepTracker(_ColumnPeaks):
    """torch's MemTracker (no FSDP2: a plain module or DDP), several forwards of a root a step."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__()
        self._roots = {id(p) for p in parts}
        self.track_external(*parts, *optimizers)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if id(module) in self._roots and not self._mod_tracker.is_bw and module in self.memory_tracking:
            stats = self.memory_tracking[module]  # the next micro-batch: MemTracker's own "used again" case
            stats.input_mem = self._track_inputs_or_outputs(inputs)
            return
        super()._pre_fw_hook(module, inputs)


def step_tracker(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], device_type: str = "cpu"
) -> MemTracker:
    """The tracker for this rank's model parts: FSDP-aware when FSDP2 wraps them, torch's MemTracker otherwise.
    Its columns count `device_type`'s memory: on fake CUDA the GPU's, not the host's (offloaded states, batches)."""
    tracker: MemTracker
    if any(isinstance(m, FSDPModule) for part in parts for m in part.modules()):
        tracker = _FSDPStepTracker(parts, optimizers)
    else:
        tracker = _StepTracker(parts, optimizers)
    tracker.__dict__["device_type"] = device_type
    return tracker


def on(device: Any, device_type: str) -> bool:
    return torch.device(device).type == device_type


def peak_by_category(tracker: MemTracker) -> dict[str, int]:
    """The peak snapshot's bytes by torch's category on the tracker's device, zeros left out."""
    snapshot = tracker.get_tracker_snapshot("peak")
    device_type = tracker.__dict__.get("device_type", "cpu")
    per_device = next((v for dev, v in (snapshot or {}).items() if on(dev, device_type)), {})
    named = {str(getattr(name, "value", name)): int(b) for name, b in per_device.items()}
    return {name: b for name, b in named.items() if name != "Total" and b}


def column_peaks(tracker: MemTracker) -> dict[str, int]:
    """The most each planner column held at any point of the tracked step (params, grads, optimizer, buffers,
    activations): what the planner's columns, each its own worst case, are compared with."""
    return dict(getattr(tracker, "column_peaks", {}))


def category_peaks(tracker: MemTracker) -> dict[str, int]:
    """The most each of torch's categories held at any point of the tracked step (say, "All Gather" in forward
    and "Reduce Scatter" in backward, which the buffers column's own peak does not hold together)."""
    return {name: b for name, b in getattr(tracker, "category_peaks", {}).items() if b}


def columns(categories: dict[str, int]) -> dict[str, int]:
    """torch's categories summed into the planner's columns (params, grads, optimizer, buffers, activations)."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "buffers": 0, "activations": 0}
    for name, b in categories.items():
        out[COLUMNS[name]] += b
    return out
