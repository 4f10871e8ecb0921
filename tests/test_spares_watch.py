"""The training agents' watch on each other's beats (spares.PeerWatch), in every job of more than one node: what
it does about a silent slot (a spare waiting, shrinking, a replica group leaving, the job failing fast), and that
it names every node the job lost (issue 48, D1 and D5). Real beats into a real TCPStore, each holder a thread
that stops beating as its node would; the stale limit shortened so the tests stay short."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hpctrain.distributed import spares

VACANT_S = 1.5  # the tests' stale limit (3 s in production): still three beats' time
JOB = "48"


@pytest.fixture(autouse=True)
def short_stale_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spares, "VACANT_S", VACANT_S)


@pytest.fixture
def store() -> Iterator[Any]:
    from torch.distributed import TCPStore

    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


class Verdicts:
    """What the watch told the agent, and when."""

    def __init__(self) -> None:
        self.told: list[tuple[str, int, tuple[int, ...], float]] = []
        self.event = threading.Event()

    def __call__(self, verdict: str, slot: int, lost: tuple[int, ...]) -> None:
        self.told.append((verdict, slot, lost, time.monotonic()))
        self.event.set()

    def wait(self, timeout: float) -> tuple[str, int, tuple[int, ...], float] | None:
        self.event.wait(timeout)
        self.event.clear()
        return self.told[-1] if self.told else None


def beat(store: Any, slot: int, node: int) -> spares.Heartbeat:
    """Node `node`'s agent takes `slot` (a spare's claim took it already) and beats for it."""
    spares.hold(store, JOB, slot, node)
    return spares.Heartbeat("127.0.0.1", store.port, JOB, slot, node, 10).start()  # type: ignore[return-value]


def watch(store: Any, own: int, slots: int, told: Verdicts, **kwargs: Any) -> spares.PeerWatch:
    return spares.PeerWatch("127.0.0.1", store.port, JOB, slots, own, 10, lambda: {1}, told, **kwargs).start()  # type: ignore[return-value]


def test_the_verdict_on_a_silent_slot() -> None:
    """A spare waiting takes it; else a job that may shrink to what is left does; a replica group leaves; else
    the job fails. `lost` counts the silent slot itself."""
    assert spares.verdict(4, 4, 1, 0, spare=True) == spares.SPARE
    assert spares.verdict(4, 4, 1, 3, spare=False) == spares.SHRINK  # 3 left, min_nodes=3
    assert spares.verdict(4, 4, 2, 3, spare=False) == spares.FAIL  # 2 left: below min_nodes
    assert spares.verdict(4, 4, 1, 0, spare=False) == spares.FAIL  # may not shrink
    assert spares.verdict(2, 4, 1, 0, spare=False) == spares.LEAVE  # two groups of 2
    assert spares.verdict(2, 4, 1, 0, spare=True) == spares.SPARE


def test_each_agent_watches_the_next_slots_of_its_own_group() -> None:
    """A ring inside each replica group: every slot watched by min(3, group size - 1) agents of its group, none
    of another group, and no agent reads every counter of a large job."""
    assert spares.watched(0, 4) == [1, 2, 3] and spares.watched(3, 4) == [0, 1, 2]
    assert spares.watched(4, 3) == [5, 3]  # group 1 of size 3: slots 3, 4, 5
    assert spares.watched(0, 1) == []  # a group of one node: no one else in it
    for group_size, slots in ((2, 8), (3, 9), (8, 8), (100, 200)):
        watchers: dict[int, list[int]] = {}
        for own in range(slots):
            for slot in spares.watched(own, group_size):
                assert slot // group_size == own // group_size
                watchers.setdefault(slot, []).append(own)
        assert all(len(watchers[s]) == min(3, group_size - 1) for s in range(slots))


@pytest.mark.timeout(60)
def test_after_the_spare_took_a_slot_a_second_silence_ends_the_job_naming_both_nodes(store: Any) -> None:
    """D1: 2 training nodes and a spare. Node 1 goes silent: the spare (waiting, beating) takes its slot, and the
    agent of slot 0 leaves it to the spare. Then the spare, now in slot 1, goes silent too: no spare is left and
    the job may not shrink, so the agent says FAIL within the stale limit, naming nodes 1 and 2."""
    holders = {0: beat(store, 0, 0), 1: beat(store, 1, 1)}
    took: list[int | None] = []
    spare = threading.Thread(target=lambda: took.append(spares.wait_for_vacancy(store, JOB, 2, node=2)))
    spare.start()
    told = Verdicts()
    watcher = watch(store, 0, 2, told)
    time.sleep(1.0)
    holders[1].stop()  # node 1 dies
    spare.join(VACANT_S + 5)
    assert took == [1]
    holders[1] = beat(store, 1, 2)  # the spare's agent beats for slot 1
    time.sleep(VACANT_S + 1.0)
    assert told.told == []  # the first silence was the spare's to fill
    holders[1].stop()  # the second death: node 2, in slot 1
    died = time.monotonic()
    verdict = told.wait(VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.FAIL, 1, (1, 2)), told.told
    assert verdict[3] - died < VACANT_S + 1.5
    assert spares.lost_nodes(store, JOB) == {1, 2}
    watcher.stop()
    holders[0].stop()


@pytest.mark.timeout(60)
def test_a_spare_that_stopped_beating_is_not_waited_for(store: Any) -> None:
    """D5 with a dead spare: a spare registered, but its counter stopped (its node is gone too): the silent slot
    is not left to it; the job fails fast."""
    holders = {0: beat(store, 0, 0), 1: beat(store, 1, 1)}
    store.append(spares._key(JOB, "spares"), "2,")
    store.set(spares._key(JOB, "spare", 2), "7")  # beat once, long ago
    told = Verdicts()
    watcher = watch(store, 0, 2, told)
    time.sleep(1.0)
    holders[1].stop()
    verdict = told.wait(2 * VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.FAIL, 1, (1,)), told.told
    watcher.stop()
    holders[0].stop()


@pytest.mark.timeout(60)
def test_a_job_that_may_shrink_shrinks_once_then_fails_fast_below_min_nodes(store: Any) -> None:
    """elastic.min_nodes=2 of 3 nodes: the first silent node is shrunk away (the agent stops its workers), the
    second would leave fewer than min_nodes: FAIL, naming both."""
    holders = {slot: beat(store, slot, slot) for slot in range(3)}
    told = Verdicts()
    watcher = watch(store, 0, 3, told, min_nodes=2)
    time.sleep(1.0)
    holders[1].stop()
    verdict = told.wait(VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.SHRINK, 1, (1,)), told.told
    holders[2].stop()
    verdict = told.wait(VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.FAIL, 2, (1, 2)), told.told
    watcher.stop()
    holders[0].stop()


@pytest.mark.timeout(60)
def test_a_replica_group_leaves_when_it_loses_a_node_and_leaves_other_groups_alone(store: Any) -> None:
    """Two replica groups of 2 nodes (slots 0-1, 2-3): a node of group 1 going silent is that group's business;
    a node of this agent's own group going silent with no spare: LEAVE, the other group trains on."""
    holders = {slot: beat(store, slot, slot) for slot in range(4)}
    told = Verdicts()
    watcher = watch(store, 0, 4, told, group_size=2)
    time.sleep(1.0)
    holders[2].stop()  # group 1's
    assert told.wait(VACANT_S + 1.5) is None
    holders[1].stop()  # this group's
    verdict = told.wait(VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.LEAVE, 1, (1,)), told.told
    watcher.stop()
    for holder in holders.values():
        holder.stop()


@pytest.mark.timeout(60)
def test_in_a_moved_store_a_slot_nobody_took_is_judged_after_the_longer_limit(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store moved with its host, which died: its slot is never taken in the new store. The watch judges it
    vacant only after UNTAKEN_S (an agent may still be on its way there), then fails the job; its holder is
    unknown (the agents add the store's dead host to the lost nodes themselves)."""
    monkeypatch.setattr(spares, "UNTAKEN_S", 2 * VACANT_S)
    own = beat(store, 1, 1)
    spares.add_lost(store, JOB, [0])  # what elastic.py's agents add: the store's old host
    told = Verdicts()
    start = time.monotonic()
    watcher = watch(store, 1, 2, told, moved=True)
    verdict = told.wait(2 * VACANT_S + 5)
    assert verdict is not None and verdict[:3] == (spares.FAIL, 0, (0,)), told.told
    assert verdict[3] - start > 2 * VACANT_S
    watcher.stop()
    own.stop()


@pytest.mark.timeout(60)
def test_the_stores_host_serves_until_every_replica_group_is_over(store: Any) -> None:
    """The agent hosting the store (and the lighthouse) stays until every group is over: group 0 says it is
    done, group 1 (one node) is still training; when group 1's only node dies, no one is left to say so, and
    its silence ends the wait."""
    holders = {slot: beat(store, slot, slot) for slot in (0, 1)}
    spares.group_over(store, JOB, 0)
    waiter = threading.Thread(target=spares.wait_for_groups, args=(store, JOB, 2, 1))
    waiter.start()
    waiter.join(VACANT_S + 1.0)
    assert waiter.is_alive()  # group 1 trains on
    holders[1].stop()
    waiter.join(VACANT_S + 3.0)
    assert not waiter.is_alive()
    holders[0].stop()
