"""A suspended job is not a dead node (issue 29): `scontrol suspend` stops every process of the job (SIGSTOP),
`scontrol resume` continues them (SIGCONT) in no set order. A watcher (a hot spare waiting for a vacancy, a
training agent's PeerWatch) that continues first must not take its peers' old beats for a silence: their
holders beat again a moment later. Real processes stopped and continued by signal, beating into a real
TCPStore; each watcher runs in a child process of its own, as on a node."""

from __future__ import annotations

import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.distributed import spares

REPO = Path(__file__).resolve().parent.parent
JOB = "29"
STOPPED_FOR_S = spares.VACANT_S * 2  # well past the stale limit
# The holders continue a moment after the watcher (the node continued 15 ms after the spare; here a
# second, so that the watcher surely reads the old beats first: still far below VACANT_S).
HOLDER_LATER_S = 1.0

CHILD = r"""
import json, logging, sys, time
import torch.distributed  # before any thread connects: "ready" then means beating, watching
from hpctrain.distributed import spares

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the watcher's log, on stderr
role, port = sys.argv[1], int(sys.argv[2])


def ready(*slots):
    store = spares.connect("127.0.0.1", port, 30)
    while not all(store.check([spares._key("29", "alive", slot)]) for slot in slots):
        time.sleep(0.05)
    print("ready", flush=True)


if role == "holder":  # beats for each slot given (one process: one node, or several stopped together)
    slots = [int(a) for a in sys.argv[3:]]
    for slot in slots:
        spares.Heartbeat("127.0.0.1", port, "29", slot, slot, 30).start()
    ready(*slots)
    time.sleep(3600)
elif role == "spare":  # node 2 of a job whose slots 0 and 1 train
    store = spares.connect("127.0.0.1", port, 30)
    print("ready", flush=True)
    slot = spares.wait_for_vacancy(store, "29", 2, node=2)
    print(json.dumps({"slot": slot, "time": time.time()}), flush=True)
elif role == "watch":  # the agent of slot 0 in a job that may shrink to 1 of its 3 slots, beating itself
    spares.Heartbeat("127.0.0.1", port, "29", 0, 0, 30).start()
    told = lambda verdict, slot, lost: print(json.dumps({"silent": slot, "time": time.time()}), flush=True)
    spares.PeerWatch("127.0.0.1", port, "29", 3, 0, 30, lambda: {1, 2}, told, min_nodes=1).start()
    ready(0)
    time.sleep(3600)
elif role == "call":  # one store call, bounded, that waits for a key the test sets; the client's own timeout given
    import datetime
    client_s, bound_s, key = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=client_s))
    print("ready", flush=True)
    try:
        spares.within(bound_s, client.wait, [key])
        print(json.dumps({"answered": True}), flush=True)
    except Exception as exc:
        print(json.dumps({"answered": False, "why": str(exc)}), flush=True)
"""


class Child:
    """A child process running one role of CHILD; its stdout lines as they come."""

    def __init__(self, role: str, port: int, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, role, str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float) -> str | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def ready(self, timeout: float = 60) -> None:
        assert self.line(timeout) == "ready", "".join(self.err)

    def said(self, text: str, timeout: float = 5.0) -> bool:
        """Whether its stderr (its log) holds `text`, within `timeout`."""
        deadline = time.monotonic() + timeout
        while text not in "".join(self.err) and time.monotonic() < deadline:
            time.sleep(0.05)
        return text in "".join(self.err)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def store() -> Iterator[object]:
    from torch.distributed import TCPStore

    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.end()


def owner(store: object, slot: int) -> str:
    return store.get(spares._key(JOB, "owner", slot)).decode()  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_a_spare_that_continues_first_after_a_suspension_takes_no_slot(store, children) -> None:
    """The issue's case: the spare woke first, saw slot 1's beat 30.4 s old and took the slot; node 1's agent
    continued 15 ms later and trained on in it: two holders of one slot, and no spare left."""
    for slot in (0, 1):
        assert spares.hold(store, JOB, slot, node=slot)
    holders = Child("holder", store.port, "0", "1")
    spare = Child("spare", store.port)
    children += [holders, spare]
    holders.ready()
    spare.ready()
    time.sleep(1.5)  # the spare has seen both slots beat
    for child in (holders, spare):  # scontrol suspend
        child.signal(signal.SIGSTOP)
    time.sleep(STOPPED_FOR_S)
    spare.signal(signal.SIGCONT)  # scontrol resume: the spare first
    time.sleep(HOLDER_LATER_S)
    holders.signal(signal.SIGCONT)
    took = spare.line(spares.VACANT_S + 2.0)
    assert took is None, f"the spare took a slot of a suspended job: {took}"
    assert (owner(store, 0), owner(store, 1)) == ("0", "1")
    spares.announce_end(store, JOB)  # the run ends: the spare that was never needed leaves
    assert json.loads(spare.line(10) or "{}").get("slot", "missing") is None, "".join(spare.err)
    assert spare.said("this process was stopped")  # it says why it judged nothing


@pytest.mark.timeout(120)
def test_a_holder_that_died_while_the_spare_was_stopped_is_replaced_once_its_silence_is_seen(store, children) -> None:
    """A stopped spare still replaces a node that died meanwhile: VACANT_S after it continued, not at once
    (what it saw before its stop counts for nothing)."""
    for slot in (0, 1):
        assert spares.hold(store, JOB, slot, node=slot)
    alive = spares.Heartbeat("127.0.0.1", store.port, JOB, 0, 0, 10).start()  # node 0 beats throughout
    doomed = Child("holder", store.port, "1")
    spare = Child("spare", store.port)
    children += [doomed, spare]
    try:
        doomed.ready()
        spare.ready()
        time.sleep(1.5)
        doomed.signal(signal.SIGKILL)  # node 1 dies,
        time.sleep(2 * spares.POLL_S)  # the spare reads its last beat,
        spare.signal(signal.SIGSTOP)  # and is stopped before that silence is long enough to judge
        time.sleep(STOPPED_FOR_S)
        continued = time.time()
        spare.signal(signal.SIGCONT)
        took = json.loads(spare.line(spares.VACANT_S + 10.0) or "{}")
    finally:
        alive.stop()
    assert took.get("slot") == 1, (took, "".join(spare.err))
    assert took["time"] - continued >= spares.VACANT_S - 0.1, took["time"] - continued
    assert owner(store, 1) == "2"


@pytest.mark.timeout(120)
def test_a_training_agent_that_continues_first_stops_no_workers_after_a_suspension(store, children) -> None:
    """The shrink path (PeerWatch) uses the same rule: after a suspension the agent that continued first must
    not stop its workers over peers that continue a moment later; a peer that then really goes silent is
    still noticed."""
    watch = Child("watch", store.port)
    peers = Child("holder", store.port, "1", "2")
    children += [watch, peers]
    watch.ready()
    peers.ready()
    time.sleep(1.5)  # the agent has seen its peers beat
    for child in (watch, peers):
        child.signal(signal.SIGSTOP)
    time.sleep(STOPPED_FOR_S)
    watch.signal(signal.SIGCONT)
    time.sleep(HOLDER_LATER_S)
    peers.signal(signal.SIGCONT)
    told = watch.line(spares.VACANT_S + 2.0)
    assert told is None, f"the agent stopped its workers over a suspended job: {told}"
    assert watch.said("this process was stopped"), "".join(watch.err)
    peers.signal(signal.SIGKILL)  # now nodes 1 and 2 really die
    silent = {json.loads(watch.line(spares.VACANT_S + 10.0) or "{}").get("silent") for _ in range(2)}
    assert silent == {1, 2}, "".join(watch.err)


@pytest.mark.timeout(60)
def test_a_store_call_in_flight_at_the_suspension_is_not_given_up_at_the_resume(store, children) -> None:
    """Every store call of the agents is bounded (spares.within: a host that lost power never answers). A call
    in flight when the job was suspended for longer than that bound is answered once the store's host
    continues too: the time the caller spent stopped must not count, or every agent would take the store
    for dead at `scontrol resume` (and move it)."""
    call = Child("call", store.port, "60", "3", "29/answer")  # bounded to 3 s
    children.append(call)
    call.ready()
    time.sleep(0.3)  # the call is waiting
    call.signal(signal.SIGSTOP)
    time.sleep(4.0)  # longer than its 3 s
    call.signal(signal.SIGCONT)
    time.sleep(0.5)  # the store's host continues a moment later, and answers
    store.set("29/answer", "1")
    assert json.loads(call.line(20) or "{}") == {"answered": True}, "".join(call.err)


@pytest.mark.timeout(120)
def test_a_store_call_whose_own_timeout_ran_out_while_stopped_is_made_again(store, children) -> None:
    """The store client's own socket timeout counts wall time: a read in flight at `scontrol suspend` times out
    at `scontrol resume` (CI saw a training agent give its workers up so). Failing across a stop, the call is
    made once more, and the store, continued a moment later, answers it."""
    call = Child("call", store.port, "2", "10", "29/late")  # its client gives up after 2 s
    children.append(call)
    call.ready()
    time.sleep(0.3)  # the call is waiting
    call.signal(signal.SIGSTOP)
    time.sleep(4.0)  # past the client's 2 s and a stop for spares._wait_running
    call.signal(signal.SIGCONT)
    time.sleep(0.5)
    store.set("29/late", "1")
    assert json.loads(call.line(20) or "{}") == {"answered": True}, "".join(call.err)
    assert call.said("failed across a stop of this process")
