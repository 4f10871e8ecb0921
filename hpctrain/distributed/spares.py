"""Hot spare nodes: agents that wait outside the rendezvous until a node of the job is gone.

A spare agent cannot simply wait in torch's rendezvous: the running agents see a node waiting and restart
every worker to admit it, about every second, for ever (measured here, shared/facts/in-allocation-restart.md).
So the job's nodes are `slots` (cluster.nodes of them): every agent that trains first takes its slot with a
compare-and-set on the slot's owner, then beats a counter in the rendezvous store (the TCP store of torch's
c10d rendezvous, under keys of its own). A spare watches the counters; when one stops moving for `VACANT_S`
(the node died with its agent), the spare claims the slot with one compare-and-set on its owner (two spares
never take the same one), beats for it, and only then joins the rendezvous, where the surviving agents wait
for the job's node count. When the store itself moved to another node (its host died, `elastic.py`), every
slot starts anew there: a slot nobody took within `VACANT_S` of the spare's arrival is the dead node's. When
the run ends, its agents say so in the store and the spares that were never needed leave.
A job that may shrink and has no spare uses the same counters the other way round (`PeerWatch`): a training
agent that sees another node's counter stop restarts the group, since a node that loses power leaves its
peers blocked in collectives rather than failing them.
A suspension is not a death: `scontrol suspend` stops every process of the job (SIGSTOP) and `scontrol resume`
continues them, in no set order. A watcher that wakes first sees counters that did not move for as long as it
slept, while their holders, stopped like it, beat again a moment later. So a watcher measures silence only
across its own polls that came on time (`Silences`): one that comes much later than due means this process
was stopped itself (the monotonic clock runs on while a process is stopped), and every counter is read afresh
before any is judged.
"""

from __future__ import annotations

import abc
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

BEAT_S = 0.5  # how often a slot's holder moves its counter
VACANT_S = 3.0  # a counter that has not moved for this long: its node is gone
POLL_S = 0.25
# A watcher's poll that comes this much later than due: the watcher itself was stopped meanwhile (the job
# suspended, SIGSTOP, a paused VM), so what it last saw of the counters says nothing about their holders now.
STOPPED_S = VACANT_S / 2
READ_TIMEOUT_S = 10.0  # a store host that does not answer a read this long is gone (torch's default: 60 s)
CALL_MARGIN_S = 2.0  # beyond the client's own timeout, before a call is given up on (see `within`)
WAIT_SLICE_S = 0.5  # `within` waits for a call in slices this long (a far longer one: the caller was stopped)


def _key(job_id: str, *parts: object) -> str:
    return "/".join(["hpctrain", job_id, *map(str, parts)])


def connect(host: str, port: int, timeout_s: float) -> BoundedStore:
    """A client of the rendezvous store: waits up to `timeout_s` for the store to open; then each call gets
    READ_TIMEOUT_S (a store whose host lost power never answers: its clients must notice, not block for the
    whole join timeout)."""
    from torch.distributed import TCPStore

    # its handshake, too, can wait for ever on a port that takes connections and never answers
    store = within(
        timeout_s + CALL_MARGIN_S,
        TCPStore,
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    store.set_timeout(datetime.timedelta(seconds=min(timeout_s, READ_TIMEOUT_S)))
    return BoundedStore(store, min(timeout_s, READ_TIMEOUT_S) + CALL_MARGIN_S)


class StoreSilent(TimeoutError):
    """The store did not answer a call in time: its host is gone or hangs."""


def within(seconds: float, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)` on a store client, given `seconds` at most, else StoreSilent.

    torch's TCPStore client keeps its timeout only while it waits for a reply: a read that timed out then
    cancels its wait and blocks in recv() for the cancellation's own reply, with no timeout, and holds the
    client's lock meanwhile. Against a host that lost power (or hangs) that is forever, for every later call of
    that client too. So the call runs in a daemon thread, left behind when it does not return in time.

    A call that fails across a stop of this process (a suspended job) is made once more: the client's own socket
    timeout counts wall time, so a read in flight at `scontrol suspend` times out at `scontrol resume`, while
    the store's host, stopped too, answers once both continue (seen in CI: an agent gave its workers up so)."""
    outcome, stopped = _call_running(seconds, call, *args, **kwargs)
    if "error" in outcome and stopped:
        log.warning(
            "a rendezvous store call failed across a stop of this process (the job suspended?): %s; once more",
            outcome["error"],
        )
        outcome, _ = _call_running(seconds, call, *args, **kwargs)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _call_running(seconds: float, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[dict[str, Any], bool]:
    """`call` in a daemon thread: its outcome ("value" or "error") and whether this process was stopped
    meanwhile; StoreSilent when it has not returned after `seconds` of this process running."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = call(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="hpctrain-store-call", daemon=True).start()
    finished, stopped = _wait_running(done, seconds)
    if not finished:
        raise StoreSilent(f"the rendezvous store did not answer within {seconds:.0f} s")
    return outcome, stopped


def _wait_running(done: threading.Event, seconds: float) -> tuple[bool, bool]:
    """Wait up to `seconds` for `done`, counting only time this process ran: a stretch it spent stopped (a
    suspended job: the store's host, stopped too, answers once both continue) counts for nothing, or a call in
    flight at `scontrol suspend` would give the store up at `scontrol resume`. Waits in slices: a slice that
    took far longer than asked was a stop. Returns (done, whether a stop was seen)."""
    left, last, stopped = seconds, time.monotonic(), False
    while left > 0:
        finished = done.wait(min(left, WAIT_SLICE_S))
        now = time.monotonic()
        took, last = now - last, now
        if took > WAIT_SLICE_S + STOPPED_S:
            stopped, took = True, WAIT_SLICE_S
        if finished:
            return True, stopped
        left -= took
    return done.is_set(), stopped


class BoundedStore:
    """A store client whose every call returns within `seconds` or raises StoreSilent; once one has not, the
    client is stuck for good (see `within`) and every later call raises at once."""

    def __init__(self, store: Any, seconds: float) -> None:
        self._store, self._seconds, self._silent = store, seconds, False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def bounded(*args: Any, **kwargs: Any) -> Any:
            if self._silent:
                raise StoreSilent("the rendezvous store stopped answering earlier")
            try:
                return within(self._seconds, method, *args, **kwargs)
            except StoreSilent:
                self._silent = True
                raise

        return bounded


class _StoreThread(abc.ABC):
    """A daemon thread with a store client of its own, until `stop()`. A store that goes away (with its node)
    ends it quietly: the agents move the store and start new ones there."""

    name = "hpctrain-store-thread"

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.args = (host, port, timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)

    def start(self) -> _StoreThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _main(self) -> None:
        try:
            self._run(connect(*self.args))
        except Exception as exc:
            log.info("%s stopped: %s", self.name, exc)

    @abc.abstractmethod
    def _run(self, store: Any) -> None:
        """The thread's work with its store client, until `self._stop` is set."""


class Heartbeat(_StoreThread):
    """The holder of a slot moves its counter every BEAT_S."""

    name = "hpctrain-heartbeat"

    def __init__(self, host: str, port: int, job_id: str, slot: int, node: int, timeout_s: float) -> None:
        super().__init__(host, port, timeout_s)
        self.key = _key(job_id, "alive", slot)
        self.node = node

    def _run(self, store: Any) -> None:
        count = 0
        while not self._stop.is_set():
            store.set(self.key, f"{self.node}:{count}")
            count += 1
            self._stop.wait(BEAT_S)


def announce_end(store: Any, job_id: str) -> None:
    """The run is over (done or given up): spares that were never needed leave."""
    store.set(_key(job_id, "ended"), "1")


def hold(store: Any, job_id: str, slot: int, node: int) -> bool:
    """As a training agent: take `slot` in this store; False when a spare took it first (this agent, slow to
    come back after the store moved, is then the spare)."""
    return store.compare_set(_key(job_id, "owner", slot), "", str(node)).decode() == str(node)


class Silences:
    """How long each slot's counter has not moved, as one watcher saw it over its own polls that came on time.

    Each poll starts with `poll()`. A poll that comes more than STOPPED_S later than due (POLL_S after the last
    one began) means this watcher was stopped in between: every process of a suspended job is, and the
    monotonic clock runs on meanwhile. The counters it remembers are then as old as its sleep, and their
    holders, stopped with it, beat again a moment after they continue; so it forgets them all, and silence is
    measured again from values read after the stop. (A poll whose reads alone take that long, a store that
    slow, forgets too: such a watcher cannot tell its own stop from the store's delay, and judges no one.)
    `extra` is kept beside each value (PeerWatch: this node's workers at that moment)."""

    def __init__(self, who: str, poll_s: float = POLL_S) -> None:
        self.who, self.poll_s = who, poll_s
        self.seen: dict[int, tuple[str, float, Any]] = {}
        self.last: float | None = None

    def poll(self) -> float:
        """The start of a poll: its monotonic time."""
        now = time.monotonic()
        late = 0.0 if self.last is None else now - self.last - self.poll_s
        if late > STOPPED_S:
            log.warning(
                "%s: its own poll came %.1f s late: this process was stopped (the job suspended?), "
                "not the slots' holders; their beats are read afresh before any is judged",
                self.who,
                late,
            )
            self.seen.clear()
        self.last = now
        return now

    def silent_for(self, slot: int, value: str, now: float, extra: Any = None) -> float:
        """Seconds `slot`'s counter has shown `value`, as seen since this watcher's last stop (0: it moved)."""
        if slot not in self.seen or self.seen[slot][0] != value:
            self.seen[slot] = (value, now, extra)
            return 0.0
        return now - self.seen[slot][1]

    def extra(self, slot: int) -> Any:
        return self.seen[slot][2]


def wait_for_vacancy(store: Any, job_id: str, slots: int, node: int, moved: bool = False) -> int | None:
    """As spare `node`: the slot whose holder died and that this spare claimed, or None when the run ended.
    In a store that `moved`, a slot no agent took within VACANT_S is vacant too (its holder died with the
    store's old host), as long as another slot is held (else no one is left to train with: the run is over).
    A suspended job is no vacancy (`Silences`). A store that stops answering raises: the agent moves to the
    next one."""
    silences = Silences(f"spare node {node}")
    while True:
        if store.check([_key(job_id, "ended")]):
            return None
        now = silences.poll()
        beats = {slot: _beat(store, job_id, slot) for slot in range(slots)}
        for slot, value in beats.items():
            if not value and not (moved and any(beats.values())):
                continue  # its holder has not started yet
            silent = silences.silent_for(slot, value, now)
            if silent > VACANT_S and _claim(store, job_id, slot, value, node):
                log.warning(
                    "spare node %d takes slot %d (%s %.1f s)",
                    node,
                    slot,
                    "its holder stopped beating" if value else "nobody took it in the moved store",
                    silent,
                )
                return slot
        time.sleep(POLL_S)


class PeerWatch(_StoreThread):
    """A training agent's eye on the other slots, for a job that may shrink (`elastic.min_nodes`) and has no
    spare to notice: a node that loses power goes silent, its peers' collectives block instead of failing, and
    nothing else would notice before the hang watchdog's limit. When another slot's counter stops moving for
    VACANT_S (and the run has not ended), `on_silent(slot)` runs once for that slot, unless this node's
    `workers()` (their pids) changed since the slot's last beat: the group restarted already (a node whose
    processes died closed its connections, and its peers failed at once). The agent then stops its own
    workers, which restarts the group without the silent node."""

    name = "hpctrain-peer-watch"

    def __init__(
        self,
        host: str,
        port: int,
        job_id: str,
        slots: int,
        own: int,
        timeout_s: float,
        workers: Callable[[], set[int]],
        on_silent: Callable[[int], None],
    ) -> None:
        super().__init__(host, port, timeout_s)
        self.job_id, self.slots, self.own = job_id, slots, own
        self.workers, self.on_silent = workers, on_silent

    def _run(self, store: Any) -> None:
        # slot -> its last beat, when, our workers then; a suspension of the job is no silence (`Silences`)
        silences = Silences(f"node of slot {self.own}")
        told: set[int] = set()
        while not self._stop.wait(POLL_S):
            if store.check([_key(self.job_id, "ended")]):
                return
            now, workers = silences.poll(), self.workers()
            for slot in range(self.slots):
                value = _beat(store, self.job_id, slot)
                if slot == self.own or not value or slot in told:
                    continue  # never beat here (not started, or the store moved): not silent
                silent = silences.silent_for(slot, value, now, workers)
                if silent > VACANT_S:
                    told.add(slot)
                    if workers != silences.extra(slot):
                        continue  # new workers since its last beat: the group restarted without it
                    log.warning(
                        "slot %d (node %s) has been silent for %.1f s: stopping this node's workers",
                        slot,
                        value.split(":")[0],
                        silent,
                    )
                    self.on_silent(slot)


def _beat(store: Any, job_id: str, slot: int) -> str:
    key = _key(job_id, "alive", slot)
    return store.get(key).decode() if store.check([key]) else ""


def _claim(store: Any, job_id: str, slot: int, beat: str, node: int) -> bool:
    """One compare-and-set on the slot's owner: the dead holder (by its last beat; none: nobody) -> this spare."""
    holder = beat.split(":")[0] if beat else ""
    return store.compare_set(_key(job_id, "owner", slot), holder, str(node)).decode() == str(node)
