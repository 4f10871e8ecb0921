"""Which nodes of a job train and which wait as hot spares: the nodes that hold this run's node-local checkpoints
train first.

A job with hot spares (cluster.spare_nodes) trains on `cluster.nodes` of its nodes; the others wait
(`spares.py`). By index alone, the last nodes would wait. But a resubmitted or resumed job may land on nodes whose
RAM (or local SSD) still holds this run's newest checkpoint, and a spare's files are of no use to the resume: only
the nodes that train read and fetch (`hpctrain.checkpoint.peers`). An independent cluster saw the one node holding
the only surviving copy of part of a RAM checkpoint made the spare; the checkpoint was skipped and 10 steps redone
(issue 48, D6). So the roles follow what each node holds:

- each agent lists what it holds of this run's node-local tiers (`held_here`): every committed checkpoint whose
  manifest says the tier was node-local when written, with the files present whole, its own and its peer's copies;
- the nodes tell each other through the rendezvous store they already share (`agree`): each posts its list, the
  store's host decides once from the lists posted within `HOLDINGS_WAIT_S` (a node that did not post in time holds
  nothing), and every agent reads that one decision, so all reach the same roles (one reader of every list, not
  every agent reading every other's: thousands of nodes would send the store millions of reads);
- the decision is a pure function (`choose_trainers`): newest checkpoint first, the nodes that add files of it not
  yet covered by those chosen, then its other holders; then older checkpoints alike; then every other node by
  index. A checkpoint that the job's nodes cannot complete together (a file on none of them) is passed over. Ties
  go to the lower index, so a job that holds nothing trains on its first nodes, as before.

Slots (`spares.py`) are numbered by the trainers' order of index: slot k is the k-th trainer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

# How long the store's host waits for the other nodes' holdings from its own arrival. Paid in full only when a
# node never comes (its slot then waits in the rendezvous for launcher.rendezvous_timeout_s anyway); agents that
# start late (an import storm on a shared filesystem) but within it keep their say.
HOLDINGS_WAIT_S = 60.0
POLL_S = 0.1


@dataclass(frozen=True)
class Held:
    """One checkpoint of a node-local tier, as much of it as one node holds."""

    step: int
    tier: int  # the tier's place in checkpoint.tiers
    version: str  # a digest of the checkpoint's file list and sums: one save, whichever node holds it
    total: int  # the files of the whole checkpoint (its manifest)
    files: frozenset[str]  # those present here whole (own files, a peer's copies, `.metadata`)


class Place(Protocol):
    """What the exchange needs of a node's agent (`elastic.NodeAgent`, a frozen dataclass: read-only)."""

    @property
    def job_id(self) -> str: ...
    @property
    def node(self) -> int: ...
    @property
    def nodes(self) -> int: ...
    @property
    def hosts(self) -> tuple[str, ...]: ...
    @property
    def store_node(self) -> int: ...
    @property
    def join_timeout_s(self) -> int: ...


# ---------------------------------------------------------------- the decision: a pure function
def choose_trainers(held: Sequence[Sequence[Held]], nodes: int) -> tuple[int, ...]:
    """The `nodes` nodes that train, sorted, from each node's holdings (by node index; empty: nothing, or no
    answer). Newest checkpoint first: its holders that add files not yet covered, most files first, then its
    other holders; then older checkpoints the same way; then the rest by index. Ties: the lower index."""
    by_checkpoint: dict[tuple[int, int, str], dict[int, Held]] = {}
    for node, items in enumerate(held):
        for item in items:
            by_checkpoint.setdefault((item.step, item.tier, item.version), {})[node] = item
    order: list[int] = []
    for key in sorted(by_checkpoint, key=lambda k: (-k[0], k[1], k[2])):
        holders = by_checkpoint[key]
        total = max(h.total for h in holders.values())
        if len(frozenset().union(*(h.files for h in holders.values()))) < total:
            continue  # some file is on no node of this job: no choice of nodes resumes it
        covered: set[str] = set().union(*(holders[n].files for n in order if n in holders))
        adding: list[int] = []
        redundant: list[int] = []
        for node in sorted((n for n in holders if n not in order), key=lambda n: (-len(holders[n].files), n)):
            (adding if holders[node].files - covered else redundant).append(node)
            covered |= holders[node].files
        order += adding + redundant
    order += [n for n in range(len(held)) if n not in order]
    return tuple(sorted(order[:nodes]))


def slot_of(trainers: Sequence[int], node: int) -> int | None:
    """This node's slot: its place among the trainers, or None for a spare."""
    return list(trainers).index(node) if node in trainers else None


# ---------------------------------------------------------------- what this node holds
def held_here(config: Mapping[str, Any], run_dir: Path) -> list[Held]:
    """This node's committed checkpoints of the run's node-local tiers. `config` is the task's resolved config
    (`TrainTask.config`, a plain dict). A relative tier lives in the run directory, on shared storage: skipped;
    so is a checkpoint whose manifest says its tier was shared, names another run, or whose tier directory
    leads out of the run's own (the resume would refuse it)."""
    from hpctrain.checkpoint.peers import holdings
    from hpctrain.checkpoint.storage import committed_in
    from hpctrain.records.paths import escape, tier_directory

    checkpoint = config.get("checkpoint") or {}
    if not checkpoint.get("enabled", True):
        return []
    run_id = str(config["run"]["id"])
    found = []
    for index, tier in enumerate(checkpoint.get("tiers") or []):
        if not Path(str(tier["path"])).expanduser().is_absolute():
            continue
        directory, home = tier_directory(str(tier["path"]), run_dir, run_id)
        if not directory.is_dir() or escape(directory, home):
            continue
        for ckpt in committed_in(directory):
            manifest = ckpt.manifest
            if manifest.get("shared") is not False or str(manifest.get("run_id", run_id)) != run_id:
                continue
            files = holdings(ckpt.path, manifest["files"])
            if files:
                found.append(Held(ckpt.step, index, _version(manifest), len(manifest["files"]), frozenset(files)))
    return found


def _version(manifest: Mapping[str, Any]) -> str:
    """The same save gives the same digest on every node (the manifests' times differ, their files do not)."""
    from hpctrain.checkpoint.integrity import ALGORITHM

    body = {"files": manifest["files"], "sums": manifest.get(ALGORITHM, {})}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def encode(items: Sequence[Held]) -> str:
    return json.dumps([[h.step, h.tier, h.version, h.total, sorted(h.files)] for h in items])


def decode(text: str) -> list[Held]:
    """A node's posted holdings; one that cannot be read counts as nothing (and is said)."""
    try:
        return [Held(int(s), int(t), str(v), int(n), frozenset(map(str, f))) for s, t, v, n, f in json.loads(text)]
    except (ValueError, TypeError) as err:
        log.warning("a node's checkpoint holdings cannot be read (%s): counted as nothing", err)
        return []


# ---------------------------------------------------------------- the exchange through the rendezvous store
def _key(job_id: str, *parts: object) -> str:
    return "/".join(["hpctrain", job_id, "roles", *map(str, parts)])


def agree(
    store: Any, job_id: str, node: int, count: int, nodes: int, mine: Sequence[Held], decides: bool, wait_s: float
) -> tuple[int, ...]:
    """Every agent of the job: post this node's holdings and return the trainers, the same on every node.

    The agent that `decides` (the store's host) waits up to `wait_s` for all `count` nodes' holdings, decides
    from those posted (`choose_trainers`) and publishes the decision with one compare-and-set. The others wait
    for it up to twice as long; one that sees none by then publishes the order by index the same way. Whichever
    came first stands, and every agent reads it: the roles never differ between nodes."""
    store.set(_key(job_id, "held", node), encode(mine))
    store.add(_key(job_id, "posted"), 1)
    decision = _key(job_id, "trainers")
    proposal: tuple[int, ...] | None = None
    if decides:
        proposal = choose_trainers(_gather(store, job_id, count, wait_s), nodes)
    else:
        deadline = time.monotonic() + 2 * wait_s
        while not store.check([decision]) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if not store.check([decision]):
            log.warning(
                "node %d: no decision on the roles after %.0f s: proposing the order by index", node, 2 * wait_s
            )
            proposal = tuple(range(min(nodes, count)))
    text = store.get(decision) if proposal is None else store.compare_set(decision, "", json.dumps(proposal))
    return tuple(int(n) for n in json.loads(text.decode() if isinstance(text, bytes) else text))


def _gather(store: Any, job_id: str, count: int, wait_s: float) -> list[list[Held]]:
    """Every node's posted holdings (by node index) after all `count` posted or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while store.add(_key(job_id, "posted"), 0) < count and time.monotonic() < deadline:
        time.sleep(POLL_S)
    keys = [_key(job_id, "held", n) for n in range(count)]
    posted = [n for n in range(count) if store.check([keys[n]])]
    late = sorted(set(range(count)) - set(posted))
    if late:
        log.warning("node(s) %s posted no checkpoint holdings within %.0f s: counted as holding nothing", late, wait_s)
    values = store.multi_get([keys[n] for n in posted]) if posted else []
    held: list[list[Held]] = [[] for _ in range(count)]
    for n, value in zip(posted, values):
        held[n] = decode(value.decode() if isinstance(value, bytes) else value)
    return held


def slot_by_holdings(store: Any, agent: Place, task: Any, wait_s: float = HOLDINGS_WAIT_S) -> int | None:
    """This agent's slot (None: a hot spare) in the job's first launch, decided from what every node holds of
    the run's node-local checkpoints. `task` carries the run's config and directory (`TrainTask`)."""
    held = held_here(task.config, Path(task.run_dir))
    trainers = agree(
        store,
        agent.job_id,
        agent.node,
        len(agent.hosts),
        agent.nodes,
        held,
        agent.node == agent.store_node,
        min(wait_s, agent.join_timeout_s),
    )
    slot = slot_of(trainers, agent.node)
    tiers = task.config.get("checkpoint", {}).get("tiers") or []
    top = max(held, key=lambda h: (h.step, -h.tier), default=None)
    holds = (
        f" (it holds tier {tiers[top.tier]['name']} step {top.step}: {len(top.files)} of {top.total} files)"
        if top
        else ""
    )
    if trainers != tuple(range(agent.nodes)):
        log.warning(
            "node %d: nodes %s train, not the first %d by index (from what the nodes hold of this run's node-local "
            "checkpoints)",
            agent.node,
            ",".join(map(str, trainers)),
            agent.nodes,
        )
    log.info("node %d: %s%s", agent.node, "waits as a hot spare" if slot is None else f"trains in slot {slot}", holds)
    return slot
