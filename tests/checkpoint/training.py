"""Run the real per-task training function on forked gloo ranks, with optional fault injection.

Each rank calls `hpctrain.train.loop._train`, the function every Slurm or local task runs, with the config
the parent composed. Hooks patch the child process only (it is a fork), to record the sample ids each rank
consumes, to deliver a signal at a given step, to kill a rank in the middle of a save, or to give each simulated
node a directory of its own for a node-local tier.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

from hpctrain.config.layout import resolve_layout
from hpctrain.data.loader import BatchReader
from hpctrain.data.sampler import step_samples
from hpctrain.distributed.environment import DistEnv
from hpctrain.records.lease import StaleAttempt, take_lease
from hpctrain.train import loop
from tests.distributed_harness import run_distributed


def _rank_main(rank: int, world: int, config: dict[str, Any], run_dir: str, faults: dict[str, Any]) -> Any:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, force=True, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s"
    )
    for tier in config["checkpoint"]["tiers"]:  # each simulated node sees a directory of its own, as nodes do
        if tier["name"] in faults.get("node_local", ()):
            tier["path"] = f"{tier['path']}/node{rank // faults.get('ranks_per_node', 1)}"
    cfg = loop.load_config(config)
    env = DistEnv(rank, rank, world, world, 0, 1, "127.0.0.1", 0, "localhost", "test")
    original = BatchReader.batches

    def recording(reader: BatchReader, consumed: int) -> Any:
        """At the start of each step, on the training thread (the reader reads ahead in its own)."""
        samples = step_samples(consumed, reader.global_batch, reader.dp, reader.dp_rank)
        batch = original(reader, consumed)
        with open(Path(run_dir) / f"samples.rank{rank}.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {
                        "consumed": consumed,
                        "dp_rank": reader.dp_rank,
                        "samples": list(samples),
                        "tokens": row_sums(batch),
                    }
                )
                + "\n"
            )
        if faults.get("signal_at") == consumed // reader.global_batch and rank == faults.get("signal_rank", 0):
            os.kill(os.getpid(), faults.get("signum", signal.SIGUSR2))
        if faults.get("lease_taken_at") == consumed // reader.global_batch and rank == 0:  # a newer attempt starts
            take_lease(Path(run_dir), "newer-attempt")
        return batch

    BatchReader.batches = recording
    if "kill_rank_in_save" in faults:
        from hpctrain.checkpoint.manager import CheckpointManager

        start = CheckpointManager._start

        def killing_start(self: Any, tier: Any, step: int, *args: Any) -> None:
            start(self, tier, step, *args)
            if rank == faults["kill_rank_in_save"] and step == faults["kill_step"]:
                os.kill(os.getpid(), signal.SIGKILL)  # dies with its background write half done

        CheckpointManager._start = killing_start
    try:
        return loop._train(cfg, resolve_layout(cfg), Path(run_dir), env)
    except loop.Preempted as stopped:
        return {"preempted": str(stopped)}
    except StaleAttempt as stale:
        return {"stale": str(stale)}


def train(world: int, config: dict[str, Any], run_dir: Path, timeout: float = 240, **faults: Any) -> list[Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_distributed(_rank_main, world, config, str(run_dir), faults, timeout=timeout)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The loss of each step; a step redone after a resume keeps its last value."""
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def row_sums(batch: Any) -> list[int]:
    """CRC32 of each sample's seq_len + 1 tokens in a [2, microbatches, micro_batch, seq] batch, in order."""
    seq = batch.shape[-1]
    x, y = batch[0].reshape(-1, seq), batch[1].reshape(-1, seq)
    return [zlib.crc32(torch.cat([a, b[-1:]]).numpy().tobytes()) for a, b in zip(x, y)]


def consumed_tokens(run_dir: Path) -> dict[int, int]:
    """Sample id -> the CRC32 of the tokens the rank that trained on it read (the last reading wins)."""
    out: dict[int, int] = {}
    for f in sorted(run_dir.glob("samples.rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out.update(zip(r["samples"], r["tokens"]))
    return out


def consumed_samples(run_dir: Path) -> list[int]:
    """Every sample id any rank consumed, in step order, from the recorded sample files."""
    rows = [
        json.loads(line) for f in sorted(run_dir.glob("samples.rank*.jsonl")) for line in f.read_text().splitlines()
    ]
    by_step: dict[int, set[int]] = {}
    for r in rows:
        by_step.setdefault(r["consumed"], set()).update(r["samples"])
    return [s for consumed in sorted(by_step) for s in sorted(by_step[consumed])]
