"""The collectives one rank issues, counted by operation and group as torch dispatches them.

c10d's ops (what FSDP2, DDP, pipelining and the engine's own all-reduce issue through a ProcessGroup) and the
functional collectives (DTensor's TP) both pass the dispatcher, with the group as an object or by name, so one
dispatch mode sees them all; waits are not collectives and are left out."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")
POINT_TO_POINT = ("send", "recv_", "recv_any_source_")


class CollectiveCounter(TorchDispatchMode):
    """counts[(op, group size)]: every collective dispatched while the mode is on (point-to-point included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, int]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in NAMESPACES and not func.__name__.startswith("wait"):
            self.counts[(func.__name__.split(".")[0], _group_size(args))] += 1
        return func(*args, **(kwargs or {}))

    def on_world(self) -> int:
        """Collectives over every rank of the job (the step's control plane)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return sum(n for (op, size), n in self.counts.items() if size == world and op not in POINT_TO_POINT)

    def summary(self) -> dict[str, int]:
        """'op over N ranks' -> count, most frequent first."""
        return {f"{op} over {size} rank{'s' if size != 1 else ''}": n for (op, size), n in self.counts.most_common()}


def _group_size(args: tuple) -> int:
    """The size of the group a collective runs on: a ProcessGroup argument, or a group name (functional ops)."""
    for arg in args:
        if isinstance(arg, dist.ProcessGroup):
            return arg.size()
        if isinstance(arg, str):
            try:
                return dist.distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(arg)).size()
            except (KeyError, RuntimeError, ValueError):
                continue
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in arg._type().qualified_name():
            return dist.ProcessGroup.unbox(arg).size()  # c10d's ops carry the group boxed
    return 0
