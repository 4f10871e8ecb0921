"""The training loop's side of replica groups (`recovery=replicas`, docs/replicas.md).

A group's workers train like a job of their own (their own process group, checkpoints and records: group 0 in
the run directory, group g in `replicas/g<g>/` of it, its checkpoints under its own run id), and meet the other
groups once per step through torchft (hpctrain.distributed.replicas): the quorum before the step (a heal from
a peer when this group is behind), the gradient average inside the engine's step, the vote before the
optimizer step. This module keeps the loop's position (step, samples consumed) in the state a healing peer
receives, and turns the quorums into metrics and events.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.storage import committed_in
from hpctrain.config.schema import CheckpointConfig, Config
from hpctrain.distributed.replicas import OuterSync, ReplicaPlace, ReplicaSync, from_wire, group_slice, to_wire
from hpctrain.records.jobs import read_completed
from hpctrain.records.paths import tier_directory

log = logging.getLogger("hpctrain")

REPLICAS_DIR = "replicas"


def group_run_dir(run_dir: Path, place: ReplicaPlace | None) -> Path:
    """Where a group keeps its records: the run directory for group 0 (the run's metrics, W&B, ledger), a folder
    of it for the others (their own lease, failures, metrics and relative checkpoint tiers)."""
    if place is None or place.group == 0:
        return run_dir
    return run_dir / REPLICAS_DIR / f"g{place.group}"


def main_run_dir(group_dir: Path, place: ReplicaPlace) -> Path:
    """The run directory, from a group's folder (`group_run_dir`'s inverse)."""
    return group_dir if place.group == 0 else group_dir.parent.parent


def group_config(config: dict[str, Any], place: ReplicaPlace | None) -> dict[str, Any]:
    """Group g > 0's config: its checkpoints under a run id of its own (absolute tiers are shared by path), no
    W&B (group 0 reports the run; the others' metrics stay in their folder)."""
    if place is None or place.group == 0:
        return config
    run = dict(config["run"])
    run["id"] = f"{run['id']}-replica{place.group}"
    return {**config, "run": run, "tracking": {**config["tracking"], "mode": "disabled"}}


def group_dirs(main: Path, groups: int) -> list[Path]:
    """Every group's folder, by group, from the run directory."""
    return [main if g == 0 else main / REPLICAS_DIR / f"g{g}" for g in range(groups)]


def run_completed(main: Path, groups: int, max_steps: int) -> bool:
    """Some group finished the run (its COMPLETED.json at train.max_steps): a group started now has nothing to
    train, and alone it would train the run again from its last checkpoint."""
    return any(
        (done := read_completed(d)) is not None and int(done.get("step", 0)) >= max_steps
        for d in group_dirs(main, groups)
    )


def newest_saved_step(main: Path, groups: int, checkpoint: CheckpointConfig, run_id: str) -> int:
    """The newest step any group committed to a tier this node can see: a group behind it must not train alone
    (it would overtake the others with a state that lost those steps, and they would heal from it)."""
    steps = [0]
    for g, directory in enumerate(group_dirs(main, groups)):
        for tier in checkpoint.tiers:
            path, _ = tier_directory(tier.path, directory, run_id if g == 0 else f"{run_id}-replica{g}")
            steps += [c.step for c in committed_in(path, tier.name)]
    return max(steps)


class ReplicaGroup:
    """One rank's membership of the replica groups: the torchft manager, and the loop's position it heals."""

    def __init__(
        self,
        cfg: Config,
        place: ReplicaPlace,
        env: Any,
        engine: Any,
        device: torch.device,
        step: int,
        consumed: int,
        main_run_dir: Path,
    ) -> None:
        self.place, self.engine = place, engine
        self.group_batch = int(cfg.train.global_batch) // place.groups
        self.alone_timeout_s = float(cfg.recovery.quorum_timeout_s)
        # group g > 0's run id is the run's with a suffix (group_config): the run's own, for its siblings' folders
        run_id = str(cfg.run.id).removesuffix(f"-replica{place.group}")
        self.floor = newest_saved_step(main_run_dir, place.groups, cfg.checkpoint, run_id)
        self.step, self.consumed = step, consumed
        self.retries = 0
        self.quorum_s = 0.0
        self.trained = False  # this group took part in a quorum already (then no wait for peers)
        self.participants = place.groups
        self.events: list[dict[str, Any]] = []
        # The state a peer receives: the engine's live tensors (parameters and optimizer states, as local
        # shards), named once here on the training thread; the manager's thread only sends them.
        self._wire = to_wire(engine.state_dict())
        self.sync = ReplicaSync(
            cfg.recovery,
            place,
            env.rank,
            env.world_size,
            env.master_addr,
            env.master_port,
            device,
            state=self._state,
            load=self._load,
        )
        self.sync.set_step(step)
        self.max_steps = int(cfg.train.max_steps)
        self.every = int(cfg.recovery.sync_every) if cfg.recovery.mode == "diloco" else 1
        self.outer: OuterSync | None = None
        if cfg.recovery.mode == "diloco":  # the engine steps alone; the groups meet once a round
            params = [p for part in engine.model_parts for p in part.parameters()]
            self.outer = OuterSync(self.sync, params, cfg.recovery.outer_lr, cfg.recovery.outer_momentum)
        else:  # the engine averages every step's gradients across the groups
            engine.replicas = self.sync
        log.info(
            "replica group %d of %d (lighthouse %s): rank %d of %d, from step %d",
            place.group,
            place.groups,
            place.lighthouse,
            env.rank,
            env.world_size,
            step,
        )

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"engine": self._wire, "step": self.step, "consumed": self.consumed}
        if self.engine.scaler.enabled:
            state["loss_scaler"] = self.engine.scaler.state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state()
        return state

    def _load(self, received: dict[str, Any]) -> None:
        self.engine.before_update()  # a checkpoint's copy of the state in flight finishes first
        own = self.engine.state_dict()
        self.engine.load_state_dict(from_wire(received["engine"], own))
        if "loss_scaler" in received:
            self.engine.scaler.load_state_dict(received["loss_scaler"])
        self._wire = to_wire(self.engine.state_dict())  # a load may give the optimizer new tensors
        if self.outer is not None:
            self.outer.load(received["outer"])
        self.step, self.consumed = int(received["step"]), int(received["consumed"])

    def before_step(self, step: int, consumed: int) -> tuple[int, int]:
        """Join the step's quorum: (step, consumed) to train next, moved on when this group healed."""
        self.step, self.consumed = step, consumed
        self.quorum_s = 0.0
        if step % self.every and self.trained:  # DiLoCo: inside a round, no quorum (a new process: its first)
            return step, consumed
        started = time.perf_counter()
        if self.outer is not None:  # the quorum compares the groups' rounds by their first step
            self.sync.set_step(step)
        quorum = self.sync.start_step(step)
        quorum = self._wait_for_peers(quorum, step)
        self._note_quorum()
        if quorum.healed_from_step is not None and quorum.healed_from_step != self.step:  # not the start's sync
            self.events.append(
                {
                    "event": "replica_heal",
                    "step": self.step,
                    "from_step": quorum.healed_from_step,
                    "heal_s": round(quorum.heal_s, 3),
                    "quorum_s": round(quorum.joined_s, 3),
                    "group": self.place.group,
                }
            )
            log.warning(
                "replica group %d healed from a peer: step %d -> %d in %.2f s",
                self.place.group,
                quorum.healed_from_step,
                self.step,
                quorum.heal_s,
            )
        self.quorum_s = time.perf_counter() - started  # the waits for peers and a heal included
        return self.step, self.consumed

    def _note_quorum(self) -> None:
        """An event when the quorum's size changed (at the step's start, or in the step: a group lost during
        its average, averaged again without it)."""
        quorum = self.sync.last
        if quorum is None or quorum.participants == self.participants:
            return
        self.events.append(
            {
                "event": "replica_quorum",
                "step": self.step,
                "participants": quorum.participants,
                "was": self.participants,
                "quorum_id": quorum.quorum_id,
                "group": self.place.group,
            }
        )
        log.warning(
            "replica group %d: %d of %d groups in the quorum from step %d (was %d)",
            self.place.group,
            quorum.participants,
            self.place.groups,
            self.step + 1,
            self.participants,
        )
        self.participants = quorum.participants

    def _wait_for_peers(self, quorum: Any, step: int) -> Any:
        """The first quorum of a fresh run waits for every group (else the first group up trains alone and the
        others heal from it: steps of one group where all could train); a group behind the run's newest checkpoint
        never trains alone (it would overtake the others with a state that lost those steps, and they would heal
        from it). Both for recovery.quorum_timeout_s at most: then a fresh run starts with the groups there, and a
        group behind fails (its agent restarts it; the job's restart from checkpoints is the last resort)."""
        fresh, behind = step == 0 and self.floor == 0 and not self.trained, self.step < self.floor
        wanted = self.place.groups if fresh else 2 if behind else 1
        waited = time.monotonic()
        while quorum.participants < wanted:
            if time.monotonic() - waited > self.alone_timeout_s:
                if behind:
                    raise RuntimeError(
                        f"replica group {self.place.group} is at step {self.step}, behind the run's newest "
                        f"checkpoint (step {self.floor}), and no other group joined its quorum for "
                        f"{self.alone_timeout_s:.0f} s (recovery.quorum_timeout_s): it does not train alone from an "
                        "older state"
                    )
                log.warning("replica group %d: starting with %d group(s)", self.place.group, quorum.participants)
                break
            time.sleep(0.5)
            quorum = self.sync.start_step(step)
        self.floor, self.trained = 0, True  # from here on the run's progress is the quorum's
        return quorum

    def first_sample(self, consumed: int) -> int:
        """Where this group's share of the step starting at `consumed` begins."""
        return group_slice(consumed, self.place.group, self.group_batch)

    @property
    def samples_per_step(self) -> int:
        """Every group's samples: the run's global batch."""
        return self.group_batch * self.place.groups

    def after_step(self, committed: bool, done: int, consumed: int) -> None:
        self._note_quorum()  # the step's own quorums: those of its averages taken again
        if not committed:
            self.retries += 1
            return
        self.step, self.consumed = done, consumed
        if self.outer is not None and (done % self.every == 0 or done == self.max_steps):
            if not self.outer.round():
                self.events.append(
                    {"event": "diloco_round_dropped", "step": done, "group": self.place.group, "every": self.every}
                )
                log.warning("replica group %d: the DiLoCo round ending at step %d was dropped", self.place.group, done)

    def metrics(self) -> dict[str, float]:
        quorum = self.sync.last
        assert quorum is not None  # after before_step
        return {
            "replica_group": self.place.group,
            "participants": quorum.participants,
            "quorum_id": quorum.quorum_id,
            "quorum_s": self.quorum_s,  # this step's quorum (DiLoCo: a round's first step only)
            "step_retries": self.retries,
        }

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.engine.replicas = None
        self.sync.shutdown()
