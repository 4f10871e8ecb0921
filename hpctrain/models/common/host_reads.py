"""Host reads a checkpointed block replays in its recomputation, instead of reading the device again.

An MoE layer reads sizes to the host (expert parallelism's all-to-all split sizes, the expert loop's segment
sizes); they come from the routing, which a recomputation repeats exactly, so the forward's values serve again
instead of a second stop of a GPU's queue. The model records and replays (`record_host_read`,
`replayed_host_read`); hpctrain.parallel.recompute gives each checkpointed block the contexts
(`host_read_contexts`). Here, on the model's side, so that models know nothing of parallelism.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
# The checkpointed forward or recomputation running on this thread: `scope` is (the forward's host reads, an
# iterator over them in a recomputation, None in the forward). Thread-local: on a GPU, recomputation runs on
# autograd's device thread.
_current = threading.local()


class _HostReads:
    """A context over one checkpointed forward (record) or one of its recomputations (replay) of the same
    `values`: torch makes both contexts once per forward, and enters the recomputation's once per recomputation,
    each replaying from the start (a forward can be recomputed more than once: once per backward pass through
    it, as a split backward makes two)."""

    def __init__(self, values: list[Any], replay: bool) -> None:
        self.values, self.replay = values, replay
        self._outer: tuple[list[Any], Any] | None = None

    def __enter__(self) -> None:
        self._outer = getattr(_current, "scope", None)
        _current.scope = (self.values, iter(list(self.values)) if self.replay else None)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        _current.scope = self._outer


def replayed_host_read() -> Any | None:
    """In a checkpointed block's recomputation, what its forward read on the host at this point (in order of
    reading); None elsewhere: the caller reads, and passes the value to `record_host_read`."""
    scope = getattr(_current, "scope", None)
    return next(scope[1], None) if scope is not None and scope[1] is not None else None


def record_host_read(value: T) -> T:
    """`value`, read on the host; in a checkpointed block's forward, kept for its recomputations to replay."""
    scope = getattr(_current, "scope", None)
    if scope is not None and scope[1] is None:
        scope[0].append(value)
    return value


def host_read_contexts() -> tuple[_HostReads, _HostReads]:
    """One forward's record and its recomputations' replay (full recomputation's context_fn)."""
    values: list[Any] = []
    return _HostReads(values, replay=False), _HostReads(values, replay=True)
