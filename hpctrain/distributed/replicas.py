"""Per-step fault tolerance across replica groups (`recovery=replicas`), with torchft.

The job's nodes form `recovery.groups` replica groups; each is a whole copy of the layout (FSDP, TP, PP inside
it, its own torch.distributed world, its own elastic agents), and the groups are the outer data-parallel
dimension. Each step every rank:
1. joins the step's quorum (torchft's Manager asks the lighthouse which groups are alive; a group behind the
   quorum's newest step is healed first: it fetches the state from a live peer over HTTP, rank r from the
   peer group's rank r, and goes on from that step);
2. runs its forward and backward as in any layout, then averages its gradients (its own shard: the groups'
   layouts are identical, so rank r of every group holds the same elements) and its loss across the groups
   of the quorum, on torchft's process group (rank r of every group; rebuilt at each new quorum);
3. votes: the optimizer steps only when every rank of the group saw the quorum's average go through.
A group that fails (a node lost, a rank crashed) drops out of the next quorum, the others take their steps
without it, and its agents restart it (a spare takes a dead node's slot): it heals from a peer and rejoins.
No group waits for a restart, nothing is reloaded from disk, and every group's weights stay equal bit for bit
(every group applies the same averaged gradients to the same state).

Exact by construction: the samples of a step are fixed by the step and the group (`group_slice`): group g
reads [consumed + g * b, consumed + (g + 1) * b) of the step's R * b. A step a group misses trains without its
slice (the step's `participants` say so, the ledger counts the samples left out).

Task side: imported by the worker only in this mode (torchft is imported here, not at the package's top).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hpctrain.config.schema import RecoveryConfig

log = logging.getLogger(__name__)

GROUP_ENV = "HPCTRAIN_REPLICA_GROUP"
GROUPS_ENV = "HPCTRAIN_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
BUCKET_BYTES = 64 << 20  # gradients averaged across groups in buckets of this size: few collectives, bounded copy


@dataclass(frozen=True)
class ReplicaPlace:
    """Where this worker's group sits among the replica groups (set by its node agent)."""

    group: int
    groups: int
    lighthouse: str

    @classmethod
    def from_env(cls) -> ReplicaPlace | None:
        """The agent's word (hpctrain.distributed.elastic); None outside replica groups."""
        if GROUP_ENV not in os.environ:
            return None
        return cls(int(os.environ[GROUP_ENV]), int(os.environ[GROUPS_ENV]), os.environ[LIGHTHOUSE_ENV])


def group_slice(consumed: int, group: int, group_batch: int) -> int:
    """The first sample group `group` reads at a step that starts at `consumed` (the step's samples, every
    group's, begin there; each group reads `group_batch` of them)."""
    return consumed + group * group_batch


@dataclass
class Quorum:
    """What one step's quorum decided, for the metrics: who took part, and whether this group healed."""

    quorum_id: int
    participants: int
    healed_from_step: int | None  # the step this group was at before it healed (None: no heal)
    heal_s: float
    joined_s: float  # the whole quorum call, the heal included


class ReplicaSync:
    """One rank's torchft Manager: the step's quorum, the gradient average across groups, the commit vote.

    `state()` gives what a healing peer needs (the engine's state and the loop's position), `load(state)` sets
    it; both are the loop's (the engine's tensors are sent as their local shards and rebuilt on this rank's
    mesh). The manager's own server runs in group rank 0; its store is the group's (torch.distributed's
    TCPStore at MASTER_ADDR:MASTER_PORT, or one opened here for a one-rank group)."""

    def __init__(
        self,
        recovery: RecoveryConfig,
        place: ReplicaPlace,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: torch.device,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
    ) -> None:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.place, self.device = place, device
        timeout = datetime.timedelta(seconds=recovery.quorum_timeout_s)
        # One rank per group: torch.distributed has no group, hence no store; torchft's manager needs one.
        self._own_store = _serve_store(master_port) if world_size == 1 else None
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._healed_at: float | None = None
        self._load = load

        def load_timed(received: dict[str, Any]) -> None:
            started = time.perf_counter()
            load(received)
            self._healed_at = time.perf_counter() - started

        self.manager = Manager(
            pg=pg,
            load_state_dict=load_timed,
            state_dict=state,
            min_replica_size=recovery.min_replicas,
            use_async_quorum=False,  # a group that heals does so before its forward: it takes part in the step
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=master_addr,
            store_port=master_port,
            lighthouse_addr=place.lighthouse,
            replica_id=f"replica{place.group}",
            init_sync=True,  # the first quorum makes every group start from the same state, whatever it loaded
        )
        self.last: Quorum | None = None

    def set_step(self, step: int) -> None:
        """The step this group resumed at (its checkpoint's): the quorum compares it with the others'."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.place.groups})

    def start_step(self, step: int) -> Quorum:
        """Join this step's quorum; heal from a peer first when this group is behind it."""
        started = time.perf_counter()
        self._healed_at = None
        self.manager.start_quorum()  # synchronous: a heal's state is applied before this returns
        joined = time.perf_counter() - started
        self.last = Quorum(
            quorum_id=self.manager._quorum_id,  # torchft keeps it private; the metrics name each quorum by it
            participants=self.manager.num_participants(),
            healed_from_step=step if self._healed_at is not None else None,
            heal_s=self._healed_at or 0.0,
            joined_s=joined,
        )
        return self.last

    def current_step(self) -> int:
        return int(self.manager.current_step())

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average each tensor's local elements across the quorum's groups, in place (buckets of BUCKET_BYTES
        per dtype: one collective each, on copies). A failure is the manager's to report (the step then does not
        commit), and leaves the tensors as they were: this group's own, to average again with the next quorum."""
        works = []
        for bucket in _buckets([_local(t) for t in tensors]):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            works.append((bucket, flat, self.manager.allreduce(flat)))
        for _, _, work in works:
            work.wait()
        if self.manager.errored():
            return
        for bucket, flat, _ in works:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def requorum(self) -> bool:
        """After a step whose average failed (a group lost in the middle of it): a new quorum for the same step,
        so the gradients this group made can be averaged again without training the step again. False when a
        heal came with it (this group is no longer at that step: the loop must train it anew)."""
        self._healed_at = None
        self.manager.start_quorum()
        self.last = Quorum(
            quorum_id=self.manager._quorum_id,
            participants=self.manager.num_participants(),
            healed_from_step=None,
            heal_s=0.0,
            joined_s=0.0,
        )
        return self._healed_at is None

    def commit(self) -> bool:
        """Whether this step may change the state: every rank of the group and the quorum's average agree."""
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class OuterSync:
    """DiLoCo (Douillard et al. 2023, torchft's `DiLoCo`) on this rank's shards: each group trains alone for
    `recovery.sync_every` steps from the last synchronised weights (the anchor); then the groups average their
    pseudo-gradient (anchor - weights) and an outer Nesterov SGD step moves the anchor, which every group takes
    as its weights. One quorum and one average per round instead of per step: for groups on slow links. A round
    whose average fails (a group lost during it) is dropped: the weights go back to the anchor."""

    def __init__(self, sync: ReplicaSync, params: list[torch.Tensor], lr: float, momentum: float) -> None:
        self.sync = sync
        self.params = [_local(p) for p in params]
        self.anchor = [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=True)

    @torch.no_grad()
    def round(self) -> bool:
        """End a round: the outer step (True), or the round dropped (False); the weights are the anchor's."""
        pseudo = [a - p for a, p in zip(self.anchor, self.params)]
        self.sync.average(pseudo)
        committed = self.sync.commit()
        if committed:
            for a, g in zip(self.anchor, pseudo):
                a.grad = g
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        return committed

    def state(self) -> list[torch.Tensor]:
        """The outer momentum (a healing group's weights come with the engine's state: the anchor, at a round's
        start)."""
        return [self.outer.state[a].get("momentum_buffer", torch.zeros_like(a)) for a in self.anchor]

    @torch.no_grad()
    def load(self, momentum: list[torch.Tensor]) -> None:
        """After the engine's state was set from a peer: that is the anchor; its outer momentum is this."""
        for a, p, m in zip(self.anchor, self.params, momentum):
            a.copy_(p)
            self.outer.state[a]["momentum_buffer"] = m.to(a.device).clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each at most BUCKET_BYTES (a larger tensor alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + t.nbytes > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.nbytes
    if bucket:
        yield bucket


def _serve_store(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)


def to_wire(state: dict[str, Any]) -> dict[str, Any]:
    """A state for a peer: every DTensor as its local shard (the peer's rank holds the same placements)."""
    return {
        k: to_wire(v) if isinstance(v, dict) else _local(v) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def from_wire(received: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """A peer's state rebuilt on this rank: each shard as a tensor like this rank's own (its mesh and placements,
    its device)."""
    out: dict[str, Any] = {}
    for key, value in received.items():
        mine = like.get(key)
        if isinstance(value, dict):
            out[key] = from_wire(value, mine if isinstance(mine, dict) else {})
        elif isinstance(mine, DTensor) and isinstance(value, torch.Tensor):
            out[key] = DTensor.from_local(
                value.to(mine.device),
                mine.device_mesh,
                mine.placements,
                run_check=False,
                shape=mine.shape,
                stride=mine.stride(),
            )
        elif isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor):
            out[key] = value.to(mine.device)
        else:
            out[key] = value
    return out
