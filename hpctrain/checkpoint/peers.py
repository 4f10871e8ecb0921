"""Node-local tiers (RAM, local SSD) that survive a node: each node's files are copied to the next node, and
a resume fetches what a node lacks from the nodes that hold it.

A node-local tier dies with its node, and DCP spreads one checkpoint over every rank's files (a replicated
tensor is written by one rank only, the coordinator alone writes `.metadata`), so without copies one lost node
makes the whole tier useless and the run falls back to shared storage. Like nvidia-resiliency-ext's local
checkpoints, after the write each rank sends its own files to the rank in the same place on the next node (a
ring), and the coordinator's `.metadata` goes to every node; this runs in the save's background thread, on the
tier's own gloo group, so training does not wait for it. At resume the nodes tell each other what they hold,
check that together they hold the whole checkpoint, and each node fetches only the files its ranks' DCP load
reads (for a sharded state, its own shards; under plain DP, whatever DCP's de-duplication gave other ranks).

A "node" here is the set of ranks that see the same tier directory, found by a probe at start-up. So real
nodes, and tests that give each simulated node a directory of its own on one machine, take the same path.
All transfers carry CPU uint8 tensors on a gloo group created for that purpose (never the training's NCCL
group); every rank derives the same transfer list from the same gathered facts, so sends and receives pair up.
Files move in pieces of 64 MiB, all transfers' next pieces at once: a rank never holds a whole shard in memory.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.checkpoint.integrity import METADATA
from hpctrain.durable import fsync_dir

PIECE_BYTES = 64 << 20  # a copy between nodes moves in pieces of this size: the memory it holds per file


@dataclass(frozen=True)
class Nodes:
    """Ranks grouped by the tier directory they see, each group sorted, groups ordered by their first rank."""

    groups: tuple[tuple[int, ...], ...]

    @property
    def shared(self) -> bool:
        return len(self.groups) == 1

    def of(self, rank: int) -> int:
        return next(i for i, g in enumerate(self.groups) if rank in g)

    def leader(self, rank: int) -> int:
        """The rank that writes a node's shared files (manifest, fetched files)."""
        return self.groups[self.of(rank)][0]


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    name: str
    size: int


def group_by_view(seen: list[list[int]]) -> Nodes:
    """From each rank's list of the ranks whose probe it sees, the groups of ranks sharing a directory."""
    return Nodes(tuple(sorted({tuple(sorted(s)) for s in seen})))


def find_nodes(directory: Path, rank: int, world_size: int, group: dist.ProcessGroup | None) -> Nodes:
    """Which ranks see the same `directory`: each rank drops a probe file, every rank looks for all of them."""
    if group is None:
        return Nodes(((0,),))
    nonce = all_gather(f"{time.time_ns()}-{os.getpid()}" if rank == 0 else None, world_size, group)[0]
    probe = directory / f".probe-{nonce}-{rank}"
    probe.touch()
    dist.barrier(group=group)
    seen = [r for r in range(world_size) if (directory / f".probe-{nonce}-{r}").exists()]
    views = all_gather(seen, world_size, group)
    probe.unlink()
    return group_by_view(views)


# ---------------------------------------------------------------- saving: the ring replica
def replica_transfers(files_by_rank: list[dict[str, int]], nodes: Nodes) -> list[Transfer]:
    """Every rank's own files to the rank in the same place on the next node; `.metadata` to every node."""
    transfers = []
    count = len(nodes.groups)
    for rank, files in enumerate(files_by_rank):
        home = nodes.of(rank)
        nxt = nodes.groups[(home + 1) % count]
        peer = nxt[nodes.groups[home].index(rank) % len(nxt)]
        for name, size in sorted(files.items()):
            if name == METADATA:
                transfers += [Transfer(rank, g[0], name, size) for i, g in enumerate(nodes.groups) if i != home]
            else:
                transfers.append(Transfer(rank, peer, name, size))
    return transfers


def own_files(directory: Path, rank: int) -> dict[str, int]:
    """The files this rank wrote into a DCP directory: DCP names them `__<rank>_<i>.distcp`."""
    return {
        p.name: p.stat().st_size
        for p in directory.iterdir()
        if p.is_file() and (p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == METADATA))
    }


def replicate(directory: Path, nodes: Nodes, rank: int, world_size: int, group: dist.ProcessGroup | None) -> int:
    """After this rank's DCP write: copy it to the next node. Returns the bytes this rank received."""
    everyone = all_gather(own_files(directory, rank), world_size, group)
    return run_transfers(replica_transfers(everyone, nodes), rank, directory, directory, group)


# ---------------------------------------------------------------- resuming: fetch what a node lacks
def missing_from(required: dict[str, int], held: list[dict[str, int]]) -> list[str]:
    """Files of the checkpoint that no node holds whole (the tier cannot be used when this is not empty)."""
    return sorted(n for n, size in required.items() if not any(h.get(n) == size for h in held))


def fetch_transfers(
    required: dict[str, int], held: list[dict[str, int]], needed: list[set[str]], nodes: Nodes
) -> list[Transfer]:
    """For each node, the files its ranks will read and it does not hold, each from the nearest node after it
    (around the ring) that holds it whole. `held` and `needed` are per node, in the order of `nodes.groups`."""
    transfers = []
    count = len(nodes.groups)
    for node, group in enumerate(nodes.groups):
        for name in sorted(needed[node]):
            size = required[name]
            if held[node].get(name) == size:
                continue
            source = next(s for s in ((node + k) % count for k in range(1, count)) if held[s].get(name) == size)
            transfers.append(Transfer(nodes.groups[source][0], group[0], name, size))
    return transfers


def holdings(directory: Path, required: dict[str, int]) -> dict[str, int]:
    """The checkpoint's files present here with the size the manifest gives (a torn copy counts as absent)."""
    found = {}
    for name, size in required.items():
        path = directory / name
        if path.is_file() and path.stat().st_size == size:
            found[name] = size
    return found


def run_transfers(
    transfers: list[Transfer],
    rank: int,
    src_dir: Path,
    dst_dir: Path,
    group: dist.ProcessGroup | None,
    piece_bytes: int = PIECE_BYTES,
) -> int:
    """This rank's side of a transfer list, piece by piece: each round posts the next piece (at most
    `piece_bytes`) of every transfer at once, sends and receives, then writes what came in. A rank holds one
    piece per file it moves, never a whole shard (GBs on a real run). Returns the bytes this rank received."""
    mine = [(tag, t) for tag, t in enumerate(transfers) if rank in (t.src, t.dst)]
    dst_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as files:
        sources = {tag: files.enter_context(open(src_dir / t.name, "rb")) for tag, t in mine if t.src == rank}
        sinks = {
            tag: files.enter_context(open(dst_dir / f".{t.name}.incoming", "wb")) for tag, t in mine if t.dst == rank
        }
        for start in range(0, max((t.size for _, t in mine), default=0), piece_bytes):
            works: list[Any] = []  # torch types a send's or receive's Work as optional (None off the group)
            landed = []
            for tag, t in mine:
                if start >= t.size:
                    continue
                piece = torch.empty(min(piece_bytes, t.size - start), dtype=torch.uint8)
                if tag in sources:
                    sources[tag].readinto(piece.numpy().data)
                    works.append(dist.isend(piece, dst=t.dst, group=group, tag=tag))
                else:
                    works.append(dist.irecv(piece, src=t.src, group=group, tag=tag))
                    landed.append((tag, piece))
            for work in works:
                work.wait()
            for tag, piece in landed:
                sinks[tag].write(piece.numpy().data)
        for sink in sinks.values():  # a copy is as durable as the original before it takes the name
            sink.flush()
            os.fsync(sink.fileno())
    for _, t in mine:
        if t.dst == rank:
            os.replace(dst_dir / f".{t.name}.incoming", dst_dir / t.name)
    if any(t.dst == rank for _, t in mine):
        fsync_dir(dst_dir)
    return sum(t.size for _, t in mine if t.dst == rank)


def by_node(per_rank: list[Any], nodes: Nodes) -> list[Any]:
    """Each node's entry: that of its leader."""
    return [per_rank[g[0]] for g in nodes.groups]


def all_gather(obj: Any, world_size: int, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's `obj`, by rank (pickled, on `group`: the checkpoint's gloo groups carry CPU objects)."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out
