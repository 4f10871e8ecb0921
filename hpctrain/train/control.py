"""The per-step control plane: everything ranks must agree on at a step boundary, in one vector.

Stop signals, checkpoint agreement (which saves every rank has finished, whether a clock-timed tier is due)
and straggler probes each used to cost a collective of their own, some of them over gloo across every rank
(at 4,096 ranks a gloo ring all-reduce is 8,190 sequential TCP hops: 0.15-0.4 s while the GPUs idle), and the
stop flag's CPU tensor on the NCCL default group crashed every multi-GPU run at the end of step 1. Now each
part contributes values that mean something when summed over ranks (counts, or a rank's own slots), and the
engine carries the vector in the one all-reduce it does every step for the loss and the gradient norm, on its
own device. The vector's layout, identical on every rank:

    [SIGUSR2 count, SIGTERM count, lease lost] + checkpoint values (CheckpointManager.control_values) + probe
    block (RunMonitor.control_values: 2 x world on probe steps, empty otherwise)

"lease lost" is rank 0's: a newer attempt of the run took the lease, as rank 0's LeaseWatch thread last read
it (hpctrain.records.lease): no file is read on the step's path, every rank still stops at the same boundary.

Values are taken before the step, so what happens during a step (a signal, a background write finishing) is
acted on at the next boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.health.monitor import RunMonitor
from hpctrain.records.lease import LeaseWatch
from hpctrain.train.preemption import StopFlag


@dataclass(frozen=True)
class Agreed:
    """The step's control values as every rank sees them."""

    signum: int | None  # the stop signal some rank received (None: go on)
    stale: bool  # a newer attempt holds the run: stop without writing
    checkpoint: list[float]  # for CheckpointManager.after_step
    probes: list[float] | None  # for RunMonitor.after_step (probe steps only)


class StepControl:
    def __init__(
        self, stop: StopFlag, ckpt: CheckpointManager, monitor: RunMonitor, lease: LeaseWatch | None = None
    ) -> None:
        self.stop, self.ckpt, self.monitor = stop, ckpt, monitor
        self.lease = lease  # rank 0's watch of the lease taken at start; None on the other ranks
        self._sizes: tuple[int, int] = (0, 0)

    def values(self, step: int) -> list[float]:
        """This rank's contribution for step `step` (1-based: the step about to run)."""
        checkpoint = self.ckpt.control_values(time.monotonic())
        probes = self.monitor.control_values(step)
        self._sizes = (len(checkpoint), len(probes))
        lost = float(self.lease is not None and self.lease.lost())
        return self.stop.control_values() + [lost] + checkpoint + probes

    def decode(self, summed: list[float]) -> Agreed:
        n_ckpt, n_probes = self._sizes
        return Agreed(
            signum=StopFlag.agreed(summed[:2]),
            stale=summed[2] > 0,
            checkpoint=summed[3 : 3 + n_ckpt],
            probes=summed[3 + n_ckpt : 3 + n_ckpt + n_probes] or None,
        )
