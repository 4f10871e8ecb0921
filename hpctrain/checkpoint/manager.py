"""Tiered, asynchronous, atomically committed checkpoints with torch.distributed.checkpoint (DCP).

Each tier (e.g. RAM, local disk, shared storage) has its own interval and retention. A save blocks
training only while DCP stages the state to host memory; the write runs in a background thread on a
process group of its own (DCP's background collectives would collide with training's on the default group).
At most one save is in flight per tier: a save still running at the tier's next interval is reported and
that interval skipped, not queued.

Every decision that could differ between ranks (a clock-based interval, whether a background write has
finished) is agreed at a step boundary with one small all-reduce, so all ranks start, commit and skip the
same saves. A save is committed (manifest written last, directory renamed) only once every rank's write has
finished; see `storage.py` for the on-disk protocol. A node-local tier (RAM, local SSD: not every rank sees the
same directory) is copied to the next node as part of the save, and read back from peers at resume
(`peers.py`), so it outlives one lost node.

The whole of a save after staging runs in its background thread, on the tier's group: DCP's write, the copy to
the next node, the gather of every rank's file sums, the leader's durable commit (`storage.commit_steps`) and a
barrier. At the step boundary where every rank's future is done, the training thread only books it: the time it
waits for a save is the staging, and the `blocked_s` of a committed save counts both.

DCP writes each tensor with torch.save, which by default computes a CRC32 of every record: on CPU that is
most of the write (a 268 MB tensor: about 0.6-1.1 s with it, 0.2 s without, against 0.2 s for a plain
write), and torch.load never checks it (a flipped byte loads silently). So hpctrain's writes leave it out and
compute CRC32C instead, per file and per record, as the bytes are written (`integrity.py`): a resume checks
`.metadata` against the manifest and each record as it reads it (`reader.py`), skips a damaged checkpoint with
the reason (log, `events.jsonl`), quarantines it (`step_<N>.corrupt`: no later attempt tries it again) and
loads the next newest one, same tier first, then slower tiers.

A run's checkpoints are its own (issue 46): each tier directory must resolve inside the run's (a relative tier in
the run directory, an absolute one in `<path>/<run id>`), a `step_<N>` linked out of it is no checkpoint of the
tier, and a checkpoint whose manifest names another run is refused (`CheckpointError`), never loaded, written
into or deleted. A checkpoint whose tensors have other shapes than the model's is refused too, whatever
checkpoint.force_resume says: a load never slices or pads a weight, except the vocabulary's padding rows.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.utils import CheckpointException

from hpctrain.checkpoint import integrity, peers
from hpctrain.checkpoint.integrity import METADATA
from hpctrain.checkpoint.peers import Nodes
from hpctrain.checkpoint.reader import CorruptCheckpoint
from hpctrain.checkpoint.reshard import legacy_source, load_state
from hpctrain.checkpoint.storage import (
    MANIFEST,
    Committed,
    broken_in,
    committed_in,
    linked_out,
    partial_dir,
    publish,
    quarantine,
    remove_debris,
    retain,
    step_dir,
    step_of,
    verify,
    write_manifest,
)
from hpctrain.config.schema import CheckpointConfig
from hpctrain.goodput.model import daly_interval, mtbf_s
from hpctrain.models import registry
from hpctrain.records.fingerprint import ModelFingerprint, upgrade_fingerprint
from hpctrain.records.paths import escape, tier_directory

log = logging.getLogger(__name__)


@dataclass
class Tier:
    name: str
    path: Path
    interval_steps: int
    interval_minutes: float
    keep_last: int
    nodes: Nodes = Nodes(((0,),))  # ranks grouped by the directory they see: one group when shared
    auto: bool = False  # interval_minutes follows Daly's optimum for the measured cost
    last_save: float = field(default_factory=time.monotonic)
    home: Path | None = None  # what `path` must resolve inside (`hpctrain.records.paths.tier_directory`)

    @property
    def shared(self) -> bool:
        """Every rank sees the same directory (else node-local: each node holds its part and a peer's)."""
        return self.nodes.shared

    def due_by_steps(self, step: int) -> bool:
        return self.interval_steps > 0 and step % self.interval_steps == 0

    def due_by_time(self, now: float) -> bool:
        return self.interval_minutes > 0 and now - self.last_save >= 60 * self.interval_minutes


@dataclass
class InFlight:
    step: int
    future: Future  # of `_write_and_commit`'s summary, once the save is committed
    staged: Future  # the copy to host memory, which the next optimizer step waits for
    blocked_s: float  # training's wait: at the step boundary, then at the optimizer step for the copy


class ReusingStager(BlockingAsyncStager):
    """Stage into the same host buffers every save of a tier: no allocation and no page faults after the
    first save. Safe because a tier never has two saves in flight. Pinned only for a run on GPUs (pinning
    initialises CUDA: a CPU run on a GPU machine must not).

    The copy runs in the manager's staging thread while training goes on (`stage` returns its future, as
    torch's DefaultStager does with use_async_staging): the state may not change until the copy is done, and
    the one thing that changes it, the optimizer step, waits for it (`CheckpointManager.wait_for_staging`, the
    engine's `before_update`). On a GPU the thread copies on a stream of its own, after what training had
    queued when the save started. On the CPU it copies on one intra-op thread: a host-to-host copy is bound by
    memory bandwidth, and torch's OpenMP-parallel `copy_` meets each of a state's hundreds of tensors at a
    barrier; on a busy machine a descheduled OpenMP thread stalls each barrier (staging 1.1 GB: a median 5.1 s
    with 2 threads against 0.44 s with one, `docs/checkpoint.md`)."""

    def __init__(self, device: torch.device, copier: ThreadPoolExecutor) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._keys: frozenset[str] | None = None
        self._device = device
        self._copier = copier
        self._stream: Any = None  # the staging thread's CUDA stream, made there on first use

    def stage(self, state_dict: Any) -> Future:  # type: ignore[override]  # DCP's async_save takes a Future too
        keys = frozenset(_flat_keys(state_dict))
        if self.state_dict_cache is None or keys != self._keys:  # first save, or the state's shape changed
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=self._device.type == "cuda")
            self._keys = keys
        queued = None
        if self._device.type == "cuda":  # the state's last update is queued on training's stream before this
            queued = torch.cuda.Event()
            queued.record()
        return self._copier.submit(self._copy, state_dict, queued)

    def _copy(self, state_dict: Any, queued: Any) -> Any:
        torch.set_num_threads(1)  # this thread's own OpenMP team: training's keeps its count
        cache = self.state_dict_cache
        assert cache is not None  # made by `stage`, which queued this copy
        if queued is None:
            return _copy_state_dict(state_dict, cache)
        torch.cuda.set_device(self._device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        self._stream.wait_event(queued)
        with torch.cuda.stream(self._stream):
            staged = _copy_state_dict(state_dict, cache, non_blocking=True)
        self._stream.synchronize()
        return staged


def _flat_keys(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [k for key, value in tree.items() for k in _flat_keys(value, f"{prefix}{key}.")]
    return [prefix]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used to resume exactly (and the user did not force it)."""


def _load_failure(err: BaseException) -> str | None:
    """Why a load failed, when the checkpoint's bytes are to blame (None for any other error: re-raised).
    DCP gathers every rank's read error and raises the same exception on all of them."""
    if isinstance(err, CorruptCheckpoint):
        return str(err)
    if isinstance(err, CheckpointException):
        found = [exc for exc, _ in err.failures.values() if isinstance(exc, CorruptCheckpoint)]
        return "; ".join(dict.fromkeys(str(e) for e in found)) if found else None
    return None


class CheckpointManager:
    """Saves, commits, retains and finds checkpoints of an engine (state_dict() / load_state_dict())."""

    def __init__(
        self,
        config: CheckpointConfig,
        failure_rate_per_gpu_day: float,
        run_dir: Path,
        run_id: str,
        rank: int,
        world_size: int,
        fingerprint: dict[str, Any],
        device: torch.device | None = None,  # the RNG streams saved and restored: CPU's, and this GPU's
    ) -> None:
        self.enabled = bool(config.enabled)
        self.save_final = bool(config.save_final)
        self.force_resume = bool(config.force_resume)
        self.wait_when_busy = config.when_busy == "wait"
        self.write_threads = config.write_threads
        self.verify_on_load = bool(config.verify_on_load)
        self.rank, self.world_size = rank, world_size
        self.device = device if device is not None else torch.device("cpu")
        self.run_id = run_id
        self.fingerprint = upgrade_fingerprint(fingerprint)
        self.distributed = dist.is_initialized()
        self.tiers = [
            Tier(t.name, directory, t.interval_steps, t.interval_minutes, t.keep_last, auto=t.auto, home=home)
            for t in config.tiers
            for directory, home in [tier_directory(t.path, run_dir, run_id)]
        ]
        self.mtbf_s = mtbf_s(failure_rate_per_gpu_day, world_size)
        # Own groups, created by every rank in the same order: agreement at step boundaries uses
        # `control_group` (gloo, so it works next to NCCL too); each tier's background writes use a group of
        # their own, since two tiers' saves can be in flight at once in two threads.
        self.control_group = dist.new_group(backend="gloo") if self.distributed else None
        self.save_groups = {t.name: dist.new_group(backend="gloo") if self.distributed else None for t in self.tiers}
        # One staging thread: a tier's copy to host memory runs there while training goes on (`ReusingStager`).
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-stage")
        self.stagers = {t.name: ReusingStager(self.device, self._copier) for t in self.tiers}
        # A save's future: DCP's write, then (node-local tiers) the copy to the next node, on the tier's group.
        self._writers = ThreadPoolExecutor(max_workers=max(1, len(self.tiers)), thread_name_prefix="hpctrain-save")
        self.in_flight: dict[str, InFlight] = {}
        self._staging_wait_s = 0.0
        # Retention deletes whole checkpoints (a rmtree of GBs takes a noticeable time): in the background, so
        # that a commit at a step boundary costs training only the manifest and a rename.
        self._janitor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-retention")
        self._retaining: list[Future] = []
        self.events: list[dict[str, Any]] = []  # for metrics/tracking; drained by the loop
        if self.enabled:
            self._probe_tiers()

    # ---------------------------------------------------------------- collectives
    def _all_reduce_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group)
        return t.tolist()

    def _all_gather(self, obj: Any) -> list[Any]:
        return peers.all_gather(obj, self.world_size, self.control_group) if self.distributed else [obj]

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.control_group)

    def _leader(self, tier: Tier) -> bool:
        """Who publishes a tier's directories: rank 0 on shared storage, the first rank of each node otherwise."""
        return tier.nodes.leader(self.rank) == self.rank

    # ---------------------------------------------------------------- start-up
    def _probe_tiers(self) -> None:
        """Find which ranks see the same directory of each tier (its nodes); clean partial saves."""
        for tier in self.tiers:
            self._guard(tier, "start")
            tier.path.mkdir(parents=True, exist_ok=True)
            tier.nodes = peers.find_nodes(tier.path, self.rank, self.world_size, self.control_group)
            if self._leader(tier):
                for stale in remove_debris(tier.path):  # a save, or a deletion, killed half way
                    log.info("removed the debris of an interrupted save or deletion: %s", stale)
            self._barrier()

    def _guard(self, tier: Tier, doing: str) -> None:
        """Refuse a tier whose directory, or a checkpoint in it, leads out of this run's own through a link:
        loading, saving or retaining there would reach another run's checkpoints (issue 46)."""
        why = escape(tier.path, tier.home) if tier.home is not None else None
        found = [why] if why else [w for _, w in linked_out(tier.path)]
        if found:
            raise CheckpointError(
                f"checkpoint tier {tier.name}: {found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}"
                f": run {self.run_id} loads, saves and deletes only checkpoints of its own, so it does not {doing} "
                "there (nothing was loaded, saved or deleted). Remove the link and let the run make its own "
                "directory, or start a new run; to start from another run's weights, export them "
                "(tools/checkpoint.py export RUN --format hf OUT) and set model.init_from=OUT"
            )

    def _check_owner(self, ckpt: Committed) -> None:
        """A checkpoint another run wrote (its manifest's run id) is not resumed: it came in through a link or a
        copy. One written before manifests named their run is taken as this run's, with a warning."""
        owner = ckpt.manifest.get("run_id")
        if owner is None:
            log.warning(
                "checkpoint %s names no run (written before manifests did): taken as run %s's", ckpt.path, self.run_id
            )
            return
        if str(owner) != self.run_id:
            raise CheckpointError(
                f"checkpoint {ckpt.path} belongs to run {owner} (its manifest), not to this run {self.run_id}: a run "
                "resumes only its own checkpoints (is the tier directory, or this step, a link or a copy of another "
                "run's?). Nothing was loaded. Remove it from this run's tier, or start a new run; to start from that "
                "run's weights, export them (tools/checkpoint.py export RUN --format hf OUT) and set "
                "model.init_from=OUT"
            )

    def _check_shapes(self, ckpt: Committed, state: dict[str, Any]) -> None:
        """Every tensor of the checkpoint that the state loads has the state's global shape, and every model
        weight of the checkpoint has a place in the state: a load never slices, pads or drops a weight
        (model.moe.n_experts 8 -> 4 kept the first 4 experts before), with checkpoint.force_resume or without.
        The one difference allowed is the vocabulary's padding rows of the embedding and the head (and their
        optimizer states), which `reshard.load_state` copies over. A rank holds only its pipeline stage's layers:
        a weight of the checkpoint is missed only in a layer (or top-level module) the rank holds."""
        saved = integrity.read_metadata(ckpt.path / METADATA).state_dict_metadata
        vocab = _vocab_weights(self.fingerprint.get("model"))
        wrong: list[str] = []
        targets: set[str] = set()
        renamed: set[str] = set()
        for fqn, container, key in _leaves(state):
            targets.add(fqn)
            value, meta = container[key], saved.get(fqn)
            if meta is None:
                source = legacy_source(key)
                if source is not None:
                    renamed.add(fqn[: len(fqn) - len(key)] + source[0])
                continue
            if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
                continue
            have, want = tuple(meta.size), tuple(value.shape)
            if have == want:
                continue
            rows_only = len(have) == len(want) >= 1 and have[1:] == want[1:]
            if rows_only and any(f".{name}." in f".{fqn}." for name in vocab):
                continue  # the vocabulary padded for another TP degree or pad multiple: `reshard` copies the rows
            wrong.append(f"{_weight_name(fqn)} is {list(have)} there, {list(want)} here")
        held = {_module_of(k) for k in targets if k.startswith("train.model.")}
        extra = sorted(
            k
            for k, meta in saved.items()
            if k.startswith("train.model.")
            and hasattr(meta, "size")
            and k not in targets
            and k not in renamed
            and _module_of(k) in held
        )
        wrong += [f"{_weight_name(k)} is in the checkpoint, not in this model" for k in extra]
        if wrong:
            raise CheckpointError(
                f"checkpoint {ckpt.path} does not fit this model: {'; '.join(wrong[:3])}"
                f"{f' (and {len(wrong) - 3} more)' if len(wrong) > 3 else ''}. A checkpoint loads only into the "
                "shapes it was saved with (checkpoint.force_resume does not change that): resume with the run's own "
                "model settings (its config.yaml), or start a new run (convert the weights first: tools/checkpoint.py "
                "export RUN --format hf OUT, then model.init_from=OUT)"
            )

    # ---------------------------------------------------------------- resume
    def resume(self, engine: Any) -> dict[str, Any] | None:
        """Load the newest checkpoint that every rank can read and that is sound, over all tiers; None for a fresh
        start. A damaged one is skipped (and quarantined), the next newest tried: same tier first, then slower."""
        if not self.enabled:
            return None
        self.wait_for_staging()  # a load sets the state a copy may still read
        self._quarantine_broken_manifests()
        here = [(c.step, -i, i, c.path.name) for i, t in enumerate(self.tiers) for c in committed_in(t.path, t.name)]
        candidates = sorted({tuple(c) for part in self._all_gather(here) for c in part}, reverse=True)
        overwritten = ""
        for step, _, index, name in candidates:
            tier = self.tiers[index]
            if tier.shared:
                ckpt = next((c for c in committed_in(tier.path, tier.name) if c.path.name == name), None)
                problems = ["not committed on this node"] if ckpt is None else self._problems(ckpt)
            else:
                ckpt, problems = self._from_nodes(tier, step)
            # damage: what a checkpoint that is there holds is not what was written (vs. not there, not whole)
            unusable, damaged = self._all_reduce_max(
                [float(bool(problems)), float(ckpt is not None and bool(problems))]
            )
            if unusable:
                self._skip(tier, step, self._all_gather(problems), damaged > 0)
                continue
            assert ckpt is not None
            self._check_owner(ckpt)
            self._check_fingerprint(ckpt)
            started = time.perf_counter()
            try:
                fetched = self._load(ckpt, engine, tier)
            except (Exception, CheckpointException) as err:
                reason = _load_failure(err)
                if reason is None:
                    raise
                overwritten = f"tier {tier.name} step {step}: {reason}"
                self._skip(tier, step, [[reason]], damaged=True)
                continue
            seconds = time.perf_counter() - started
            log.info(
                "resumed from tier %s step %d (%s) in %.2f s%s",
                tier.name,
                step,
                ckpt.path,
                seconds,
                f"; the nodes fetched {fetched / 1e6:.1f} MB of it from their peers" if fetched else "",
            )
            self.events.append(
                {
                    "event": "resume",
                    "tier": tier.name,
                    "step": step,
                    "load_s": seconds,
                    "fetched_bytes": fetched,
                    "verified": self.verify_on_load,
                }
            )
            return ckpt.manifest
        if overwritten:  # part of the state came from a damaged checkpoint: never train on from it
            raise CheckpointError(
                f"no sound checkpoint is left after a damaged one was partly loaded ({overwritten});"
                " it is quarantined, so the next attempt starts afresh"
            )
        return None

    def _problems(self, ckpt: Committed) -> list[str]:
        """What makes a checkpoint visible on every rank unusable: missing or truncated files, a `.metadata` whose
        bytes are not those written."""
        return verify(ckpt) + [str(d) for d in integrity.check_files(ckpt.path, ckpt.manifest, [METADATA])]

    def _skip(self, tier: Tier, step: int, reasons_by_rank: list[list[str]], damaged: bool) -> None:
        """A candidate every rank gives up on: say why (log, events), and quarantine it when it is damaged."""
        reasons = list(dict.fromkeys(r for part in reasons_by_rank for r in part))
        log.warning(
            "skipping tier %s step %d%s: %s",
            tier.name,
            step,
            " (damaged: quarantined)" if damaged else "",
            "; ".join(reasons[:3]),
        )
        self.events.append(
            {
                "event": "resume_skip",
                "tier": tier.name,
                "step": step,
                "damaged": damaged,
                "reason": "; ".join(reasons[:3]),
            }
        )
        path = step_dir(tier.path, step)
        if damaged and self._leader(tier) and path.exists():
            quarantine(path)
        self._barrier()

    def _quarantine_broken_manifests(self) -> None:
        """A manifest that cannot be trusted (torn, garbage, its seal broken) hides its checkpoint from
        `committed_in`; say so once, and move it out of the way of every later attempt."""
        for tier in self.tiers:
            broken = broken_in(tier.path) if self._leader(tier) else []
            for path, why in broken:
                log.warning("checkpoint %s of tier %s is damaged (quarantined): %s", path, tier.name, why)
                self.events.append(
                    {"event": "resume_skip", "tier": tier.name, "step": step_of(path), "damaged": True, "reason": why}
                )
                quarantine(path)
        self._barrier()

    def _check_fingerprint(self, ckpt: Committed) -> None:
        saved = upgrade_fingerprint(ckpt.manifest.get("fingerprint", {}), self.fingerprint)
        if saved.get("model") != self.fingerprint["model"]:
            raise CheckpointError(
                f"checkpoint {ckpt.path} holds model {saved.get('model')}, this run builds "
                f"{self.fingerprint['model']}: it cannot be loaded"
            )
        changed = {k: (saved.get(k), v) for k, v in self.fingerprint.items() if k != "model" and saved.get(k) != v}
        if changed and not self.force_resume:
            detail = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
            raise CheckpointError(
                f"resuming {ckpt.path} would not continue the same training exactly ({detail}): the data "
                "order or position would differ. Restore those settings, or set checkpoint.force_resume=true"
            )
        if changed:
            log.warning("forced resume despite changes: %s", changed)

    def _from_nodes(self, tier: Tier, step: int) -> tuple[Committed | None, list[str]]:
        """A node-local checkpoint as the nodes together hold it: usable when every file is whole somewhere.
        Every node ends up with `.metadata` (DCP plans a load from it); the rest is fetched in `_load`."""
        path = step_dir(tier.path, step)
        leader = self._leader(tier)
        local = next((c for c in committed_in(tier.path, tier.name) if c.path == path), None)
        manifests = self._all_gather(local.manifest if local and leader else None)
        manifest = next(m for m in manifests if m)  # the candidate came from a node that has it
        required: dict[str, int] = manifest["files"]
        held = peers.by_node(self._all_gather(peers.holdings(path, required) if leader else None), tier.nodes)
        lost = peers.missing_from(required, held)
        if lost or METADATA not in required:
            return None, [f"no node holds {', '.join(lost[:3]) or METADATA}"]
        transfers = peers.fetch_transfers(required, held, [{METADATA}] * len(held), tier.nodes)
        peers.run_transfers(transfers, self.rank, path, path, self.control_group)
        self._barrier()
        return Committed(tier.name, step, path, manifest), [
            str(d) for d in integrity.check_files(path, manifest, [METADATA])
        ]

    def _fetch_missing(self, tier: Tier, ckpt: Committed, files: set[str]) -> int:
        """Bring the files each node's ranks will read from the nodes that hold them; each node then holds a
        committed copy of its own. Returns the bytes moved between nodes, job-wide (every rank has the list of
        transfers)."""
        required: dict[str, int] = ckpt.manifest["files"]
        needed = self._all_gather(sorted(files))
        per_node = [set().union(*(needed[r] for r in group)) for group in tier.nodes.groups]
        leader = self._leader(tier)
        held = peers.by_node(self._all_gather(peers.holdings(ckpt.path, required) if leader else None), tier.nodes)
        transfers = peers.fetch_transfers(required, held, per_node, tier.nodes)
        peers.run_transfers(transfers, self.rank, ckpt.path, ckpt.path, self.control_group)
        if leader and not (ckpt.path / MANIFEST).exists():
            write_manifest(ckpt.path, ckpt.manifest)
        self._barrier()
        return sum(t.size for t in transfers)

    def _load(self, ckpt: Committed, engine: Any, tier: Tier) -> int:
        """Load a committed checkpoint into the engine (and this rank's RNG); the bytes fetched from peers."""
        state = {"train": engine.state_dict()}
        self._check_shapes(ckpt, state)
        same_world = ckpt.manifest.get("world_size") == self.world_size
        if same_world:  # RNG streams are per rank: only meaningful with the same ranks (and devices saved)
            streams = _rng_state(self.device)
            state["rng"] = {
                f"rank{self.rank}": {k: v for k, v in streams.items() if k in ckpt.manifest.get("rng_streams", ["cpu"])}
            }
        fetched = [0]

        def fetch(files: set[str]) -> None:
            fetched[0] = self._fetch_missing(tier, ckpt, files)

        load_state(
            state,
            str(ckpt.path),
            self.control_group,
            no_dist=not self.distributed,
            before_read=None if tier.shared else fetch,
            verify=self.verify_on_load,
        )
        engine.load_state_dict(state["train"])
        if same_world:
            _set_rng_state(state["rng"][f"rank{self.rank}"], self.device)
        return fetched[0]

    # ---------------------------------------------------------------- saving
    def control_values(self, now: float) -> list[float]:
        """This rank's view of what must be agreed at the next step boundary, for the step's one all-reduce:
        per save in flight, 1 while this rank still writes; per clock-timed tier, 1 if rank 0's clock says due.
        Every rank returns a list of the same length (the in-flight saves and the tiers are the same)."""
        if not self.enabled:
            return []
        local = [0.0 if self.in_flight[n].future.done() else 1.0 for n in self.in_flight]
        return local + [
            1.0 if self.rank == 0 and t.due_by_time(now) else 0.0 for t in self.tiers if t.interval_minutes > 0
        ]

    def after_step(self, step: int, engine: Any, progress: dict[str, Any], agreed: list[float]) -> None:
        """Called by every rank at every step boundary with `control_values` summed over all ranks (taken
        before the step): commit the saves every rank had finished, start the due ones. No collective of
        its own: a save finished during the step is committed at the next boundary."""
        if not self.enabled:
            return
        now = time.monotonic()
        pending = list(self.in_flight)
        timed = [t for t in self.tiers if t.interval_minutes > 0]
        for name, running in zip(pending, agreed[: len(pending)]):
            if not running:
                self._commit(name)
        due = {t.name for t in self.tiers if t.due_by_steps(step)}
        due |= {t.name for t, flag in zip(timed, agreed[len(pending) :]) if flag}
        for tier in self.tiers:
            if tier.name in due:
                self._start(tier, step, engine, progress, now)

    def save_now(self, step: int, engine: Any, progress: dict[str, Any], tier_name: str | None = None) -> None:
        """Save to one tier (default: the fastest) and wait until it is committed: preemption, end of run."""
        if not self.enabled or not self.tiers:
            return
        tier = next(t for t in self.tiers if t.name == tier_name) if tier_name else self.tiers[0]
        self.wait_all()
        here = any(c.step == step for c in committed_in(tier.path, tier.name))
        if self._all_reduce_max([0.0 if here else 1.0])[0]:  # not yet in this tier (on some node)
            self._start(tier, step, engine, progress, time.monotonic())
        self.wait_all()

    def stop_tier(self) -> str | None:
        """Where a stop for a signal saves: the fastest tier every rank shares, else the fastest. A requeued job
        may start on other nodes, where a node-local tier (RAM, local SSD) holds nothing."""
        return next((t.name for t in self.tiers if t.shared), self.tiers[0].name if self.tiers else None)

    def finish(self, step: int, engine: Any, progress: dict[str, Any]) -> None:
        """End of training: the final state goes to the most durable tier; nothing is left in flight."""
        if not self.enabled:
            return
        if self.save_final and self.tiers:
            self.save_now(step, engine, progress, self.tiers[-1].name)
        self.wait_all()

    def wait_for_staging(self) -> None:
        """Block until every save's copy of the state is in host memory: called before anything changes the
        state (the engine's optimizer step, a load). The wait is training's, counted in the save's blocked_s
        and in `take_staging_wait`."""
        for running in self.in_flight.values():
            waited = time.perf_counter()
            running.staged.result()  # re-raises a failed copy here, on the training thread
            waited = time.perf_counter() - waited
            running.blocked_s += waited
            self._staging_wait_s += waited

    def take_staging_wait(self) -> float:
        """Seconds training waited for copies since the last call (the loop books them as checkpoint time)."""
        waited, self._staging_wait_s = self._staging_wait_s, 0.0
        return waited

    def wait_all(self) -> None:
        self.wait_for_staging()
        for name in list(self.in_flight):
            self.in_flight[name].future.result()
            self._commit(name)
        self._reap_retention(wait=True)

    def _retain(self, tier: Tier) -> list[Path]:
        """Retention of one tier, in the janitor's thread: never through a link out of the run's own directory."""
        self._guard(tier, "delete")
        return retain(tier.path, tier.keep_last)

    def _reap_retention(self, wait: bool) -> None:
        """Collect finished (or, with wait, all) background deletions; a failed one is logged, not fatal."""
        for future in self._retaining:
            if (wait or future.done()) and future.exception() is not None:
                log.warning("checkpoint retention failed: %s", future.exception())
        self._retaining = [f for f in self._retaining if not f.done()]

    def _start(self, tier: Tier, step: int, engine: Any, progress: dict[str, Any], now: float) -> None:
        if tier.name in self.in_flight:
            running = self.in_flight[tier.name]
            if not self.wait_when_busy:
                log.warning(
                    "tier %s: the save of step %d is still running at step %d; skipping this interval",
                    tier.name,
                    running.step,
                    step,
                )
                self.events.append(
                    {"event": "save_skipped", "tier": tier.name, "step": step, "running_step": running.step}
                )
                return
            log.warning(
                "tier %s: the save of step %d is still running at step %d; waiting for it",
                tier.name,
                running.step,
                step,
            )
            waited = time.perf_counter()
            running.future.result()
            self._commit(tier.name)
            self.events.append(
                {"event": "save_waited", "tier": tier.name, "step": step, "waited_s": time.perf_counter() - waited}
            )
        self._guard(tier, "save")
        partial = partial_dir(tier.path, step)
        partial.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        state = {"train": engine.state_dict(), "rng": {f"rank{self.rank}": _rng_state(self.device)}}
        collected = time.perf_counter()
        meta = {
            "step": step,
            "run_id": self.run_id,
            "world_size": self.world_size,
            "time": time.time(),
            "fingerprint": self.fingerprint,
            "rng_streams": sorted(state["rng"][f"rank{self.rank}"]),
            **progress,
            "tier": tier.name,
            "shared": tier.shared,
        }
        writer = integrity.SummingWriter(partial, thread_count=self.write_threads)
        saving = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self.save_groups[tier.name],
            async_stager=self.stagers[tier.name],
            no_dist=not self.distributed,
        )
        assert isinstance(saving, AsyncSaveResponse)  # ReusingStager.stage returns the copy's future
        dispatched = time.perf_counter()
        future = self._writers.submit(
            self._write_and_commit, saving.upload_completion, writer, tier, step, meta, started
        )
        blocked = time.perf_counter() - started
        tier.last_save = now
        self.in_flight[tier.name] = InFlight(step, future, saving.staging_completion, blocked)
        # Where the blocked time went: collecting the state dict, starting the copy (the buffers' allocation
        # at a tier's first save; DCP's planning runs in its thread). The wait for the copy comes at the
        # optimizer step (`wait_for_staging`) and is in the committed save's blocked_s.
        self.events.append(
            {
                "event": "save_started",
                "tier": tier.name,
                "step": step,
                "blocked_s": blocked,
                "state_dict_s": collected - started,
                "dispatch_s": dispatched - collected,
            }
        )

    def _write_and_commit(
        self,
        written: Future,
        writer: integrity.SummingWriter,
        tier: Tier,
        step: int,
        meta: dict[str, Any],
        started: float,
    ) -> dict[str, float]:
        """A save after staging, in its background thread: DCP's write, a node-local tier's copy to the next
        node, every rank's file sums to the leaders, their durable commit; back once every rank is past it."""
        written.result()
        group = self.save_groups[tier.name]
        partial = partial_dir(tier.path, step)
        replica = 0 if tier.shared else peers.replicate(partial, tier.nodes, self.rank, self.world_size, group)
        # After the copies: this gather is also what keeps a leader from renaming the directory while a rank of
        # its node still writes a copy into it.
        by_rank = peers.all_gather(writer.written(), self.world_size, group) if self.distributed else [writer.written()]
        sums = {name: sized for part in by_rank for name, sized in part.items()}
        if self._leader(tier):
            publish(
                partial,
                step_dir(tier.path, step),
                {
                    **meta,
                    "files": {n: s for n, (s, _) in sums.items()},
                    integrity.ALGORITHM: {n: c for n, (_, c) in sums.items()},
                },
            )
        if self.distributed:
            dist.barrier(group=group)
        return {
            "bytes": sum(size for size, _ in sums.values()),
            "replica_bytes": replica,
            "total_s": time.perf_counter() - started,
        }

    def _commit(self, name: str) -> None:
        """Book a save every rank has committed (in its background thread): retention, the event."""
        booked = time.perf_counter()
        job = self.in_flight.pop(name)
        done = job.future.result()  # re-raises a failed write or commit on this rank
        tier = next(t for t in self.tiers if t.name == name)
        if self._leader(tier):
            self._reap_retention(wait=False)
            self._retaining.append(self._janitor.submit(self._retain, tier))
        blocked = job.blocked_s + time.perf_counter() - booked
        log.info(
            "checkpoint step %d committed to tier %s (%.1f MB, blocked %.3f s, %.2f s in all)",
            job.step,
            name,
            done["bytes"] / 1e6,
            blocked,
            done["total_s"],
        )
        self.events.append({"event": "save_committed", "tier": name, "step": job.step, **done, "blocked_s": blocked})
        if tier.auto:
            self._retune(tier, blocked, done["total_s"])

    def _retune(self, tier: Tier, blocked_s: float, write_s: float) -> None:
        """Daly's optimal interval for this tier's measured blocking cost and the job's MTBF; never shorter
        than the background write, which would only make saves skip."""
        minutes = max(daly_interval(max(blocked_s, 1e-3), self.mtbf_s), write_s) / 60
        tier.interval_steps, tier.interval_minutes = 0, minutes
        self.events.append(
            {
                "event": "interval_auto",
                "tier": tier.name,
                "minutes": minutes,
                "blocked_s": blocked_s,
                "mtbf_s": self.mtbf_s,
            }
        )


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, dict[str, Any], str]]:
    """(DCP's flattened key, container, key) of every leaf of a nested state dict (as `reshard` walks it)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", tree, key))
    return out


def _module_of(fqn: str) -> str:
    """The layer (`layers.<i>`) or top-level module a model weight's flattened key is in: what a pipeline stage
    holds whole or not at all."""
    parts = fqn.removeprefix("train.model.").split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else parts[0]


def _weight_name(fqn: str) -> str:
    return fqn.removeprefix("train.model.").removeprefix("train.")


def _vocab_weights(model: Any) -> list[str]:
    """The family's weights whose rows are the (padded) vocabulary: the embedding and an untied head, asked of
    its shapes with a row count no other dimension has. None when the fingerprint names no known family."""
    try:
        shape = ModelFingerprint.from_value(model)
        family, dims = registry.get(shape.arch), shape.dims
        rows = 1 + max(dims.d_model, dims.vocab_size, dims.context, dims.ffn_hidden, dims.q_dim) * 7919
        return [name for name, shape in family.top_shapes(dims, rows).items() if shape and shape[0] == rows]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return []


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG streams this rank draws from: the CPU's, and its GPU's (dropout masks on GPUs come from the
    CUDA generator, so without it a resumed run's dropout would differ from the uninterrupted run's)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
