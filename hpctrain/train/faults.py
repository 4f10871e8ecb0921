"""Deliberate faults for testing recovery end to end (a rank that raises, hangs or dies at a given step).

Set in the task environment, e.g.

    python -m hpctrain "+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=15:rank=1'"

(the value holds `=`, which Hydra's override grammar refuses unquoted: quote the value for Hydra, and the
whole argument for the shell). Kinds are `raise`, `exit` (os._exit(1), like a segfault), `kill` (SIGKILL, like
the OOM killer), `hang` (sleeps forever, for the watchdog) and `stall` (a straggler: sleeps `seconds=S`, then
goes on; e.g. to hold an attempt mid-run while a newer one takes the lease). A trailing `:once`
(`"+cluster.env.HPCTRAIN_INJECT_FAULT='raise:step=15:rank=1:once'"`) fires only in the first attempt of the
run (a marker in the run directory), so a resubmission succeeds. Unset, nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.records.paths import RunPaths

VARIABLE = "HPCTRAIN_INJECT_FAULT"
KINDS = ("raise", "exit", "kill", "hang", "stall")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    once: bool = False
    seconds: float = 0.0  # `stall` only

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get(VARIABLE)
        if not spec:
            return None
        kind, *fields = spec.split(":")
        once = "once" in fields
        values = dict(f.split("=", 1) for f in fields if f != "once")
        if kind not in KINDS:
            raise ValueError(f"{VARIABLE}={spec!r}: kind must be one of {', '.join(KINDS)}")
        if kind == "stall" and float(values.get("seconds", 0)) <= 0:
            raise ValueError(f"{VARIABLE}={spec!r}: stall needs seconds=S, S > 0")
        return cls(kind, int(values["step"]), int(values.get("rank", 0)), once, float(values.get("seconds", 0)))

    def maybe_fire(self, step: int, rank: int, run_dir: Path) -> None:
        if step != self.step or rank != self.rank:
            return
        marker = RunPaths(run_dir).faults / f"{self.kind}-{self.step}-{self.rank}.fired"
        if self.once:
            if marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at step {step} on rank {rank}")
        if self.kind == "exit":
            os._exit(1)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stall":
            time.sleep(self.seconds)
            return
        while True:
            time.sleep(60)
