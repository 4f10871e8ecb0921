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
The training agents use the same counters the other way round (`PeerWatch`, in every job of more than one
node): each watches the next `WATCHED` slots of its replica group (a ring: no store reads every counter of a
large job every poll), since a node that loses power (or hangs, or whose processes are stopped) leaves its peers
blocked in collectives rather than failing them, and a node that died with no spare left leaves them waiting in
the rendezvous for its whole join timeout. On a slot silent for `VACANT_S` (`verdict`): a hot spare still
waiting takes it (spares beat too, under a key of their own, so the watchers know one is there); else a job
that may shrink (`elastic.min_nodes`) goes on without it; else a replica group (recovery=replicas) leaves the
run to the other groups; else the job fails fast (elastic.py ends it with a record naming every node it lost:
the store keeps them, the one a spare replaced included).
A suspension is not a death: `scontrol suspend` stops every process of the job (SIGSTOP) and `scontrol resume`
continues them, in no set order. A watcher that wakes first sees counters that did not move for as long as it
slept, while their holders, stopped like it, beat again a moment later. So a watcher measures silence only
across its own polls that came on time (`Silences`): one that comes much later than due means this process
was stopped itself (the monotonic clock runs on while a process is stopped), and every counter is read afresh
before any is judged.
When the store moved (its host died), a slot nobody took there is judged by the watchers only after
`UNTAKEN_S`: a live agent may spend up to elastic.NEXT_HOST_WAIT_S on the way to the new store.
"""

from __future__ import annotations

import abc
import datetime
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
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
# In a moved store, a slot nobody took for this long is vacant to the watching agents: past the 10 s an agent
# may wait for a candidate host on its way there (elastic.NEXT_HOST_WAIT_S), with a margin.
UNTAKEN_S = 12.0
WATCHED = 3  # each training agent watches the next WATCHED slots of its group: a slot is watched by 3 agents

# What a training agent does about a silent slot of its group (`verdict`)
SPARE = "spare"  # a hot spare is waiting: it takes the slot
SHRINK = "shrink"  # elastic.min_nodes allows one node fewer: stop this node's workers, the group restarts smaller
LEAVE = "leave"  # a replica group with no spare left: it leaves the run, the other groups train on
FAIL = "fail"  # none of these: the job ends at once, with a record naming every node it lost


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
    `extra` is kept beside each value (PeerWatch: this node's workers at that moment). A key is a slot, or
    anything else whose counter is watched the same way (a spare's: `("spare", node)`)."""

    def __init__(self, who: str, poll_s: float = POLL_S) -> None:
        self.who, self.poll_s = who, poll_s
        self.seen: dict[Hashable, tuple[str, float, Any]] = {}
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

    def silent_for(self, slot: Hashable, value: str, now: float, extra: Any = None) -> float:
        """Seconds `slot`'s counter has shown `value`, as seen since this watcher's last stop (0: it moved)."""
        if slot not in self.seen or self.seen[slot][0] != value:
            self.seen[slot] = (value, now, extra)
            return 0.0
        return now - self.seen[slot][1]

    def extra(self, slot: Hashable) -> Any:
        return self.seen[slot][2]


def wait_for_vacancy(store: Any, job_id: str, slots: int, node: int, moved: bool = False) -> int | None:
    """As spare `node`: the slot whose holder died and that this spare claimed, or None when the run ended.
    In a store that `moved`, a slot no agent took within VACANT_S is vacant too (its holder died with the
    store's old host), as long as another slot is held (else no one is left to train with: the run is over).
    A suspended job is no vacancy (`Silences`). A store that stops answering raises: the agent moves to the
    next one. While it waits, the spare beats a counter of its own, so that the training agents know a spare is
    there (`PeerWatch`); a claimed slot's dead holder joins the job's lost nodes (`lost_nodes`)."""
    silences = Silences(f"spare node {node}")
    store.append(_key(job_id, "spares"), f"{node},")
    mine = _key(job_id, "spare", node)
    count = 0
    while True:
        if store.check([_key(job_id, "ended")]):
            store.set(mine, "left")
            return None
        store.set(mine, str(count))
        count += 1
        now = silences.poll()
        beats = {slot: _beat(store, job_id, slot) for slot in range(slots)}
        for slot, value in beats.items():
            if not value and not (moved and any(beats.values())):
                continue  # its holder has not started yet
            silent = silences.silent_for(slot, value, now)
            if silent > VACANT_S and _claim(store, job_id, slot, value, node):
                store.set(mine, f"took {slot}")
                if value:
                    add_lost(store, job_id, [_holder(value)])
                log.warning(
                    "spare node %d takes slot %d (%s %.1f s)",
                    node,
                    slot,
                    "its holder stopped beating" if value else "nobody took it in the moved store",
                    silent,
                )
                return slot
        time.sleep(POLL_S)


def add_lost(store: Any, job_id: str, nodes: Iterable[int]) -> None:
    """Count `nodes` among those the job lost (a failure record names them all, the first too)."""
    for node in nodes:
        store.append(_key(job_id, "lost"), f"{node},")


def lost_nodes(store: Any, job_id: str) -> set[int]:
    """Every node this job lost so far, as this store knew them."""
    return _numbers(store, _key(job_id, "lost"))


def group_left(store: Any, job_id: str, group: int) -> bool:
    """Whether replica group `group` left the run (it lost a node and no spare was left)."""
    return bool(store.check([_key(job_id, "left", group)]))


def group_over(store: Any, job_id: str, group: int) -> None:
    """Replica group `group` trained to the end (or failed for good)."""
    store.set(_key(job_id, "over", group), "1")


def groups_over(store: Any, job_id: str, groups: int, first: int = 0) -> bool:
    """Whether every one of `groups` replica groups (from `first` on) is over or left the run."""
    return all(
        store.check([_key(job_id, "over", g)]) or store.check([_key(job_id, "left", g)])
        for g in range(first, first + groups)
    )


def wait_for_groups(store: Any, job_id: str, groups: int, group_size: int) -> None:
    """As the host of the store (and of the replica groups' lighthouse): until every group is over, done or left,
    or gone: every slot of it silent for VACANT_S with no spare waiting (a group of one node that died has no
    one left to say it left)."""
    silences = Silences("the store's host")
    while True:
        now = silences.poll()
        spare = _spare_waiting(store, job_id, silences, now)
        silent = [
            silences.silent_for(slot, _beat(store, job_id, slot), now) > VACANT_S for slot in range(groups * group_size)
        ]
        if all(
            groups_over(store, job_id, 1, group)
            or (not spare and all(silent[group * group_size : (group + 1) * group_size]))
            for group in range(groups)
        ):
            return
        time.sleep(POLL_S)


def leave_group(store: Any, job_id: str, group: int) -> None:
    store.set(_key(job_id, "left", group), "1")


def first_to_fail(store: Any, job_id: str, node: int) -> bool:
    """Whether this node is the one agent that ends the failed job (one compare-and-set: the first)."""
    return store.compare_set(_key(job_id, "failed"), "", str(node)).decode() == str(node)


def verdict(group_size: int, slots: int, lost: int, min_nodes: int, spare: bool) -> str:
    """What a training agent does about a slot of its own replica group silent for VACANT_S: `lost` slots of the
    job are gone with it (it included), `spare`: a hot spare is waiting. `group_size` < `slots`: the job's
    slots are replica groups of that many (recovery=replicas), which never shrink (another group's slots are
    that group's business: `watched`)."""
    if spare:
        return SPARE
    if group_size < slots:
        return LEAVE
    if 0 < min_nodes <= slots - lost:
        return SHRINK
    return FAIL


def watched(own: int, group_size: int, count: int = WATCHED) -> list[int]:
    """The slots the agent of slot `own` watches: the next `count` of its replica group (of `group_size`
    slots), in a ring, so that every slot is watched by `count` agents whatever the group's size."""
    base = own - own % group_size
    return [base + (own - base + step) % group_size for step in range(1, min(count, group_size - 1) + 1)]


class PeerWatch(_StoreThread):
    """A training agent's eye on the next slots of its replica group (`watched`). A node that loses power goes
    silent and its peers' collectives block instead of failing; one whose death closed its connections leaves
    them in the rendezvous, waiting for a node that never comes. When a watched slot's counter stops moving for
    VACANT_S (UNTAKEN_S for a slot nobody took in a moved store) and the run has not ended, `act(verdict, slot,
    lost)` runs (`verdict` decides; `lost`: every node the job lost, this slot's holder included):

    - SPARE: nothing, for as long as a spare is waiting (it takes the slot, and the counter moves again);
    - SHRINK: once for that slot, unless this node's `workers()` (their pids) changed since the slot's last
      beat: the group restarted already (a node whose processes died closed its connections, and its peers
      failed at once). The agent then stops its own workers, which restarts the group without the silent node;
    - LEAVE, FAIL: once; the watch ends, and the agent leaves the run or ends the job.

    A slot that was judged lost (SHRINK) counts against `min_nodes` at the next one."""

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
        act: Callable[[str, int, tuple[int, ...]], None],
        min_nodes: int = 0,
        group_size: int = 0,
        moved: bool = False,
    ) -> None:
        super().__init__(host, port, timeout_s)
        self.job_id, self.slots, self.own = job_id, slots, own
        self.workers, self.act = workers, act
        self.min_nodes, self.group_size, self.moved = min_nodes, group_size or slots, moved

    def _run(self, store: Any) -> None:
        # slot -> its last beat, when, our workers then; a suspension of the job is no silence (`Silences`)
        silences = Silences(f"node of slot {self.own}")
        gone: set[int] = set()  # slots judged lost
        deferred: set[int] = set()  # slots left to a waiting spare (said once)
        slots = watched(self.own, self.group_size)
        while not self._stop.wait(POLL_S):
            if store.check([_key(self.job_id, "ended")]):
                return
            now, workers = silences.poll(), self.workers()
            spare = _spare_waiting(store, self.job_id, silences, now)
            for slot in slots:
                value = _beat(store, self.job_id, slot)
                if slot in gone or not (value or self.moved):
                    continue  # never beat here (not started yet): not silent
                silent = silences.silent_for(slot, value, now, workers)
                if silent <= (VACANT_S if value else UNTAKEN_S):
                    deferred.discard(slot)
                    continue
                holder = _holder(value) if value else None
                what = verdict(self.group_size, self.slots, len(gone) + 1, self.min_nodes, spare)
                if what == SPARE:
                    if slot not in deferred:
                        deferred.add(slot)
                        log.info("slot %d (node %s) is silent: a hot spare is waiting, it takes the slot", slot, holder)
                    continue
                gone.add(slot)
                if holder is not None:
                    add_lost(store, self.job_id, [holder])
                lost = tuple(sorted(lost_nodes(store, self.job_id) | ({holder} if holder is not None else set())))
                if what == SHRINK and workers != silences.extra(slot):
                    continue  # new workers since its last beat: the group restarted without it
                log.warning(
                    "slot %d (node %s) has been silent for %.1f s: %s (nodes lost: %s)",
                    slot,
                    "unknown: nobody took it in the moved store" if holder is None else holder,
                    silent,
                    {
                        SHRINK: "stopping this node's workers (the job goes on smaller)",
                        LEAVE: "no spare left: this replica group leaves the run",
                        FAIL: "no spare left and the job may not shrink: ending the job",
                    }[what],
                    ",".join(map(str, lost)) or "none known",
                )
                self.act(what, slot, lost)
                if what != SHRINK:
                    return


def _spare_waiting(store: Any, job_id: str, silences: Silences, now: float) -> bool:
    """Whether a hot spare of the job is waiting: its counter moved within VACANT_S (a spare that took a slot or
    left says so instead of a count)."""
    waiting = False
    for node in _numbers(store, _key(job_id, "spares")):
        value = store.get(_key(job_id, "spare", node)).decode()
        if value.isdigit() and silences.silent_for(("spare", node), value, now) <= VACANT_S:
            waiting = True
    return waiting


def _beat(store: Any, job_id: str, slot: int) -> str:
    key = _key(job_id, "alive", slot)
    return store.get(key).decode() if store.check([key]) else ""


def _holder(beat: str) -> int:
    """The node of a slot's counter ("node:count")."""
    return int(beat.split(":")[0])


def _numbers(store: Any, key: str) -> set[int]:
    """The node numbers appended to `key` ("3,5,"), none when it is not there."""
    return {int(n) for n in store.get(key).decode().split(",") if n} if store.check([key]) else set()


def _claim(store: Any, job_id: str, slot: int, beat: str, node: int) -> bool:
    """One compare-and-set on the slot's owner: the dead holder (by its last beat; none: nobody) -> this spare."""
    holder = beat.split(":")[0] if beat else ""
    return store.compare_set(_key(job_id, "owner", slot), holder, str(node)).decode() == str(node)
