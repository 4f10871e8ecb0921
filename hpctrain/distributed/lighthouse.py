"""torchft's lighthouse (the replica groups' quorum server) in a process of its own, started by the node agent
that hosts the rendezvous store.

Not inside the agent: the agent forks the workers, and a child forked from a process in which the lighthouse's
runtime runs its threads inherits that runtime's state without its threads. Measured on the dev cluster
(bench/bench_replicas.py): the workers forked on the lighthouse's node crashed (SIGSEGV) or hung for the whole
collective timeout when they healed through torchft's clients, and stalled the other group with them. The process
reads its stdin until it closes: it ends with the agent, however the agent ends.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

SERVE = """
import sys
from torchft._torchft import LighthouseServer
bind, min_replicas, join_ms, heartbeat_ms = sys.argv[1], *map(int, sys.argv[2:5])
server = LighthouseServer(
    bind=bind, min_replicas=min_replicas, join_timeout_ms=join_ms, heartbeat_timeout_ms=heartbeat_ms
)
print(server.address(), flush=True)
sys.stdin.read()
server.shutdown()
"""


@dataclass
class LighthouseProcess:
    """A running lighthouse: its process and the address it serves (`http://host:port`)."""

    proc: subprocess.Popen[str]
    address: str

    @classmethod
    def start(cls, bind: str, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> LighthouseProcess:
        """Start one and wait until it serves (its address on stdout); RuntimeError when it does not."""
        args = (bind, str(min_replicas), str(join_timeout_ms), str(heartbeat_timeout_ms))
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        if not address:
            proc.kill()
            raise RuntimeError(f"torchft's lighthouse did not start on {bind} (exit code {proc.wait()})")
        return cls(proc, address)

    def stop(self) -> None:
        """End it (closing its stdin), or kill it when it does not end in 5 s."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
