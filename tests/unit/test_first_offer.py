"""One node per offer (issue 51 point 2): the choice, its spread, the delay, the hold."""

from __future__ import annotations

import collections

from metafora.consumer.first_offer import MAX_DELAY, MIN_DELAY, START_DELAY, FirstOffers, OfferDelay
from metafora.consumer.offer_queues import Deferred
from metafora.consumer.preference import Preference, preferred_node
from metafora.core.task import Task

NODES = [f"n{i}" for i in range(10)]


def first(node: str = "n0", nodes: list[str] = NODES, delay: OfferDelay | None = None) -> FirstOffers:
    ranking = Preference(node, hold=0.0, max_hold=0.0, wave=100)
    ranking.members(nodes)
    return FirstOffers(ranking, delay)


def test_exactly_one_node_tries_each_offer_at_once_and_shares_are_even() -> None:
    nodes = {n: first(n) for n in NODES}
    counts: collections.Counter[str] = collections.Counter()
    for i in range(10_000):
        task = Task(f"t{i}")
        now = [n for n, f in nodes.items() if f.split([task], 0.0)]
        assert now == [preferred_node(task.id, NODES)]  # the same choice on every node, no talk
        counts[now[0]] += 1
    assert all(850 < counts[n] < 1_150 for n in NODES), counts
    assert all(len(f) == 10_000 - counts[n] for n, f in nodes.items())


def test_a_held_offer_is_due_after_the_delay_and_not_held_again() -> None:
    f = first()
    theirs = [Task(f"t{i}") for i in range(50) if preferred_node(f"t{i}", NODES) != "n0"]
    assert f.split(theirs, 10.0) == []
    assert f.split(theirs, 10.001) == [] and len(f) == len(theirs)  # heard again: held once
    due_at = f.next_due()
    assert due_at is not None and 10.0 + START_DELAY < due_at <= 10.0 + 1.5 * START_DELAY + 1e-9
    assert f.due(10.0 + START_DELAY) == []
    due = f.due(10.0 + 1.5 * START_DELAY + 1e-9)
    assert sorted(t.id for t in due) == sorted(t.id for t in theirs)
    assert len(f) == 0 and f.next_due() is None
    # Offered again (a rescan), it is tried at once: it already waited its turn.
    assert f.split(theirs, 11.0) == theirs


def test_offers_held_within_one_half_delay_fall_due_together() -> None:
    f = first()
    theirs = [Task(f"t{i}") for i in range(200) if preferred_node(f"t{i}", NODES) != "n0"]
    for i, task in enumerate(theirs):  # a stream: one offer per millisecond
        f.split([task], 20.0 + i * 0.001)
    times = sorted({due for due, _, _ in f._heap})
    # 1 ms apart over ~180 ms: a few windows of 25 ms, not one check per offer.
    assert len(times) <= 180 * 0.001 / (START_DELAY / 2) + 2


def test_an_offer_checked_open_after_its_hold_is_adopted() -> None:
    f = first()
    theirs = [Task(f"t{i}") for i in range(30) if preferred_node(f"t{i}", NODES) != "n0"]
    assert not any(f.own(t) for t in theirs)
    f.adopt(theirs[:3])
    assert [f.own(t) for t in theirs[:4]] == [True, True, True, False]


def test_a_node_alone_and_placed_tasks_are_never_held() -> None:
    alone = first("n0", ["n0"])
    tasks = [Task(f"t{i}") for i in range(20)]
    assert alone.split(tasks, 0.0) == tasks
    f = first()
    placed = [Task(f"p{i}", selector={"zone": "eu"}) for i in range(10)]
    placed += [Task(f"q{i}", spread="g") for i in range(10)]
    assert f.split(placed, 0.0) == placed


def test_a_node_leaving_makes_every_held_offer_due_at_once() -> None:
    ranking = Preference("n0", hold=0.0, max_hold=0.0, wave=100)
    ranking.members(NODES)
    f = FirstOffers(ranking)
    theirs = [Task(f"t{i}") for i in range(30) if preferred_node(f"t{i}", NODES) != "n0"]
    f.split(theirs, 0.0)
    assert not ranking.members([*NODES, "n10"])  # a join is no leave
    assert ranking.members(NODES[:-1])
    f.flush(0.001)
    assert len(f.due(0.001)) == len(theirs)


def test_the_delay_is_twice_the_p99_claim_latency_clamped() -> None:
    delay = OfferDelay()
    assert delay.seconds == START_DELAY  # nothing timed yet
    for _ in range(200):
        delay.note(0.02)
    assert delay.seconds == 0.04
    for _ in range(200):
        delay.note(0.0005)  # a fast store: not below what scheduling noise allows
    assert delay.seconds == MIN_DELAY
    for _ in range(200):
        delay.note(5.0)  # an overloaded store: a full or dead first node costs 250 ms at most
    assert delay.seconds == MAX_DELAY


def test_the_delay_follows_the_tail_not_the_median() -> None:
    delay = OfferDelay()
    for i in range(128):
        delay.note(0.05 if i % 50 == 0 else 0.002)  # 3 slow claims in 128: the p99 sees them
    assert delay.seconds == 0.1


def test_a_full_node_takes_its_own_deferred_offers_first() -> None:
    deferred = Deferred()
    for i in range(5):
        deferred.put(Task(f"other{i}"), own=False)
        deferred.put(Task(f"own{i}"), own=True)
    deferred.put(Task("urgent", priority=5), own=False)  # priority still comes first
    taken = [t.id for t in deferred.take(7)]
    assert taken == ["urgent", "own0", "own1", "own2", "own3", "own4", "other0"]
    assert len(deferred) == 4


def test_due_offers_wait_behind_the_nodes_own_waiting_offers() -> None:
    deferred = Deferred()
    due = [Task("other0"), Task("other1"), Task("running")]
    # Nothing of its own waits (idle, or its share done): the due offers are tried at once.
    assert not deferred.behind_own(due, {"running"})
    assert len(deferred) == 0
    deferred.put(Task("own0"), own=True)
    deferred.put(Task("own1"), own=True)
    assert deferred.behind_own(due, {"running"})  # a running one is not deferred again
    assert [t.id for t in deferred.take(None)] == ["own0", "own1", "other0", "other1"]
    # Priority still comes first: a due offer of higher priority goes before its own.
    deferred.put(Task("own2"), own=True)
    assert deferred.behind_own([Task("urgent", priority=3)], set())
    assert [t.id for t in deferred.take(None)] == ["urgent", "own2"]


def test_a_task_tried_after_its_hold_is_held_again_once_forgotten() -> None:
    """A task tried after its hold is tried at once when heard again soon (it waited its
    turn), but not for ever: offered again a minute later (released, rebalanced) it is its
    first node's again, and the record of tries does not grow without bound."""
    from metafora.consumer.first_offer import _FORGET

    f = first()
    theirs = [Task(f"t{i}") for i in range(50) if preferred_node(f"t{i}", NODES) != "n0"]
    assert f.split(theirs, 10.0) == []
    assert len(f.due(20.0)) == len(theirs)
    assert f.split(theirs, 21.0) == theirs  # soon after: tried at once
    f.adopt(theirs[:3])
    assert all(f.own(t) for t in theirs[:3])
    later = 20.0 + _FORGET + 1.0
    assert f.split(theirs, later) == []  # forgotten: held for their first node again
    assert not any(f.own(t) for t in theirs[:3])
    assert len(f._tried) == 0 and len(f._tried_order) == 0
